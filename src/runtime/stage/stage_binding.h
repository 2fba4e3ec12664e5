// A stage job's binding and transfers: its layer instances bound to the
// stage's parameters (uploaded by the device worker) and buffers, the
// hand-offs it loads and sends (inputs, output gradients, losses, outputs),
// its parameter-gradient download and its buffer commit. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "runtime/parts/call.h"
#include "runtime/stage/stage_runner.h"

namespace roundpipe::detail {

// Where a stage job is, for its errors (layer -1: none; microbatch -1: none).
struct StageProgress {
  int layer = -1;
  int microbatch = -1;
  const char* phase = "start";
};

class StageBinding {
 public:
  StageBinding(const StageContext& context, Job& job, Device& device, StageProgress& progress);
  ~StageBinding();  // the instances go back to the context's pool, unbound
  StageBinding(const StageBinding&) = delete;
  StageBinding& operator=(const StageBinding&) = delete;

  // Takes an instance of each of the stage's layers (unbound).
  void acquire_instances();
  LayerInstance& instance(int layer) { return *instances_.at(layer); }
  const std::map<int, std::unique_ptr<LayerInstance>>& instances() const { return instances_; }

  // Binds the stage's parameters and buffers, once: home buffers (a forward
  // or the tail, after earlier calls committed theirs; it snapshots them
  // for a redo) or, for a backward stage, the snapshot its call's forward
  // took before its first microbatch.
  void bind();
  bool bound() const { return bound_; }

  // The stage input in `slot`, uploaded and waited for by compute (binds first).
  c10::IValue load_input(Slot& slot);
  // The gradient of the stage output for microbatch m.
  std::vector<at::Tensor> load_grad(int boundary, int microbatch);
  // Gradients of layer `layer`'s input for microbatch m to the stage before
  // (at layer 0: to the caller, where it wants them).
  void send_input_gradients(int layer, int microbatch, const std::vector<at::Tensor>& grads);
  // The microbatch's loss (on this device) and output (None unless asked
  // for; on the host, made by download_output) to the caller.
  c10::IValue download_output(const c10::IValue& output);
  void send_results(int microbatch, const at::Tensor& loss, const c10::IValue& output);
  // While held, send_results downloads but does not hand over: the caller's
  // forward_backward returns once every loss is handed over, and the fused
  // tail holds its last microbatch's until that microbatch's backward is
  // done, so that running out of memory there redoes the call (Note
  // [Out-of-memory retry of a microbatch]). release_results hands them
  // over; a job that fails never does.
  void hold_results(bool hold) { hold_results_ = hold; }
  void release_results();
  // Host memory event of the last download_output.
  const EventPtr& output_event() const { return output_event_; }

  // Each unique parameter's gradient summed over the stage's layers, to the
  // call's gradient ledger (on the gradient-task thread).
  void download_param_grads();
  // A forward's (or the tail's) buffer writes, to the homes after its last
  // microbatch, in commit order across calls.
  void commit_buffers();

  // A layer's buffer values (to undo a try's writes), and their restore.
  std::vector<at::Tensor> clone_buffers(int layer);
  void restore_buffers(int layer, const std::vector<at::Tensor>& kept);

 private:
  void wait_for_earlier_commits();
  const StageContext& ctx_;
  Job& job_;
  Device& device_;
  CallState& call_;
  StageProgress& progress_;
  std::map<int, std::unique_ptr<LayerInstance>> instances_;
  bool bound_ = false;
  EventPtr output_event_;
  bool hold_results_ = false;
  std::vector<std::function<void()>> held_results_;
};

}  // namespace roundpipe::detail
