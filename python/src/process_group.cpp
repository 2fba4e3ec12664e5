// See process_group.h.
#include "process_group.h"

#include <torch/csrc/jit/python/pybind_utils.h>

namespace roundpipe::python {

c10::intrusive_ptr<c10d::ProcessGroup> process_group_from(pybind11::handle boxed) {
  const auto type = c10::getCustomClassType<c10::intrusive_ptr<c10d::ProcessGroup>>();
  c10::IValue value;
  try {
    value = torch::jit::toIValue(boxed, type);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "expected a torch.distributed ProcessGroup's boxed() object: ", e.what());
  }
  auto group = value.toCustomClass<c10d::ProcessGroup>();
  TORCH_CHECK(group, "the process group is empty");
  return group;
}

}  // namespace roundpipe::python
