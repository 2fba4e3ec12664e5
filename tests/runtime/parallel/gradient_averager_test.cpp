// Data-parallel gradient averaging (runtime/parallel/gradient_averager.h,
// Note [Data parallel steps], Note [Sharded optimizer state]): buckets in
// backward order cut at bucket_bytes (sharded: also where the owner
// changes, the owner being the rank of a parameter's middle element); over
// 2 ranks (threads of this process, a Gloo group each on loopback, as
// tests/api/data_parallel_test.cpp runs them) each bucket's mean, with
// zeros for a rank without a gradient; sharded, the mean at the owner
// only, whose new weights reach the other rank; differing starting weights
// refused on every rank.
#include "runtime/parallel/gradient_averager.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <roundpipe/distributed.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <functional>
#include <thread>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using detail::GradientAverager;

// Parameters 0..3 of 5, 30, 10 and 10 elements, in the order backward
// makes them final (deepest first): 3, 2, 1, 0. 55 elements in all.
const std::vector<int> kOrder = {3, 2, 1, 0};
const std::vector<int64_t> kNumel = {5, 30, 10, 10};

at::Tensor like(int id) {
  return at::zeros({kNumel.at(id)});
}

// A process group that only knows its rank and size (enough to plan).
DataParallelOptions unconnected(int rank, int world) {
  return DataParallelOptions(c10::make_intrusive<c10d::ProcessGroup>(rank, world));
}

TEST(GradientAverager, BucketsFollowBackwardOrderAndAreCutAtBucketBytes) {
  // fp32 on the network, in backward order: 40, 40, 120 and 20 bytes; at
  // most 100 a bucket (a parameter larger than that goes alone).
  GradientAverager averager(unconnected(1, 2).set_bucket_bytes(100));
  averager.plan(kOrder, like);
  EXPECT_EQ(averager.buckets(), (std::vector<std::vector<int>>{{3, 2}, {1}, {0}}));
  for (int b = 0; b < 3; ++b) EXPECT_EQ(averager.owner(b), 1);  // unsharded: every rank
  for (int id : kOrder) EXPECT_TRUE(averager.owns(id));
}

TEST(GradientAverager, ShardedBucketsAreCutWhereTheOwnerChanges) {
  // 55 elements cut into 2 runs of 27.5: the middle elements of 3 and 2
  // (at 5 and 15) fall to rank 0, those of 1 and 0 (35 and 52.5) to rank 1.
  for (int rank : {0, 1}) {
    GradientAverager averager(
        unconnected(rank, 2).set_bucket_bytes(1 << 20).set_shard_optimizer_state(true));
    averager.plan(kOrder, like);
    EXPECT_EQ(averager.buckets(), (std::vector<std::vector<int>>{{3, 2}, {1, 0}}));
    EXPECT_EQ(averager.owner(0), 0);
    EXPECT_EQ(averager.owner(1), 1);
    EXPECT_EQ(averager.owns(2), rank == 0);
    EXPECT_EQ(averager.owns(0), rank == 1);
  }
}

// Runs body(rank, group) on 2 threads, a Gloo group each; rethrows the
// first rank's error (after both ended: a failed rank fails the other's
// collectives within the timeout, it does not hang it).
void run_two_ranks(const std::function<void(int, c10::intrusive_ptr<c10d::ProcessGroup>)>& body) {
  const int port = free_port();
  std::vector<std::exception_ptr> errors(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        LaunchEnvironment env;
        env.rank = rank;
        env.world_size = 2;
        env.master_addr = "127.0.0.1";
        env.master_port = port;
        body(rank, new_gloo_group(env, "averager test", std::chrono::seconds(20)));
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Rank r's gradient of `id`.
at::Tensor grad_of(int rank, int id) {
  return at::randn({kNumel.at(id)}, at::detail::createCPUGenerator(100 * rank + id));
}

TEST(GradientAverager, TwoRanksGetEachBucketsMeanWithZerosWhereARankHadNoGradient) {
  run_two_ranks([](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    // Buckets {3, 2}, {1}, {0} (the plan above).
    GradientAverager averager(DataParallelOptions(group).set_bucket_bytes(100));
    averager.plan(kOrder, like);
    // Both ranks have gradients of 3 and 1; only rank 0 one of 2; no rank one of 0.
    std::map<int, at::Tensor> mine = {{3, grad_of(rank, 3)}, {1, grad_of(rank, 1)}};
    if (rank == 0) mine[2] = grad_of(0, 2);
    const auto own3 = mine[3].data_ptr();
    // Buckets travel while later ones are started (finished oldest first).
    for (int b = 0; b < 3; ++b) averager.start(b, mine);
    EXPECT_EQ(averager.in_flight(), 3);
    std::map<int, at::Tensor> averaged;
    for (int b = 0; b < 3; ++b) {
      EXPECT_EQ(averager.oldest(), b);
      averaged.merge(averager.finish_oldest());
    }
    EXPECT_EQ(averager.in_flight(), 0);
    // The sum of two fp32 values rounds once, the same in either order, and
    // halving is exact: the means are exact.
    EXPECT_TRUE(averaged.at(3).equal((grad_of(0, 3) + grad_of(1, 3)) / 2)) << "rank " << rank;
    EXPECT_TRUE(averaged.at(1).equal((grad_of(0, 1) + grad_of(1, 1)) / 2)) << "rank " << rank;
    EXPECT_TRUE(averaged.at(2).equal(grad_of(0, 2) / 2)) << "rank " << rank;
    EXPECT_EQ(averaged.count(0), 0u) << "no rank had a gradient of 0";
    EXPECT_EQ(averaged.at(3).data_ptr(), own3) << "the mean is written over the rank's own sum";
    // Scalars the optimizer adds up over the ranks (the clipping norm's parts).
    EXPECT_EQ(averager.sum(rank + 1.5, "a test value"), 1.5 + 2.5);
  });
}

TEST(GradientAverager, ShardedMeansReachTheOwnerWhoseNewWeightsReachTheOther) {
  run_two_ranks([](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    // Buckets {3, 2} owned by rank 0, {1, 0} by rank 1 (the plan above).
    GradientAverager averager(
        DataParallelOptions(group).set_bucket_bytes(1 << 20).set_shard_optimizer_state(true));
    averager.plan(kOrder, like);
    std::map<int, at::Tensor> mine;
    for (int id : kOrder) mine[id] = grad_of(rank, id);
    averager.start(0, mine);
    averager.start(1, mine);
    const auto first = averager.finish_oldest(), second = averager.finish_oldest();
    const auto& owned = rank == 0 ? first : second;
    EXPECT_TRUE((rank == 0 ? second : first).empty()) << "rank " << rank << " owns one bucket";
    ASSERT_EQ(owned.size(), 2u);
    for (const auto& [id, mean] : owned) {
      EXPECT_TRUE(averager.owns(id));
      EXPECT_TRUE(mean.equal((grad_of(0, id) + grad_of(1, id)) / 2)) << "rank " << rank;
    }
    // Each owner sends the new weights of its bucket but for parameter 2,
    // which its update left alone (and which the others keep then).
    std::map<int, at::Tensor> weights;  // this rank's, where the update writes them
    for (int id : kOrder) weights[id] = at::full({kNumel.at(id)}, -1.0f);
    auto new_weight = [](int id) { return at::arange(kNumel.at(id), at::kFloat) + 10 * id; };
    for (int b = 0; b < 2; ++b) {
      std::map<int, at::Tensor> updated;
      if (averager.owner(b) == rank) {
        for (int id : averager.buckets()[b])
          if (id != 2) updated[id] = new_weight(id);
      }
      averager.start_weights(b, updated);
    }
    EXPECT_EQ(averager.weights_in_flight(), 2);
    auto target = [&](int id) { return weights.at(id); };
    EXPECT_EQ(averager.finish_oldest_weights(target), std::vector<int>{3});
    EXPECT_EQ(averager.finish_oldest_weights(target), (std::vector<int>{1, 0}));
    for (int id : kOrder) {
      // The receiver writes what arrives; the owner's own weights are its update's.
      const bool arrives = id != 2 && !averager.owns(id);
      EXPECT_TRUE(weights[id].equal(arrives ? new_weight(id) : at::full({kNumel.at(id)}, -1.0f)))
          << "rank " << rank << ", parameter " << id;
    }
  });
}

TEST(GradientAverager, RanksStartingFromDifferentWeightsAreRefusedOnEveryRank) {
  std::vector<std::string> messages(2);
  run_two_ranks([&](int rank, c10::intrusive_ptr<c10d::ProcessGroup> group) {
    GradientAverager averager(DataParallelOptions(group).set_bucket_bytes(100));
    averager.plan(kOrder, like);
    // Parameter 1 differs in one element; 2 in another; the first in
    // forward order is named.
    auto weight = [rank](int id) {
      auto w = grad_of(0, id);
      if (rank == 1 && (id == 1 || id == 2)) w[3] += 1e-3;
      return w;
    };
    messages[rank] = message_of([&] {
      averager.check_same_weights(weight, [](int id) { return "param" + std::to_string(id); });
    });
  });
  for (const auto& message : messages) {
    EXPECT_HAS(message, "start from different weights");
    EXPECT_HAS(message, "param1 differs first");
  }
}

}  // namespace
}  // namespace roundpipe::testing
