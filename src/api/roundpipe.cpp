// The public RoundPipe class: a thin front over detail::Engine.
#include "roundpipe/roundpipe.h"

#include <c10/util/Exception.h>

#include "runtime/engine/engine.h"

namespace roundpipe {

PinMode pin_mode_from_string(const std::string& text) {
  if (text == "alloc") return PinMode::kAlloc;
  if (text == "register") return PinMode::kRegister;
  if (text == "off") return PinMode::kOff;
  TORCH_CHECK(false, "unknown pin_model '", text, "': use alloc, register or off");
}

bool on_roundpipe_thread() {
  return detail::on_any_engine_thread();
}

c10::ScalarType dtype_from_string(const std::string& text) {
  if (text == "float32" || text == "fp32") return c10::kFloat;
  if (text == "bfloat16" || text == "bf16") return c10::kBFloat16;
  if (text == "float16" || text == "fp16") return c10::kHalf;
  TORCH_CHECK(false, "unknown dtype '", text, "': use float32, bfloat16 or float16");
}

RoundPipe::RoundPipe(torch::nn::Sequential model, RoundPipeOptions options)
    : RoundPipe(layers_of(model), std::move(options)) {}

RoundPipe::RoundPipe(std::vector<LayerPtr> layers, RoundPipeOptions options)
    : engine_(std::make_unique<detail::Engine>(std::move(layers), std::move(options))) {}

RoundPipe::~RoundPipe() = default;

c10::IValue RoundPipe::forward(const c10::IValue& input, const RunConfig& config) {
  return engine_->forward(input, config);
}

at::Tensor RoundPipe::forward(const at::Tensor& input, const RunConfig& config) {
  auto out = engine_->forward(c10::IValue(input), config);
  TORCH_CHECK(out.isTensor(), name(), ": the model returned a ", out.tagKind(),
              ", not a tensor; call forward(c10::IValue) to get it");
  return out.toTensor();
}

ForwardBackwardResult RoundPipe::forward_backward(const c10::IValue& input,
                                                  const c10::IValue& label, const LossFn& loss_fn,
                                                  bool return_outputs, const RunConfig& config) {
  return engine_->forward_backward(input, label, loss_fn, return_outputs, config);
}

void RoundPipe::synchronize() {
  engine_->synchronize();
}
bool RoundPipe::wait_for_background_work() {
  return engine_->wait_for_background_work();
}
void RoundPipe::restore_pending_update() {
  engine_->restore_pending_update();
}
std::vector<at::Tensor> RoundPipe::parameters() const {
  return engine_->parameters();
}
int RoundPipe::num_layers() const {
  return engine_->num_layers();
}
const DevicePool& RoundPipe::devices() const {
  return engine_->pool();
}
const std::string& RoundPipe::name() const {
  return engine_->name();
}
ExecutePlan RoundPipe::default_plan(bool fused) const {
  return engine_->default_plan(fused);
}
PlanEstimate RoundPipe::auto_plan(bool fused, int num_microbatches, int min_stages,
                                  std::optional<double> memory_limit_gib, int tail_rows) const {
  return engine_->auto_plan(fused, num_microbatches, min_stages, memory_limit_gib, std::nullopt,
                            tail_rows);
}
std::optional<c10::ScalarType> RoundPipe::optim_dtype() const {
  return engine_->optim_dtype();
}
const DataParallelOptions* RoundPipe::data_parallel() const {
  return engine_->data_parallel();
}
HostMemoryStats RoundPipe::host_memory_stats() const {
  return engine_->host_memory_stats();
}
PipelineStats RoundPipe::pipeline_stats() const {
  return engine_->pipeline_stats();
}
double RoundPipe::measure_weight_upload_rate() {
  return engine_->measure_weight_upload_rate();
}

}  // namespace roundpipe

namespace roundpipe {

void RoundPipe::step(std::function<void()> step_fn, bool is_async) {
  engine_->step(std::move(step_fn), is_async);
}
void RoundPipe::step(optim::Adam& adam, bool is_async, optim::GradScaler* scaler,
                     optim::GradClipper* clip) {
  engine_->step_fused(adam, is_async, scaler, clip);
}
void RoundPipe::step(optim::FusedUpdate update, bool is_async) {
  engine_->step_fused(std::move(update), is_async);
}
std::vector<at::Tensor> RoundPipe::optim_parameters() {
  return engine_->optim_parameters();
}
std::vector<std::pair<std::string, at::Tensor>> RoundPipe::named_parameters() const {
  return engine_->named_parameters();
}
std::vector<std::pair<std::string, at::Tensor>> RoundPipe::named_buffers() const {
  return engine_->named_buffers();
}
std::vector<std::pair<std::string, at::Tensor>> RoundPipe::optim_named_parameters() {
  return engine_->optim_named_parameters();
}

}  // namespace roundpipe
