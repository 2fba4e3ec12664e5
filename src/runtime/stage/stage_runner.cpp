// Runs one stage job and turns its errors into its call's: see
// stage_runner.h; the job's parts are in stage_run.h.
#include "runtime/stage/stage_runner.h"

#include <c10/util/Exception.h>

#include <sstream>
#include <string_view>

#include "roundpipe/errors.h"
#include "runtime/stage/stage_run.h"

namespace roundpipe::detail {

StageRun::StageRun(const StageContext& context, Job& j, DeviceWorker& w)
    : ctx(context),
      job(j),
      worker(w),
      device(w.device()),
      call(*j.call),
      binding(context, j, w.device(), where),
      timer(w.device(), context.timings, context.host_tasks),
      retry(j.call->config.execute_plan.has_value()) {}

void StageRun::run() {
  where.phase = "parameter upload";
  worker.wait_for_upload(job);
  binding.acquire_instances();
  if (job.kind == JobKind::kForward) run_forward();
  if (job.kind == JobKind::kBackward) run_backward();
  if (job.kind == JobKind::kTail) run_tail();
  where.layer = -1;
  where.microbatch = -1;
  // Buffer commits first: a next call's forward of these layers waits
  // for them, not for the gradients.
  if (job.kind != JobKind::kBackward) binding.commit_buffers();
  if (job.kind != JobKind::kForward) binding.download_param_grads();
}

void run_stage_job(const StageContext& ctx, Job& job, DeviceWorker& worker) {
  auto& call = *job.call;
  if (call.aborted) return;
  StageRun run(ctx, job, worker);
  const StageProgress& where = run.where;
  auto fail = [&](const std::string& what, bool oom) {
    std::ostringstream msg;
    msg << ctx.name << ": " << job.describe() << " failed on " << worker.device().name();
    if (where.layer >= 0)
      msg << " in layer " << where.layer << " (" << ctx.layers[where.layer]->type_name() << ")";
    if (where.microbatch >= 0) msg << ", microbatch " << where.microbatch;
    msg << ", phase " << where.phase << ": " << what;
    if (oom && std::string_view(where.phase) == "loss") {
      msg << "\nThe loss function runs on a whole microbatch's output; a loss over full logits "
             "takes several times their size. Use more microbatches (num_microbatch), or a loss "
             "that never holds the logits (a preset's own: labels in input_kwargs, "
             "loss_fn=lambda o, _: o.loss / num_microbatch).";
    }
    call.fail(StageError(msg.str(), job.describe(), where.layer, where.microbatch, where.phase,
                         worker.device().name(), oom, std::current_exception()));
  };
  try {
    run.run();
  } catch (const CallAborted&) {
  } catch (const c10::OutOfMemoryError& e) {
    fail(e.what_without_backtrace(), true);
  } catch (const c10::Error& e) {
    fail(e.what_without_backtrace(), false);
  } catch (const std::exception& e) {
    fail(e.what(), false);
  } catch (...) {
    fail("unknown exception", false);
  }
  job.device_params.clear();
}

}  // namespace roundpipe::detail
