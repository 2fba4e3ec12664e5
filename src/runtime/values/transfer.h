// Values between the host and a device: flat tensor lists (undefined
// entries kept in place) and IValue trees. Each copy returns the event that
// completes when it has landed. Internal header.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <utility>
#include <vector>

#include "roundpipe/device.h"

namespace roundpipe::detail {

// Uploads the defined tensors of `tensors` on `queue` after `after`.
std::pair<std::vector<at::Tensor>, EventPtr> upload_flat(Device& device, Queue queue,
                                                         const std::vector<at::Tensor>& tensors,
                                                         const EventPtr& after);
// Downloads the defined tensors of `tensors` into memory from `allocate`.
std::pair<std::vector<at::Tensor>, EventPtr> download_flat(Device& device,
                                                           const std::vector<at::Tensor>& tensors,
                                                           const HostAllocator& allocate);
// The same for the tensors of a value (activations: the activation queue).
std::pair<c10::IValue, EventPtr> upload_value(Device& device, const c10::IValue& value,
                                              const EventPtr& after);
std::pair<c10::IValue, EventPtr> download_value(Device& device, const c10::IValue& value,
                                                const HostAllocator& allocate);

// The value with its tensors moved to `device` (tensors already there kept).
c10::IValue to_device(const c10::IValue& value, c10::Device device);

}  // namespace roundpipe::detail
