// roundpipe._C's 4- and 8-bit formats (include/roundpipe/models/quantized.h):
// a quantized weight crosses as a dict of its tensors and fields (4 bits:
// the names bitsandbytes' QuantState uses).
#include "quantized.h"

#include <ATen/ops/full.h>

#include "roundpipe/models/quantized.h"
#include "roundpipe/options.h"

namespace roundpipe::python {
namespace {

using models::Quantized4Bit;

// What dequantization gives, as the dicts name it (dtype_from_string reads it).
const char* dtype_name(at::ScalarType dtype) {
  return dtype == at::kFloat ? "float32" : dtype == at::kHalf ? "float16" : "bfloat16";
}

py::dict to_dict(const Quantized4Bit& q) {
  py::dict d;
  d["quant_type"] = models::to_string(q.type);
  d["blocksize"] = q.blocksize;
  d["shape"] = q.shape;
  d["dtype"] = dtype_name(q.dtype);
  d["packed"] = q.packed;
  d["absmax"] = q.absmax;
  if (q.double_quantized()) {
    d["nested_absmax"] = q.nested_absmax;
    d["nested_code"] = q.nested_code;
    d["nested_offset"] = q.nested_offset.item<float>();
  }
  return d;
}

Quantized4Bit from_dict(const py::dict& d) {
  Quantized4Bit q;
  q.type = models::quant_type_from_string(d["quant_type"].cast<std::string>());
  q.blocksize = d["blocksize"].cast<int64_t>();
  q.shape = d["shape"].cast<std::vector<int64_t>>();
  q.dtype = dtype_from_string(d["dtype"].cast<std::string>());
  q.packed = d["packed"].cast<at::Tensor>().reshape({-1});
  q.absmax = d["absmax"].cast<at::Tensor>().reshape({-1});
  if (d.contains("nested_absmax") && !d["nested_absmax"].is_none()) {
    q.nested_absmax = d["nested_absmax"].cast<at::Tensor>().reshape({-1});
    q.nested_code = d["nested_code"].cast<at::Tensor>().reshape({-1});
    q.nested_offset = at::full({1}, d["nested_offset"].cast<float>(), at::kFloat);
  }
  return q;
}

}  // namespace

void bind_quantized(py::module_& m) {
  m.def(
      "quantize_4bit",
      [](const at::Tensor& weight, const std::string& quant_type, int64_t blocksize,
         bool double_quant) {
        return to_dict(models::quantize_4bit(weight, models::quant_type_from_string(quant_type),
                                             blocksize, double_quant));
      },
      py::arg("weight"), py::arg("quant_type") = "nf4", py::arg("blocksize") = 64,
      py::arg("double_quant") = true,
      "a CPU float tensor in bitsandbytes' 4-bit layout: a dict of packed, absmax (and "
      "nested_absmax, nested_code, nested_offset), quant_type, blocksize, shape, dtype "
      "(float32, float16 or bfloat16)");
  m.def(
      "dequantize_4bit", [](const py::dict& q) { return models::dequantize_4bit(from_dict(q)); },
      py::arg("quantized"), "the weight back (on the quantized tensors' device)");
  m.def(
      "quantize_8bit",
      [](const at::Tensor& weight, const std::string& quant_type) {
        const auto q = models::quantize_8bit(weight, models::quant_type_from_string(quant_type));
        py::dict d;
        d["quant_type"] = models::to_string(q.type);
        d["dtype"] = dtype_name(q.dtype);
        d["values"] = q.values;
        d["scale"] = q.scale;
        return d;
      },
      py::arg("weight"), py::arg("quant_type") = "int8",
      "a 2-D CPU float tensor in 8 bits, a scale a row (Note [8-bit base weights]): a dict of "
      "values (int8: bitsandbytes' CB; fp8: e4m3 bytes as uint8), scale (float32: int8, the row "
      "absmax, bitsandbytes' SCB; fp8, absmax / 448), quant_type (int8 or fp8), dtype");
  m.def(
      "dequantize_8bit",
      [](const py::dict& d) {
        return models::dequantize_8bit(
            {models::quant_type_from_string(d["quant_type"].cast<std::string>()),
             dtype_from_string(d["dtype"].cast<std::string>()), d["values"].cast<at::Tensor>(),
             d["scale"].cast<at::Tensor>()});
      },
      py::arg("quantized"), "the weight back (on the quantized tensors' device)");
  m.def("code_table",
        [](const std::string& t) { return models::code_table(models::quant_type_from_string(t)); });
  m.def("dynamic_map_signed", &models::dynamic_map_signed);
}

}  // namespace roundpipe::python
