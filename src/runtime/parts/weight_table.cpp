// The parameter table and its versions: see weight_table.h.
#include "runtime/parts/weight_table.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <unistd.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include "support/host_cast.h"
#include "support/parallel.h"

namespace roundpipe::detail {

namespace {

// Parameters whose homes share one storage (by data pointer, as register
// mode pins them), with the byte range of the storage their views cover.
struct HomeGroup {
  const char* base = nullptr;  // the storage's data
  int64_t begin = 0, end = 0;  // bytes from base; begin a multiple of `align`
  int64_t align = 1;           // the largest element size among the views
  std::vector<int> entries;
};

std::vector<HomeGroup> home_groups(const std::vector<ParamEntry>& params) {
  std::vector<HomeGroup> groups;
  std::unordered_map<const char*, size_t> by_base;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& home = params[i].home;
    if (home.numel() == 0) continue;
    const int64_t item = static_cast<int64_t>(home.element_size());
    const int64_t begin = home.storage_offset() * item;
    const int64_t end = static_cast<int64_t>(at::detail::computeStorageNbytes(
        home.sizes(), home.strides(), item, home.storage_offset()));
    const auto* base = static_cast<const char*>(home.storage().data());
    auto [it, inserted] = by_base.emplace(base, groups.size());
    if (inserted) groups.push_back({base, begin, end, item, {}});
    auto& group = groups[it->second];
    group.begin = std::min(group.begin, begin);
    group.end = std::max(group.end, end);
    group.align = std::max(group.align, item);
    group.entries.push_back(static_cast<int>(i));
  }
  // Element sizes are powers of two: every view's offset from an aligned
  // begin is a whole number of its elements.
  for (auto& group : groups) group.begin -= group.begin % group.align;
  return groups;
}

// Copies each group's range into one block of a chunk reserved for all of
// them and rebinds the parameters to it (views of one storage stay views of
// one block; the model's parameter tensors keep their identity).
void move_homes_into(HostArena& arena, std::vector<ParamEntry>& params,
                     const std::vector<HomeGroup>& groups) {
  int64_t total = 0;
  for (const auto& group : groups) total += arena.block_bytes(group.end - group.begin);
  arena.reserve(total);
  MemcpyPieces pieces(int64_t{64} << 20);
  std::vector<c10::Storage> storages;
  for (const auto& group : groups) {
    const int64_t bytes = group.end - group.begin;
    auto block = arena.allocate(bytes);
    pieces.add(block.get(), group.base + group.begin, bytes);
    storages.emplace_back(c10::Storage::use_byte_size_t(), bytes, std::move(block),
                          /*allocator=*/nullptr, /*resizable=*/false);
  }
  pieces.run();
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int i : groups[g].entries) {
      auto& home = params[i].home;
      const int64_t item = static_cast<int64_t>(home.element_size());
      auto moved = at::empty({0}, at::TensorOptions().dtype(home.scalar_type()));
      moved.set_(storages[g], (home.storage_offset() * item - groups[g].begin) / item, home.sizes(),
                 home.strides());
      home.set_data(moved);
    }
  }
}

// The address ranges of this process's file mappings (/proc/self/maps
// lines with an inode), sorted.
std::vector<std::pair<uintptr_t, uintptr_t>> file_mappings() {
  std::vector<std::pair<uintptr_t, uintptr_t>> out;
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    std::istringstream fields(line);
    std::string range, perms, offset, dev;
    uint64_t inode = 0;
    fields >> range >> perms >> offset >> dev >> inode;
    const auto dash = range.find('-');
    if (inode == 0 || dash == std::string::npos) continue;
    out.emplace_back(std::stoull(range.substr(0, dash), nullptr, 16),
                     std::stoull(range.substr(dash + 1), nullptr, 16));
  }
  return out;
}

// pin_model=register: pins the pages the homes occupy, in place. Ranges
// are whole pages, and overlapping ones (small allocations sharing a page)
// are merged into one registration: pinning overlapping ranges fails.
// Homes in a file mapping (a memory-mapped checkpoint) are left pageable
// and go through the staging ring: pinning a private file mapping would
// copy each page into anonymous memory (pinning it read-only keeps the
// file's page, which a later write would silently stop being).
void register_in_place(const std::vector<ParamEntry>& params, std::vector<void*>& registered) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto files = file_mappings();
  auto in_file = [&](uintptr_t begin, uintptr_t end) {
    return std::any_of(files.begin(), files.end(),
                       [&](const auto& f) { return begin < f.second && f.first < end; });
  };
  std::vector<std::pair<uintptr_t, uintptr_t>> ranges;
  for (const auto& entry : params) {
    const auto& home = entry.home;
    if (home.numel() == 0 || home.is_pinned()) continue;
    const auto begin = reinterpret_cast<uintptr_t>(home.storage().data());
    const uintptr_t end = begin + home.storage().nbytes();
    if (in_file(begin, end)) continue;
    ranges.emplace_back(begin / page * page, (end + page - 1) / page * page);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && r.first < merged.back().second) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  for (const auto& [begin, end] : merged) {
    void* data = reinterpret_cast<void*>(begin);
    if (register_host_memory(data, end - begin)) registered.push_back(data);
  }
}

}  // namespace

WeightTable::WeightTable(const std::vector<LayerPtr>& layers, PinMode pin, bool can_pin,
                         const std::string& name)
    : name_(name) {
  TORCH_CHECK(!layers.empty(), name_, ": the model has no layers; wrap a non-empty Sequential");
  // The unique parameters: tied weights are one entry shared by several layers.
  std::unordered_map<const c10::TensorImpl*, int> ids;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& layer = layers[l];
    std::vector<int> layer_ids;
    int64_t bytes = 0, grad_bytes = 0;
    const auto names = layer->parameter_names();
    const auto layer_params = layer->parameters();
    for (size_t i = 0; i < layer_params.size(); ++i) {
      const auto& p = layer_params[i];
      TORCH_CHECK(p.device().is_cpu(), name_,
                  ": parameters must be on the CPU (the model's home); ", "found one on ",
                  p.device(), " in ", layer->type_name(), ". Call .to(torch::kCPU) first.");
      auto [it, inserted] = ids.emplace(p.unsafeGetTensorImpl(), static_cast<int>(params_.size()));
      if (inserted) {
        ParamEntry entry;
        entry.home = p;
        entry.name = std::to_string(l) + "." + (i < names.size() ? names[i] : std::to_string(i));
        params_.push_back(std::move(entry));
      }
      layer_ids.push_back(it->second);
      bytes += p.nbytes();
      if (p.requires_grad()) grad_bytes += p.nbytes();
    }
    for (const auto& b : layer->buffers()) {
      TORCH_CHECK(b.device().is_cpu(), name_, ": buffers must be on the CPU; found one on ",
                  b.device(), " in ", layer->type_name());
      TORCH_CHECK(!b.requires_grad(), name_, ": a buffer of ", layer->type_name(),
                  " requires grad; buffers must not require grad (make it a parameter)");
      bytes += b.nbytes();
      has_buffers_ = true;
    }
    layer_param_ids_.push_back(std::move(layer_ids));
    layer_bytes_.push_back(bytes);
    layer_grad_bytes_.push_back(grad_bytes);
  }
  // Pinned home memory makes uploads fast and truly asynchronous. alloc: the
  // homes move into the arena's first chunk, reserved at their exact size,
  // and the fused optimizer's staging copies and all downloads come from the
  // arena too (pinned where the devices support it; on simulated devices the
  // arena runs unpinned, so CI exercises the same code). register: pin the
  // existing storage in place. off: nothing is pinned.
  auto homes = home_groups(params_);
  for (const auto& group : homes) model_state_bytes_ += group.end - group.begin;
  // Chunks for downloads and staging copies: 1/64 of the weights, within
  // [2 MiB, 256 MiB], keeps the arena's waste (about one chunk) near 2% of
  // the weights (docs/architecture.md, where the code stands). A larger request gets
  // a chunk of its own size.
  arena_ = std::make_unique<HostArena>(
      HostArenaOptions()
          .set_chunk_bytes(
              std::clamp(model_state_bytes_ / 64, int64_t{2} << 20, int64_t{256} << 20))
          .set_pin(pin == PinMode::kAlloc && can_pin));
  if (pin == PinMode::kAlloc) {
    if (can_pin) {
      std::erase_if(homes, [&](const HomeGroup& group) {
        return params_[group.entries.front()].home.is_pinned();  // pinned already
      });
    }
    move_homes_into(*arena_, params_, homes);
    host_allocator_ = [arena = arena_.get()](at::IntArrayRef sizes, at::ScalarType dtype) {
      return arena->empty(sizes, dtype);
    };
  } else if (pin == PinMode::kRegister && can_pin) {
    register_in_place(params_, registered_);
  }
  // Homes that may be pageable go through a staging ring (Note [Staging
  // ring]): all of them with off; with register, those that could not be
  // pinned and the unpinned staging copies an async step swaps in.
  pageable_homes_ = pin == PinMode::kOff || (pin == PinMode::kRegister && can_pin);
  return_freed_heap_memory();
}

// Note [Large blocks are mapped, not heaped]
// glibc serves a block above its mmap threshold with a mapping of its own,
// returned to the system when freed; below it, from a heap, which keeps
// freed memory resident for reuse. The threshold starts at 128 KiB and
// rises to the size of every mapped block freed, up to 32 MiB, so after the
// first large free every tensor of a layer's size (a 2048 x 6144 float32
// master is 48 MiB, a bfloat16 weight 24; smaller models' fit under 32)
// comes from a heap, and what a step or a model's making frees stays there:
// 4.8 bytes a parameter of a 229 M-parameter full fine-tune after three
// steps (bench/host_memory_breakdown.py), a third of its model state. A
// threshold that is set stays where it is set (glibc's own rule), so the
// library fixes it at 1 MiB once, when loaded: blocks a layer's size are
// mapped and go back when freed. The engine's recurring buffers (arena
// chunks, kept gradient memory) are made once, so the page faults of fresh
// mappings are paid once too. A process that configured glibc's malloc
// itself (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) is
// left as it is.
namespace {
bool map_large_blocks() {
#ifdef __GLIBC__
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                           "MALLOC_MMAP_MAX_"}) {
    if (std::getenv(name) != nullptr) return false;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables != nullptr && std::strstr(tunables, "glibc.malloc.") != nullptr) return false;
  return mallopt(M_MMAP_THRESHOLD, 1 << 20) == 1;
#else
  return false;
#endif
}
[[maybe_unused]] const bool large_blocks_mapped = map_large_blocks();
}  // namespace

// Note [Freed heap memory goes back]
// Making or loading a model leaves glibc's heaps holding what it freed: the
// temporaries of reading, casting and quantizing a checkpoint (pieces under
// glibc's mmap threshold, which rises to 32 MiB once a large block is
// freed, on the heaps of the threads that made them) and, in alloc mode,
// homes just copied into the arena. glibc keeps such memory resident for
// reuse, and the process's resident memory counts it: 4.35 GiB of it after
// wrapping a Qwen3-32B shape on an NF4 base (roundpipe-bench, which reports
// glibc's free-held bytes), a fifth of that model's 19.9 GiB of state.
// RoundPipe holds its model in the arena from here on, so the heaps'
// free pages go back to the system once, when the table is made
// (malloc_trim). Elsewhere than glibc, nothing is done.
void WeightTable::return_freed_heap_memory() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

WeightTable::~WeightTable() {
  for (void* data : registered_) unregister_host_memory(data);
}

std::vector<std::pair<std::string, at::Tensor>> WeightTable::named_homes() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : params_) out.emplace_back(p.name, p.home);
  return out;
}

// ---------------------------------------------------------------- versions

void WeightTable::add_reads(const std::vector<int>& ids, int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int id : ids) ++params_[id].reads[version];
}

void WeightTable::release_reads(const std::vector<int>& ids, int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int id : ids) --params_[id].reads[version];
  cv_.notify_all();
}

bool WeightTable::available(const ParamEntry& entry, int64_t version) const {
  return entry.published >= version || entry.staged_version == version ||
         !entry.home.requires_grad();
}

bool WeightTable::wait_available(const std::vector<int>& ids, int64_t version,
                                 const std::function<bool()>& cancelled) {
  bool all = false;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    all = std::all_of(ids.begin(), ids.end(),
                      [&](int id) { return available(params_[id], version); });
    return all || cancelled();
  });
  return all;
}

std::vector<at::Tensor> WeightTable::tensors_to_upload(const std::vector<int>& ids,
                                                       int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Tensor> host;
  for (int id : ids) {
    const auto& entry = params_[id];
    const bool staged = entry.published < version && entry.staged_version == version;
    host.push_back(staged ? entry.staging : entry.home);
  }
  return host;
}

void WeightTable::publish(int64_t version) {
  for (int id = 0; id < size(); ++id) publish_one(id, version);
}

void WeightTable::publish_one(int id, int64_t version) {
  auto& entry = params_[id];
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (entry.published >= version) return;  // published already
    cv_.wait(lock, [&] {
      for (const auto& [v, n] : entry.reads) {
        if (v < version && n > 0) return false;
      }
      return true;
    });
    if (entry.staged) {
      // The swap and the new version number in one step under the lock: a
      // worker picking the tensor to upload (tensors_to_upload) sees either
      // the staging copy of this version or the home that now holds it,
      // never the old home in between. Its handle keeps pointing at the data.
      auto previous = entry.home.detach();
      entry.home.set_data(entry.staging);
      entry.staging = previous;  // reused by the next fused async step
      entry.staged = false;
      entry.staged_version = -1;
      mark_published(entry, version);
      return;
    }
  }
  if (entry.master.defined()) cast_copy(entry.home, entry.master);  // (host_cast.h)
  std::lock_guard<std::mutex> lock(mu_);
  mark_published(entry, version);
}

void WeightTable::mark_published(ParamEntry& entry, int64_t version) {
  entry.published = version;
  std::erase_if(entry.reads, [&](const auto& r) { return r.first < version && r.second == 0; });
  cv_.notify_all();
}

void WeightTable::publish_version_only(int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& entry : params_) entry.published = version;
  cv_.notify_all();
}

void WeightTable::staged_written(const std::vector<int>& ids, int64_t version) {
  std::lock_guard<std::mutex> lock(mu_);
  for (int id : ids) {
    if (params_[id].staged) params_[id].staged_version = version;
  }
  cv_.notify_all();
}

void WeightTable::wake() {
  { std::lock_guard<std::mutex> lock(mu_); }
  cv_.notify_all();
}

// ---------------------------------------------------------------- masters

bool WeightTable::masters_missing() const {
  return std::any_of(params_.begin(), params_.end(), [](const ParamEntry& e) {
    return e.home.requires_grad() && !e.master.defined() && !e.master_elsewhere;
  });
}

void WeightTable::make_masters(std::optional<c10::ScalarType> dtype,
                               const std::function<bool(int)>& keep) {
  for (int id = 0; id < size(); ++id) {
    auto& entry = params_[id];
    if (!entry.home.requires_grad() || entry.master.defined()) continue;
    if (keep && !keep(id)) {
      entry.master_elsewhere = true;
      continue;
    }
    entry.master = entry.home.detach().to(dtype.value_or(entry.home.scalar_type()),
                                          /*non_blocking=*/false, /*copy=*/true);
    entry.master.requires_grad_(true);
  }
}

std::vector<int> WeightTable::ids_with_master() const {
  std::vector<int> ids;
  for (int id = 0; id < size(); ++id) {
    if (params_[id].master.defined()) ids.push_back(id);
  }
  return ids;
}

std::vector<int> WeightTable::trainable_ids() const {
  std::vector<int> ids;
  for (int id = 0; id < size(); ++id) {
    if (trainable(id)) ids.push_back(id);
  }
  return ids;
}

std::vector<std::pair<std::string, at::Tensor>> WeightTable::named_masters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& entry : params_) {
    if (entry.master.defined()) out.emplace_back(entry.name, entry.master);
  }
  return out;
}

at::Tensor WeightTable::stage(int id) {
  auto& entry = params_[id];
  // Only the optimizer thread makes, swaps and writes staging copies: this
  // one is made outside the lock (pinning may take a while), then set under it.
  if (!entry.staging.defined()) {
    at::Tensor staging;
    if (host_allocator_) {  // alloc mode: from the arena
      staging = host_allocator_(entry.home.sizes(), entry.home.scalar_type());
    } else {
      staging = at::empty_like(entry.home, at::MemoryFormat::Contiguous);
      if (entry.home.is_pinned()) staging = staging.pin_memory();
    }
    std::lock_guard<std::mutex> lock(mu_);
    entry.staging = staging;
  }
  std::lock_guard<std::mutex> lock(mu_);
  entry.staged = true;
  return entry.staging;
}

void WeightTable::unstage(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  params_[id].staged = false;
}

}  // namespace roundpipe::detail
