// The random-stream protocol's generator handling: see rng.h.
#include "runtime/values/rng.h"

#include <ATen/CPUGeneratorImpl.h>

namespace roundpipe::detail {

RngState capture_rng(Device& device, bool active) {
  RngState rng;
  rng.active = active;
  if (!active) return rng;
  auto gen = device.generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  HostAllocationScope host;  // a generator state is a host tensor
  rng.state = gen.get_state();
  return rng;
}

void apply_rng(Device& device, const RngState& rng) {
  if (!rng.active) return;
  auto gen = device.generator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  if (rng.state.defined()) {
    gen.set_state(rng.state);
  } else {
    gen.set_current_seed(rng.seed);
  }
}

RngScope::RngScope(Device& device, const RngState& start) : device_(device), active_(start.active) {
  if (!active_) return;
  saved_ = capture_rng(device_, true);
  apply_rng(device_, start);
}

RngScope::~RngScope() {
  if (active_) apply_rng(device_, saved_);
}

std::mutex& cpu_generator_borrow_mutex() {
  static std::mutex mu;
  return mu;
}

uint64_t draw_call_seed(Device& device) {
  // Earlier calls' backward stages may still run: on simulated devices
  // their random streams borrow this generator (under the compute lock),
  // on any device a new layer instance's initialisation does.
  auto compute = device.compute_lock();
  std::lock_guard<std::mutex> borrow(cpu_generator_borrow_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

}  // namespace roundpipe::detail
