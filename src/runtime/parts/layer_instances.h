// Layer instances (clones of a layer that bind to device tensors), kept per
// layer for reuse by the stage jobs. Internal header.
#pragma once

#include <memory>
#include <mutex>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/layer.h"

namespace roundpipe::detail {

class LayerInstances {
 public:
  explicit LayerInstances(const std::vector<LayerPtr>& layers);
  // A free instance of `layer`, or a new one made under `device`'s compute
  // lock (Note [Instances and the CPU generator]).
  std::unique_ptr<LayerInstance> acquire(int layer, Device& device);
  // Unbinds `instance` and keeps it for the next job.
  void release(int layer, std::unique_ptr<LayerInstance> instance);

 private:
  const std::vector<LayerPtr>& layers_;
  std::mutex mu_;
  std::vector<std::vector<std::unique_ptr<LayerInstance>>> free_;
};

}  // namespace roundpipe::detail
