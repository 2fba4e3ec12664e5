// The weight table (runtime/weight_table.h): tied weights once; placement
// keeps the model's tensors and values; versions (Note [Weight versions]):
// publishing waits for every read of an older version, copies the masters
// in, or swaps in a staging copy that calls of that version may already
// upload; waits end when cancelled.
#include "runtime/parts/weight_table.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <malloc.h>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using namespace std::chrono_literals;
using detail::WeightTable;

// Linear(6, 8), Linear(8, 8) = a, Tanh, TiedLinear(a's weight), Tanh, Linear(8, 4).
std::vector<LayerPtr> tied_model() {
  return layers_of(make_model(ModelKind::kTied));
}
constexpr int kLast = 5;  // the last Linear

TEST(WeightTable, TiedWeightsAreOneEntryAndBytesCountPerLayer) {
  auto layers = tied_model();
  WeightTable table(layers, PinMode::kOff, false, "test");
  EXPECT_EQ(table.size(), 7);  // 4 Linear weights and biases, the tied layer's bias
  EXPECT_EQ(table.layer_param_ids(1).at(0), table.layer_param_ids(3).at(0));
  EXPECT_EQ(table.layer_bytes().at(0), (6 * 8 + 8) * 4);
  EXPECT_EQ(table.layer_bytes().at(2), 0);
  EXPECT_EQ(table.layer_bytes().at(3), (8 * 8 + 8) * 4);  // each use counts its uploads
  EXPECT_EQ(table.layer_bytes().at(kLast), (8 * 4 + 4) * 4);
  EXPECT_EQ(table.layer_grad_bytes(), table.layer_bytes());
  EXPECT_FALSE(table.has_buffers());
  EXPECT_EQ(table.named_homes().at(0).first, "0.weight");
}

TEST(WeightTable, AllocPlacementKeepsTheModelsTensorsAndValues) {
  auto layers = tied_model();
  const auto before = layers[1]->parameters()[0].clone();
  const auto* impl = layers[1]->parameters()[0].unsafeGetTensorImpl();
  const auto* old_data = layers[1]->parameters()[0].data_ptr();
  WeightTable table(layers, PinMode::kAlloc, /*can_pin=*/false, "test");
  const auto after = layers[1]->parameters()[0];
  EXPECT_EQ(after.unsafeGetTensorImpl(), impl);  // the model's parameter, moved in place
  EXPECT_NE(after.data_ptr(), old_data);
  EXPECT_TRUE(after.equal(before));
  EXPECT_EQ(layers[3]->parameters()[0].data_ptr(), after.data_ptr());  // still tied
  int64_t bytes = 0;
  for (const auto& [name, home] : table.named_homes()) bytes += home.nbytes();
  EXPECT_EQ(table.host_memory_stats().model_state_bytes, bytes);
  EXPECT_TRUE(static_cast<bool>(table.host_allocator()));
}

#ifdef __GLIBC__
// This process's anonymous resident memory (/proc/self/status), in bytes.
int64_t anonymous_resident_bytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("RssAnon:", 0) == 0) return std::stoll(line.substr(8)) * 1024;
  return -1;
}

// Note [Freed heap memory goes back]: 128 MiB freed in pieces under glibc's
// mmap threshold stay resident, glibc keeping them for reuse, until the
// table is made, and are gone after: the resident set falls by at least
// three quarters of what glibc held free (the rest of the process may move a
// few MiB). A first
// table, made before, takes the one-time initialisations out of the
// measurement.
TEST(WeightTable, MakingItReturnsTheHeapsFreedMemory) {
  constexpr int kPieces = 2048;
  constexpr size_t kPiece = 64 << 10;  // 128 MiB in all
  auto layers = tied_model();
  { WeightTable first(tied_model(), PinMode::kAlloc, /*can_pin=*/false, "first"); }
  std::vector<char*> pieces;
  for (int i = 0; i < kPieces; ++i) {
    pieces.push_back(static_cast<char*>(std::malloc(kPiece)));
    std::memset(pieces.back(), 1, kPiece);  // resident
  }
  // The last piece stays: taken from the heap's top once earlier holes are
  // used up, it keeps glibc from returning the others itself.
  for (int i = 0; i + 1 < kPieces; ++i) std::free(pieces[i]);
  const auto free_held = static_cast<int64_t>(mallinfo2().fordblks);
  ASSERT_GE(free_held, int64_t{32} << 20) << "glibc returned the pieces itself";
  const int64_t before = anonymous_resident_bytes();
  WeightTable table(layers, PinMode::kAlloc, /*can_pin=*/false, "test");
  const int64_t after = anonymous_resident_bytes();
  std::free(pieces.back());
  EXPECT_LT(after, before - free_held / 4 * 3)
      << before << " -> " << after << " with " << free_held << " bytes free";
}
#endif

TEST(WeightTable, PublishingWaitsForReadsOfOlderVersionsThenCopiesTheMaster) {
  auto layers = tied_model();
  WeightTable table(layers, PinMode::kOff, false, "test");
  table.make_masters(at::kDouble);
  const int id = table.layer_param_ids(kLast).at(0);
  auto master = table.master(id);
  ASSERT_EQ(master.scalar_type(), at::kDouble);
  {
    at::NoGradGuard no_grad;
    master.fill_(0.5);
  }
  table.add_reads({id}, /*version=*/0);  // a dispatched job will upload version 0
  std::atomic<bool> published{false};
  std::thread publisher([&] {
    table.publish_one(id, 1);
    published = true;
  });
  // However long we wait, version 1 may not replace what a reader of
  // version 0 has yet to copy.
  std::this_thread::sleep_for(50ms);
  EXPECT_FALSE(published);
  EXPECT_FALSE(table.home(id).eq(0.5).all().item<bool>());
  table.release_reads({id}, 0);
  publisher.join();
  EXPECT_TRUE(table.home(id).eq(0.5).all().item<bool>());
  // Publishing an older or the same version again changes nothing.
  table.publish_one(id, 1);
  EXPECT_TRUE(table.wait_available({id}, 1, [] { return false; }));
}

TEST(WeightTable, StagedWeightsAreUploadedBeforePublishAndSwappedInByIt) {
  auto layers = tied_model();
  WeightTable table(layers, PinMode::kOff, false, "test");
  table.make_masters(std::nullopt);
  const int id = table.layer_param_ids(kLast).at(0);
  const auto home = table.home(id);
  const auto old_values = home.clone();
  auto staging = table.stage(id);
  staging.fill_(7.0);
  // Not written yet: a call of version 1 must wait.
  std::atomic<bool> cancel{false};
  std::atomic<bool> available{true};
  std::thread waiter(
      [&] { available = table.wait_available({id}, 1, [&] { return cancel.load(); }); });
  std::this_thread::sleep_for(20ms);
  cancel = true;
  table.wake();
  waiter.join();
  EXPECT_FALSE(available);  // cancelled, not available
  table.staged_written({id}, 1);
  EXPECT_TRUE(table.wait_available({id}, 1, [] { return false; }));
  // Version 1 comes from the staging copy, version 0 from the home.
  EXPECT_EQ(table.tensors_to_upload({id}, 1).at(0).data_ptr(), staging.data_ptr());
  EXPECT_EQ(table.tensors_to_upload({id}, 0).at(0).data_ptr(), home.data_ptr());
  table.publish(1);
  // The model's tensor now holds version 1, in the storage the staging
  // copy had; the old storage becomes the next staging copy.
  EXPECT_EQ(home.unsafeGetTensorImpl(), layers[kLast]->parameters()[0].unsafeGetTensorImpl());
  EXPECT_TRUE(layers[kLast]->parameters()[0].eq(7.0).all().item<bool>());
  EXPECT_EQ(layers[kLast]->parameters()[0].data_ptr(), staging.data_ptr());
  EXPECT_TRUE(table.stage(id).equal(old_values));
}

TEST(WeightTable, FrozenParametersAreAvailableAtEveryVersion) {
  auto layers = tied_model();
  for (auto& p : layers[kLast]->parameters()) p.requires_grad_(false);
  WeightTable table(layers, PinMode::kOff, false, "test");
  const int id = table.layer_param_ids(kLast).at(0);
  EXPECT_FALSE(table.trainable(id));
  EXPECT_TRUE(table.wait_available({id}, 5, [] { return false; }));
  table.make_masters(std::nullopt);
  EXPECT_FALSE(table.master(id).defined());
  EXPECT_FALSE(table.masters_missing());
}

TEST(WeightTable, RejectsAnEmptyModel) {
  EXPECT_THROW(WeightTable({}, PinMode::kOff, false, "test"), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing
