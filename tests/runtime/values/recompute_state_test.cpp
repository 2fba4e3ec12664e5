// save_for_recompute() and get_recompute_data() (runtime/values/
// recompute_state.h): what a layer's forward saves is what its recompute
// reads, per layer and microbatch; nothing is saved in an inference call,
// a recompute or outside a layer; a try undone forgets it.
#include "runtime/values/recompute_state.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/recompute.h>

#include "test_util.h"

namespace roundpipe::testing {
namespace {

using detail::LayerCallScope;
using detail::RecomputeStore;

TEST(RecomputeState, TheForwardsSaveIsTheRecomputesData) {
  RecomputeStore store;
  const c10::Device cpu(c10::kCPU);
  {
    LayerCallScope scope(store, 2, 1, /*recompute=*/false, cpu);
    EXPECT_FALSE(doing_recompute());
    save_for_recompute(at::full({2}, 7.0));
  }
  {
    LayerCallScope scope(store, 2, 0, false, cpu);
    save_for_recompute(at::full({2}, 5.0));
  }
  {
    LayerCallScope scope(store, 2, 1, /*recompute=*/true, cpu);
    EXPECT_TRUE(doing_recompute());
    save_for_recompute(at::zeros({2}));  // a recompute saves nothing
    EXPECT_TRUE(at::equal(get_recompute_data().toTensor(), at::full({2}, 7.0)));
  }
  store.forget(2, 3, 1);
  EXPECT_EQ(store.data.size(), 1u) << "microbatch 0's data went too";
  EXPECT_TRUE(store.data.count({2, 0}));
}

TEST(RecomputeState, InferenceCallsAndCodeOutsideALayerSaveNothing) {
  RecomputeStore store;
  save_for_recompute(at::ones({1}));  // outside RoundPipe: a no-op
  {
    LayerCallScope scope(store, 0, 0, false, c10::Device(c10::kCPU), /*training=*/false);
    save_for_recompute(at::ones({1}));
  }
  EXPECT_TRUE(store.data.empty());
  EXPECT_FALSE(doing_recompute());
}

}  // namespace
}  // namespace roundpipe::testing
