// RoundPipe's random-number protocol (used when preserve_rng_state is on).
//
// Each microbatch draws from one random stream that runs through the whole
// model in layer order, whatever the plan or device: a call takes
// call_seed = the next random64() of the CPU default generator, microbatch m
// starts layer 0 with its device generator seeded microbatch_seed(call_seed,
// m), and every stage hand-off carries the generator state on to the next
// device. Recompute restores the state saved at the layer it starts from, so
// dropout masks in recompute equal the forward's exactly, also when a
// backward stage spans a forward-stage boundary. The caller's generator
// states are restored after each use. Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>

#include "roundpipe/device.h"

namespace roundpipe {

inline uint64_t microbatch_seed(uint64_t call_seed, int microbatch) {
  // splitmix64 of (call_seed, microbatch): well-spread, distinct seeds.
  uint64_t z = call_seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(microbatch + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFFull;
}

namespace detail {

// Generator state at a point of a microbatch's random stream.
struct RngState {
  bool active = false;  // false: preserve_rng_state is off, leave generators alone
  at::Tensor state;     // generator state; undefined: start from `seed`
  uint64_t seed = 0;
};

// The device generator's state now (inactive: nothing captured).
RngState capture_rng(Device& device, bool active);
// Sets the device generator to `rng` (inactive: leaves it alone).
void apply_rng(Device& device, const RngState& rng);

// Sets a microbatch's random stream on the device generator and restores
// the generator's own state afterwards.
class RngScope {
 public:
  RngScope(Device& device, const RngState& start);
  ~RngScope();
  RngScope(const RngScope&) = delete;
  RngScope& operator=(const RngScope&) = delete;
  RngState capture() { return capture_rng(device_, active_); }

 private:
  Device& device_;
  bool active_;
  RngState saved_;
};

// Held while the engine borrows the CPU default generator outside the
// random streams (a layer instance's initialisation; a call's seed draw),
// so that the two never interleave. Taken after a device's compute lock.
std::mutex& cpu_generator_borrow_mutex();

// A call's seed: the next random64() of the CPU default generator, drawn
// under `device`'s compute lock and the borrow mutex.
uint64_t draw_call_seed(Device& device);

}  // namespace detail
}  // namespace roundpipe
