// A forward stage, and one layer's forward as every job runs it (timed,
// checked, metered for the plan): see stage_run.h.
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>

#include <optional>

#include "runtime/memory/allocation_meter.h"
#include "runtime/stage/stage_run.h"
#include "runtime/values/ivalue_tree.h"
#include "runtime/values/recompute_state.h"
#include "runtime/values/transfer.h"

namespace roundpipe::detail {

namespace {

void check_devices(const c10::IValue& value, const Device& device, int layer,
                   const std::string& type_name) {
  const auto expected = device.torch_device();
  for (const auto& t : flatten_tensors(value)) {
    if (!t.defined()) continue;
    TORCH_CHECK(t.device() == expected, "layer ", layer, " (", type_name, ") returned a tensor on ",
                t.device(), " while running on ", device.name(), " (", expected,
                "). A layer's temporaries and outputs must take their device from its inputs or "
                "weights, never a fixed device.");
  }
}

}  // namespace

c10::IValue StageRun::run_layer(int l, const c10::IValue& x, bool recompute, bool metered) {
  where.layer = l;
  where.phase = recompute ? "recompute" : "forward";
  LayerCallScope scope(call.recompute, l, where.microbatch, recompute, device.torch_device(),
                       call.training);
  const bool with_grad = c10::GradMode::is_enabled();
  // The first few forwards with grad are metered: what the layer still
  // holds after one is what it keeps for its backward (the planner's
  // activation memory).
  std::optional<MeterScope> metering;
  if (with_grad && metered && ctx.layers[l]->meterable() && ctx.timings.wants_kept_bytes(l))
    metering.emplace();
  auto start = timer.mark();
  auto y = binding.instance(l).forward(x);
  const auto* meter = metering ? metering->meter() : nullptr;
  const int64_t kept = meter ? meter->net_bytes() : -1;
  const int64_t peak = meter ? meter->peak_bytes() : -1;
  metering.reset();
  timer.add(l, with_grad ? LayerTimings::kRecompute : LayerTimings::kForward, start, timer.mark());
  check_devices(y, device, l, ctx.layers[l]->type_name());
  int64_t bytes = 0;
  for (const auto& t : flatten_tensors(y)) bytes += t.defined() ? t.nbytes() : 0;
  if (metered) ctx.timings.add_output_bytes(l, bytes);
  if (kept >= 0)
    ctx.timings.add_kept_bytes(l, kept, peak, bytes, scope.kept_bytes_independent_of_rows);
  return y;
}

// Each microbatch through the stage's layers without grad; the inputs of
// the layers where a later backward stage starts go to the call's slots.
void StageRun::run_forward() {
  const auto& r = job.range;
  for (int m = 0; m < call.n; ++m) {
    where.microbatch = m;
    Slot& in = call.wait(call.act.at(r.begin)[m]);
    auto x = binding.load_input(in);
    RngState out_rng;
    {
      auto lock = device.compute_lock();
      RngScope rng(device, in.rng);
      c10::NoGradGuard no_grad;
      for (int l = r.begin; l < r.end; ++l) {
        if (l > r.begin && call.act.count(l)) {
          where.phase = "download";
          auto [saved, event] = download_value(device, x, ctx.weights.host_allocator());
          CallState::put(*call.act.at(l)[m], saved, {}, event, rng.capture());
        }
        x = run_layer(l, x, /*recompute=*/false, /*metered=*/true);
      }
      out_rng = rng.capture();
    }
    where.layer = -1;
    where.phase = "download";
    auto [out, event] = download_value(device, x, ctx.weights.host_allocator());
    CallState::put(*call.act.at(r.end)[m], out, {}, event, out_rng);
    timer.flush(r);
  }
}

}  // namespace roundpipe::detail
