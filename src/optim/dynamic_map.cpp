#include "optim/dynamic_map.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linspace.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace roundpipe::optim {
namespace {

// bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7,
// total_bits=8) as its documentation describes it: for each exponent i of
// 0..6, the midpoints of an even split of [0.1, 1] into 2^i parts (2^(i+1)
// unsigned) times 10^(i-6), negated too where signed; then 0 and 1; sorted.
// The float32 arithmetic is the same ATen operations, so the codes are
// bit-identical to that function's.
at::Tensor build_codes(bool is_signed) {
  std::vector<at::Tensor> parts;
  for (int i = 0; i < 7; ++i) {
    const int64_t items = (is_signed ? (int64_t{1} << i) : (int64_t{2} << i)) + 1;
    const auto bounds = at::linspace(0.1, 1.0, items, at::TensorOptions(at::kFloat));
    const auto means = (bounds.slice(0, 0, items - 1) + bounds.slice(0, 1, items)) / 2.0;
    const double scale = std::pow(10.0, i - 6);
    parts.push_back(means * scale);
    if (is_signed) parts.push_back(means * -scale);
  }
  parts.push_back(at::tensor({0.0f, 1.0f}));
  auto codes = std::get<0>(at::cat(parts).sort());
  TORCH_INTERNAL_ASSERT(codes.numel() == 256, "dynamic map of ", codes.numel(), " codes");
  return codes.contiguous();
}

std::unique_ptr<DynamicMap> build_map(bool is_signed) {
  auto map = std::make_unique<DynamicMap>();
  const auto codes = build_codes(is_signed);
  std::copy_n(codes.data_ptr<float>(), 256, map->code.begin());
  map->is_signed = is_signed;
  const auto& code = map->code;
  // The positive codes: decade d has 2^d cells (signed) or 2^(d+1), its
  // codes after those of the decades below; 0 and 1 around them.
  const int zero = is_signed ? 127 : 0;
  map->zero_index = zero;
  int first = zero + 1;
  for (int d = 0; d < 7; ++d) {
    const int cells = is_signed ? 1 << d : 2 << d;
    const double power = std::pow(10.0, d - 6);
    map->cell_scale[d] = static_cast<float>(cells / (0.9 * power));
    map->cell_offset[d] = static_cast<float>(cells / 9.0);
    map->first_index[d] = first;
    map->last_cell[d] = cells - 1;
    map->decade_from[d] = (code[first - 1] + code[first]) / 2;  // (first - 1: the code below)
    first += cells;
  }
  TORCH_INTERNAL_ASSERT(first == 255 && code[255] == 1.0f && code[zero] == 0.0f,
                        "dynamic map: unexpected layout");
  map->decade_from[7] = (code[254] + code[255]) / 2;
  // The decades' codes are where the layout says: each on its grid cell.
  for (int d = 0; d < 7; ++d) {
    for (int c = 0; c <= map->last_cell[d]; ++c) {
      const int index = map->first_index[d] + c;
      TORCH_INTERNAL_ASSERT(map->quantize(code[index]) == index, "dynamic map: code ", index,
                            " is not its own nearest code");
      if (is_signed)
        TORCH_INTERNAL_ASSERT(map->quantize(-code[index]) == 254 - index,
                              "dynamic map: negative code of index ", 254 - index);
    }
  }
  return map;
}

}  // namespace

uint8_t nearest_code(const std::array<float, 256>& code, float x) {
  // The first code above x, then the nearer of it and the one below.
  const auto above = std::upper_bound(code.begin(), code.end(), x) - code.begin();
  if (above == 0) return 0;
  if (above == 256) return 255;
  const float below_distance = std::fabs(x - code[above - 1]);
  const float above_distance = std::fabs(x - code[above]);
  return static_cast<uint8_t>(above_distance < below_distance ? above : above - 1);
}

const DynamicMap& signed_dynamic_map() {
  static const auto map = build_map(true);
  return *map;
}

const DynamicMap& unsigned_dynamic_map() {
  static const auto map = build_map(false);
  return *map;
}

at::Tensor dynamic_map_tensor(bool is_signed) {
  const auto& code = (is_signed ? signed_dynamic_map() : unsigned_dynamic_map()).code;
  return at::tensor(at::ArrayRef<float>(code.data(), code.size()));
}

}  // namespace roundpipe::optim
