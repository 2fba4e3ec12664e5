// Checkpoints that transformers saved from a bitsandbytes-quantized model
// (internal; Note [bitsandbytes checkpoints] in bnb_checkpoint.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>

#include "roundpipe/models/quantized.h"

namespace roundpipe::models::detail {

// A weight as bitsandbytes stored it: 4 bits (`four`) or 8 (`eight`).
struct StoredQuantized {
  BaseQuantization format;
  Quantized4Bit four;
  Quantized8Bit eight;
  // The weight [out, in] in `dtype`.
  at::Tensor dequantize(c10::ScalarType dtype) const;
};

// The quantization config.json declares (quantization_config with
// quant_method "bitsandbytes"), if any.
std::optional<BaseQuantization> bnb_checkpoint_format(const std::string& config_json_path);

// The tensor of a checkpoint by name (undefined where it has none).
using TensorFinder = std::function<at::Tensor(const std::string&)>;

// The weight `name` ("<module>.weight") if the checkpoint stores it
// quantized by bitsandbytes; nullopt if it stores it in full precision.
std::optional<StoredQuantized> read_bnb_weight(const std::string& name, const TensorFinder& find);

}  // namespace roundpipe::models::detail
