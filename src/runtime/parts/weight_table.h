// The model's unique parameters in host memory (tied weights once), where
// they live (arena placement, pinning), their optimizer masters and staging
// copies, and their versions: which optimizer update each home tensor
// holds, who still reads an older one, and publishing the next
// (Note [Weight versions]). Internal header.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "roundpipe/device.h"
#include "roundpipe/layer.h"
#include "roundpipe/options.h"
#include "runtime/memory/host_arena.h"

namespace roundpipe::detail {

// Note [Weight versions]
// Version v of the weights is what the home tensors hold after v optimizer
// updates. A call reads one version (fixed when it starts: the latest, or
// with async steps the one before). Dispatching a job counts a read of its
// parameters at that version; the read ends once its upload has copied
// them. Publishing v + 1 of a parameter (copying its master into the home,
// or swapping in the staging copy a fused async step wrote) waits until no
// read of an older version is left, so a job never uploads a half-written
// or too-new weight. A fused async step writes the next version into the
// staging copy while calls still read the home; once written
// (`staged_version`), calls that read that version upload it from there
// without waiting for the publish. Frozen parameters are never updated:
// every version is their home.
struct ParamEntry {
  at::Tensor home;    // CPU tensor, the model's own parameter (what uploads read)
  std::string name;   // "<layer>.<name in the layer>" of its first use
  at::Tensor master;  // optim_dtype copy the optimizer updates (trainable only)
  bool master_elsewhere =
      false;  // another process keeps its master (Note [Sharded optimizer state])
  int64_t published = 0;
  std::map<int64_t, int> reads;  // per version: jobs whose upload is still to read it
  at::Tensor staging;            // the next version, written by a fused async step
  bool staged = false;           // staging holds (or will hold) an update to publish
  int64_t staged_version = -1;   // the version staging holds once written (-1: none)
};

class WeightTable {
 public:
  // The unique parameters and the buffers of `layers` (all on the CPU),
  // placed per `pin` (`can_pin`: whether the devices can use pinned memory).
  WeightTable(const std::vector<LayerPtr>& layers, PinMode pin, bool can_pin,
              const std::string& name);
  ~WeightTable();
  WeightTable(const WeightTable&) = delete;
  WeightTable& operator=(const WeightTable&) = delete;

  int size() const { return static_cast<int>(params_.size()); }
  // Per layer: the unique id of each of its parameters, in its order.
  const std::vector<int>& layer_param_ids(int layer) const { return layer_param_ids_[layer]; }
  // Per layer: bytes of its parameters and buffers; of its trainable parameters.
  const std::vector<int64_t>& layer_bytes() const { return layer_bytes_; }
  const std::vector<int64_t>& layer_grad_bytes() const { return layer_grad_bytes_; }
  bool has_buffers() const { return has_buffers_; }
  bool trainable(int id) const { return params_[id].home.requires_grad(); }
  at::Tensor home(int id) const { return params_[id].home; }
  const std::string& name(int id) const { return params_[id].name; }
  std::vector<std::pair<std::string, at::Tensor>> named_homes() const;
  HostMemoryStats host_memory_stats() const { return {arena_->stats(), model_state_bytes_}; }
  // At each call's start: the arena's chunks idle through two calls go back
  // (Note [Idle arena chunks go back], host_arena.cpp).
  void release_idle_host_memory() { arena_->release_idle_chunks(2); }
  // Where downloads go: the arena with pin_model=alloc, else empty (the
  // backend's own memory).
  const HostAllocator& host_allocator() const { return host_allocator_; }
  // Whether uploads may read pageable homes (pin_model=off; register, where
  // pinning can fail): they then go through a staging ring.
  bool pageable_homes() const { return pageable_homes_; }

  // Versions (Note [Weight versions]).
  void add_reads(const std::vector<int>& ids, int64_t version);
  void release_reads(const std::vector<int>& ids, int64_t version);
  // Waits until `version` of every parameter of `ids` is available, or
  // cancelled() (checked whenever woken: wake()); false when cancelled.
  bool wait_available(const std::vector<int>& ids, int64_t version,
                      const std::function<bool()>& cancelled);
  // The host tensors that hold `version` of `ids` (home or staging copy).
  std::vector<at::Tensor> tensors_to_upload(const std::vector<int>& ids, int64_t version);
  // Makes `version` live: parameter by parameter in forward order, each
  // once no job still reads an older one.
  void publish(int64_t version);
  void publish_one(int id, int64_t version);
  // Sets the version alone (a sync fused step wrote the homes in place).
  void publish_version_only(int64_t version);
  // The staging copies of `ids` that a step wrote now hold `version`.
  void staged_written(const std::vector<int>& ids, int64_t version);
  // Wakes wait_available() to look at its cancellation again.
  void wake();

  // The optimizer's side: masters (optim_dtype copies of the trainable
  // homes, made once) and the staging copies of fused async steps.
  bool masters_missing() const;
  // Masters of the trainable parameters for which `keep(id)` holds (all
  // when none is given); the others' are kept by other processes.
  void make_masters(std::optional<c10::ScalarType> dtype,
                    const std::function<bool(int)>& keep = nullptr);
  std::vector<int> ids_with_master() const;
  std::vector<int> trainable_ids() const;
  std::vector<std::pair<std::string, at::Tensor>> named_masters() const;
  at::Tensor master(int id) const { return params_[id].master; }
  // The staging copy that receives the next version of `id` (made once).
  at::Tensor stage(int id);
  // A staged update was skipped: nothing new to publish for `id`.
  void unstage(int id);

 private:
  // Note [Freed heap memory goes back] (weight_table.cpp).
  static void return_freed_heap_memory();
  bool available(const ParamEntry& entry, int64_t version) const;
  void mark_published(ParamEntry& entry, int64_t version);  // (mu_ held)

  std::string name_;
  std::vector<ParamEntry> params_;
  std::vector<std::vector<int>> layer_param_ids_;
  std::vector<int64_t> layer_bytes_, layer_grad_bytes_;
  bool has_buffers_ = false;
  // pin_model=alloc: the homes, staging copies and downloads (pinned where
  // the devices support it).
  std::unique_ptr<HostArena> arena_;
  HostAllocator host_allocator_;
  std::vector<void*> registered_;  // host memory pinned in place (pin_model=register)
  bool pageable_homes_ = false;
  int64_t model_state_bytes_ = 0;
  // Guards every entry's versions, reads and staging state (and the swap
  // of a staging copy into its home).
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace roundpipe::detail
