// The pool of layer instances: see layer_instances.h.
#include "runtime/parts/layer_instances.h"

#include <ATen/CPUGeneratorImpl.h>

#include "runtime/values/rng.h"

namespace roundpipe::detail {

LayerInstances::LayerInstances(const std::vector<LayerPtr>& layers)
    : layers_(layers), free_(layers.size()) {}

std::unique_ptr<LayerInstance> LayerInstances::acquire(int layer, Device& device) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& pool = free_[layer];
    if (!pool.empty()) {
      auto instance = std::move(pool.back());
      pool.pop_back();
      return instance;
    }
  }
  // Note [Instances and the CPU generator]
  // Cloning a module re-runs its initialisation, which draws from the CPU
  // generator: keep that off every random stream (sim compute shares it)
  // and off a new call's seed draw (calls overlap with these workers), and
  // leave the generator as it was.
  auto lock = device.compute_lock();
  std::lock_guard<std::mutex> borrow(cpu_generator_borrow_mutex());
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor saved;
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    saved = gen.get_state();
  }
  // The clone's own tensors are host memory, whichever thread makes it
  // (Note [Simulated device memory]).
  HostAllocationScope host;
  auto instance = layers_[layer]->make_instance();
  {
    std::lock_guard<std::mutex> g(gen.mutex());
    gen.set_state(saved);
  }
  return instance;
}

void LayerInstances::release(int layer, std::unique_ptr<LayerInstance> instance) {
  instance->unbind();
  std::lock_guard<std::mutex> lock(mu_);
  free_[layer].push_back(std::move(instance));
}

}  // namespace roundpipe::detail
