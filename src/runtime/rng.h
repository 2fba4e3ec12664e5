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
// states are restored after each use.
#pragma once

#include <cstdint>

namespace roundpipe {

inline uint64_t microbatch_seed(uint64_t call_seed, int microbatch) {
  // splitmix64 of (call_seed, microbatch): well-spread, distinct seeds.
  uint64_t z = call_seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(microbatch + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFFull;
}

}  // namespace roundpipe
