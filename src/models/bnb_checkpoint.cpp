// Note [bitsandbytes checkpoints]
// transformers saves a model it loaded with BitsAndBytesConfig (the hub's
// "-bnb-4bit" checkpoints) with its quantization_config (quant_method
// "bitsandbytes", load_in_4bit / load_in_8bit, bnb_4bit_quant_type,
// bnb_4bit_use_double_quant) and, for each quantized projection:
//   - 4 bits: "<m>.weight" the packed codes (uint8 [n / 2, 1]),
//     "<m>.weight.absmax" (uint8 codes when double quantized, else float32),
//     "<m>.weight.quant_map" (the 16 code values),
//     "<m>.weight.nested_absmax", "<m>.weight.nested_quant_map" (double
//     quantization's scales and dynamic map), and
//     "<m>.weight.quant_state.bitsandbytes__<nf4|fp4>": a JSON text as
//     uint8 bytes (quant_type, blocksize, dtype, shape, nested_blocksize,
//     nested_offset);
//   - 8 bits: "<m>.weight" int8 [out, in] and "<m>.SCB" float32 [out].
// This is bitsandbytes' own layout (Note [4-bit base weights], Note [8-bit
// base weights]), so from_pretrained takes the tensors as they are where
// the model keeps that format, and dequantizes them where it does not (a
// full-precision model, or another format asked for).
#include "models/bnb_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <fstream>
#include <nlohmann/json.hpp>

namespace roundpipe::models::detail {

at::Tensor StoredQuantized::dequantize(c10::ScalarType dtype) const {
  if (!is_4bit(format.type)) {
    auto q = eight;
    q.dtype = dtype;
    return dequantize_8bit(q);
  }
  auto q = four;
  q.dtype = dtype;
  return dequantize_4bit(q);
}

std::optional<BaseQuantization> bnb_checkpoint_format(const std::string& config_json_path) {
  std::ifstream in(config_json_path);
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("quantization_config")) return std::nullopt;
  const auto& q = j["quantization_config"];
  if (q.value("quant_method", "") != "bitsandbytes") return std::nullopt;
  if (q.value("load_in_8bit", false)) return BaseQuantization{QuantType::kInt8, false};
  TORCH_CHECK(q.value("load_in_4bit", false), config_json_path,
              ": a bitsandbytes quantization_config with neither load_in_4bit nor load_in_8bit");
  return BaseQuantization{quant_type_from_string(q.value("bnb_4bit_quant_type", "fp4")),
                          q.value("bnb_4bit_use_double_quant", false)};
}

std::optional<StoredQuantized> read_bnb_weight(const std::string& name, const TensorFinder& find) {
  const std::string suffix = ".weight";
  if (name.size() <= suffix.size() || name.compare(name.size() - 7, 7, suffix) != 0)
    return std::nullopt;
  const auto module = name.substr(0, name.size() - suffix.size());
  if (auto scb = find(module + ".SCB"); scb.defined()) {
    StoredQuantized s;
    s.format = {QuantType::kInt8, false};
    s.eight.type = QuantType::kInt8;
    s.eight.values = find(name);
    s.eight.scale = scb.to(at::kFloat).reshape(-1);
    TORCH_CHECK(s.eight.values.scalar_type() == at::kChar && s.eight.values.dim() == 2, "'", name,
                "' has an SCB beside it but is ", s.eight.values.scalar_type(), " ",
                s.eight.values.sizes(), ", not bitsandbytes' int8 [out, in]");
    return s;
  }
  at::Tensor state;
  for (const char* type : {"nf4", "fp4"})
    if (!state.defined()) state = find(name + ".quant_state.bitsandbytes__" + type);
  if (!state.defined()) return std::nullopt;
  const auto bytes = state.contiguous().to(at::kByte);
  const std::string text(reinterpret_cast<const char*>(bytes.const_data_ptr<uint8_t>()),
                         bytes.numel());
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object() && j.contains("shape") && j.contains("quant_type"), "'", name,
              "': its bitsandbytes quant_state is not the JSON bitsandbytes writes: ", text);
  StoredQuantized s;
  auto& q = s.four;
  q.type = quant_type_from_string(j["quant_type"].get<std::string>());
  TORCH_CHECK(is_4bit(q.type), "'", name, "': a 4-bit quant_state of type ", to_string(q.type));
  q.blocksize = j.value("blocksize", 64);
  q.shape = j["shape"].get<std::vector<int64_t>>();
  q.packed = find(name).view(at::kByte).reshape(-1);  // (any bnb_4bit_quant_storage)
  q.absmax = find(name + ".absmax").reshape(-1);
  const auto map = find(name + ".quant_map");
  TORCH_CHECK(!map.defined() || at::equal(map.to(at::kFloat).reshape(-1), code_table(q.type)), "'",
              name, "': its ", to_string(q.type),
              " code values are not bitsandbytes' (a custom quant_map is not read)");
  const bool nested = j.contains("nested_offset");
  if (nested) {
    TORCH_CHECK(j.value("nested_blocksize", 256) == 256, "'", name,
                "': double-quantized scales in blocks of ", j.value("nested_blocksize", 256),
                "; bitsandbytes' 256 are read");
    q.nested_absmax = find(name + ".nested_absmax").to(at::kFloat).reshape(-1);
    q.nested_code = find(name + ".nested_quant_map").to(at::kFloat).reshape(-1);
    q.nested_offset = at::full({1}, j["nested_offset"].get<float>(), at::kFloat);
  } else {
    q.absmax = q.absmax.to(at::kFloat);
  }
  s.format = {q.type, nested};
  return s;
}

}  // namespace roundpipe::models::detail
