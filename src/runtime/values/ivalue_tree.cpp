#include "runtime/values/ivalue_tree.h"

#include <torch/csrc/autograd/autograd.h>

#include <c10/util/Exception.h>

namespace roundpipe {

const OpaqueValue* as_opaque(const c10::IValue& value) {
  if (!value.isCapsule()) return nullptr;
  return dynamic_cast<const OpaqueValue*>(value.toCapsule().get());
}

c10::IValue map_tensors(const c10::IValue& value,
                        const std::function<at::Tensor(const at::Tensor&)>& fn) {
  if (value.isTensor()) return fn(value.toTensor());
  if (value.isTuple()) {
    std::vector<c10::IValue> elements;
    for (const auto& e : value.toTupleRef().elements()) elements.push_back(map_tensors(e, fn));
    return c10::ivalue::Tuple::create(std::move(elements));
  }
  if (value.isList()) {
    auto list = value.toList();
    c10::impl::GenericList out(list.elementType());
    out.reserve(list.size());
    for (const auto& e : list) out.push_back(map_tensors(e, fn));
    return out;
  }
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& entry : dict) out.insert(entry.key(), map_tensors(entry.value(), fn));
    return out;
  }
  return value;
}

std::vector<at::Tensor> flatten_tensors(const c10::IValue& value) {
  std::vector<at::Tensor> tensors;
  map_tensors(value, [&](const at::Tensor& t) {
    tensors.push_back(t);
    return t;
  });
  return tensors;
}

c10::IValue replace_tensors(const c10::IValue& value, const std::vector<at::Tensor>& tensors) {
  size_t next = 0;
  auto out = map_tensors(value, [&](const at::Tensor&) {
    TORCH_CHECK(next < tensors.size(), "replace_tensors: too few tensors (", tensors.size(), ")");
    return tensors[next++];
  });
  TORCH_CHECK(next == tensors.size(), "replace_tensors: got ", tensors.size(),
              " tensors for a value holding ", next);
  return out;
}

void backward_through(const c10::IValue& output, const std::vector<at::Tensor>& grads) {
  const auto outs = flatten_tensors(output);
  TORCH_CHECK(outs.size() == grads.size(), "the output holds ", outs.size(), " tensors but ",
              grads.size(), " gradients arrived for it");
  std::vector<at::Tensor> roots, root_grads;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].defined() && outs[i].requires_grad() && grads[i].defined()) {
      roots.push_back(outs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
}

}  // namespace roundpipe
