// The 8-bit dynamic quantization maps of blockwise 8-bit optimizer state
// (bitsandbytes' format) and the nearest-code search over them. Internal
// header.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace roundpipe::optim {

// Elements of a state tensor that share one scale (absmax).
constexpr int64_t kQuantBlock = 256;

// One of the two dynamic maps: 256 sorted codes in [-1, 1] (signed, for the
// first moment) or [0, 1] (unsigned, for the second), each a power of ten
// times a linear fraction, so small values keep their relative precision.
//
// Note [Nearest code by arithmetic]
// A value is stored as the index of its nearest code. Searching 256 codes
// (or a table, whose reads are gathers or scalar loads) would dominate the
// optimizer step, so the index is computed the way the map is built: the
// codes of each power of ten d (0..6) are the midpoints of an even grid on
// [0.1, 1] * 10^(d-6), so the nearest code of a magnitude a is the grid
// cell a falls in, floor((a / 10^(d-6) - 0.1) * cells / 0.9), its decade
// found by comparing a with the midpoints between the decades' outer codes
// (and those next to 0 and 1). All of it is compares, selects and one
// multiply-add, which vectorise. It gives the search's code except where a
// lies within rounding (a few ulps) of a midpoint between two codes, where
// it may give the other of the two, equally near (tests/optim checks both).
struct DynamicMap {
  std::array<float, 256> code;
  bool is_signed = false;
  // Where each decade's codes begin: [0] the midpoint between 0 and the
  // first nonzero code, [d] (1..6) between decades d-1 and d, [7] between
  // the last code below 1 and 1.
  std::array<float, 8> decade_from;
  // Within decade d: cell = (int)(a * cell_scale[d] - cell_offset[d]),
  // clamped to [0, last_cell[d]], and the index first_index[d] + cell.
  std::array<float, 7> cell_scale, cell_offset;
  std::array<int32_t, 7> first_index, last_cell;
  int32_t zero_index = 0;  // the index of 0

  __attribute__((always_inline)) uint8_t quantize(float x) const {
    const float a = std::fabs(x);
    float scale = cell_scale[0], offset = cell_offset[0];
    int32_t first = first_index[0], last = last_cell[0];
#pragma GCC unroll 6
    for (int d = 1; d < 7; ++d) {
      const bool above = a >= decade_from[d];
      scale = above ? cell_scale[d] : scale;
      offset = above ? cell_offset[d] : offset;
      first = above ? first_index[d] : first;
      last = above ? last_cell[d] : last;
    }
    int32_t cell = static_cast<int32_t>(a * scale - offset);
    cell = cell < 0 ? 0 : (cell > last ? last : cell);
    int32_t index = first + cell;
    // (At or above the last midpoint: 1, or for a negative value the code
    // farthest below 0.)
    index = a >= decade_from[7] ? 255 : index;
    if (is_signed) index = x < 0 ? 254 - (index > 254 ? 254 : index) : index;
    index = a < decade_from[0] ? zero_index : index;
    return static_cast<uint8_t>(index);
  }
};

// The maps bitsandbytes' 8-bit optimizers use (create_dynamic_map(signed)),
// built once.
const DynamicMap& signed_dynamic_map();
const DynamicMap& unsigned_dynamic_map();

// The map's codes as a float32 tensor of 256 (bitsandbytes' qmap1/qmap2).
at::Tensor dynamic_map_tensor(bool is_signed);

// The index of the code nearest to x (the lower one on a tie) by searching
// the sorted codes: the reference DynamicMap::quantize is checked against.
uint8_t nearest_code(const std::array<float, 256>& code, float x);

}  // namespace roundpipe::optim
