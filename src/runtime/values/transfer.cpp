// Host-device copies of tensor lists and values: see transfer.h.
#include "runtime/values/transfer.h"

#include "runtime/values/ivalue_tree.h"

namespace roundpipe::detail {

namespace {

// The defined tensors of `tensors` (downloads detach them: a copy back to
// the host never joins a graph).
std::vector<at::Tensor> defined_only(const std::vector<at::Tensor>& tensors, bool detach) {
  std::vector<at::Tensor> defined;
  for (const auto& t : tensors) {
    if (t.defined()) defined.push_back(detach ? t.detach() : t);
  }
  return defined;
}

// `copies` (of the defined tensors) back in the places of `tensors`.
std::vector<at::Tensor> in_place_of(const std::vector<at::Tensor>& tensors,
                                    const std::vector<at::Tensor>& copies) {
  std::vector<at::Tensor> out;
  size_t next = 0;
  for (const auto& t : tensors) out.push_back(t.defined() ? copies[next++] : at::Tensor());
  return out;
}

}  // namespace

std::pair<std::vector<at::Tensor>, EventPtr> upload_flat(Device& device, Queue queue,
                                                         const std::vector<at::Tensor>& tensors,
                                                         const EventPtr& after) {
  auto [copies, event] = device.upload(queue, defined_only(tensors, false), after);
  return {in_place_of(tensors, copies), event};
}

std::pair<std::vector<at::Tensor>, EventPtr> download_flat(Device& device,
                                                           const std::vector<at::Tensor>& tensors,
                                                           const HostAllocator& allocate) {
  auto [copies, event] = device.download(defined_only(tensors, true), allocate);
  return {in_place_of(tensors, copies), event};
}

std::pair<c10::IValue, EventPtr> upload_value(Device& device, const c10::IValue& value,
                                              const EventPtr& after) {
  auto [tensors, event] = upload_flat(device, Queue::kActUpload, flatten_tensors(value), after);
  return {replace_tensors(value, tensors), event};
}

std::pair<c10::IValue, EventPtr> download_value(Device& device, const c10::IValue& value,
                                                const HostAllocator& allocate) {
  auto [tensors, event] = download_flat(device, flatten_tensors(value), allocate);
  return {replace_tensors(value, tensors), event};
}

c10::IValue to_device(const c10::IValue& value, c10::Device device) {
  return map_tensors(value, [&](const at::Tensor& t) {
    return t.defined() && t.device() != device ? t.to(device) : t;
  });
}

}  // namespace roundpipe::detail
