// Pageable uploads through pinned slots: see staging_ring.h.
#include "device/staging_ring.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cstring>

namespace roundpipe {

namespace {

// A slot holds a chunk of at most slot_bytes of sources, each placed at a
// multiple of its element size (views need that), so it has room for the
// padding between them too; a source that still does not fit is copied
// from where it is.
constexpr int64_t kPaddingRoom = int64_t{64} << 10;

}  // namespace

StagingRing::StagingRing(int slots, int64_t slot_bytes, bool pin, int copy_threads)
    : slot_bytes_(slot_bytes), copiers_(copy_threads, /*low_priority=*/false) {
  TORCH_CHECK(slots >= 2 && slot_bytes > 0, "a staging ring needs two or more slots of > 0 bytes");
  for (int i = 0; i < slots; ++i) {
    slots_.push_back({at::empty({slot_bytes + kPaddingRoom},
                                at::TensorOptions().dtype(at::kByte).pinned_memory(pin)),
                      nullptr});
  }
}

StagingRing::~StagingRing() {
  // The slots' memory must outlive the copies reading it.
  for (auto& slot : slots_) {
    if (!slot.copied) continue;
    try {
      slot.copied->synchronize();
    } catch (...) {
      // A failed copy: nothing reads the slot any more.
    }
  }
}

StagingRing::Staged StagingRing::stage(const CopyChunk& chunk) {
  Staged staged;
  EventPtr previous;
  {
    std::lock_guard<std::mutex> lock(mu_);
    staged.slot = next_;
    next_ = (next_ + 1) % slots();
    previous = std::move(slots_[staged.slot].copied);
  }
  if (previous) previous->synchronize();
  auto& memory = slots_[staged.slot].memory;
  auto* base = static_cast<char*>(memory.data_ptr());
  // Contiguous sources are copied in pieces of up to 4 MiB on the copy
  // threads; others (rare for parameters) with copy_ into a contiguous view.
  MemcpyPieces pieces(int64_t{4} << 20);
  std::vector<std::pair<at::Tensor, at::Tensor>> strided;
  int64_t offset = 0;
  for (const auto& [dst, src] : chunk) {
    const int64_t bytes = static_cast<int64_t>(src.nbytes());
    const auto item = static_cast<int64_t>(src.element_size());
    offset = (offset + item - 1) / item * item;
    if (offset + bytes > memory.numel()) {
      staged.chunk.emplace_back(dst, src);  // does not fit: copied from where it is
      continue;
    }
    auto view = memory.narrow(0, offset, bytes).view(src.scalar_type()).view(src.sizes());
    if (src.is_contiguous()) {
      pieces.add(base + offset, src.data_ptr(), bytes);
    } else {
      strided.emplace_back(view, src);
    }
    staged.chunk.emplace_back(dst, view);
    offset += bytes;
    staged_bytes_ += bytes;
  }
  pieces.run(&copiers_);
  for (auto& [view, src] : strided) view.copy_(src);
  return staged;
}

void StagingRing::release(int slot, EventPtr copied) {
  std::lock_guard<std::mutex> lock(mu_);
  slots_[slot].copied = std::move(copied);
}

}  // namespace roundpipe
