// Cutting a label into row chunks and putting the chunks' outputs and input
// gradients back together (runtime/row_chunks.h, Note [Tail row chunks]),
// checked on CPU tensors against the whole microbatch's values.
#include "runtime/stage/row_chunks.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace roundpipe::testing {
namespace {

TEST(RowChunks, ALabelsRowTensorsAreCutAndTheRestKept) {
  const auto labels = at::arange(12).reshape({6, 2});
  const auto weights = at::arange(3);  // another row count: kept whole
  const auto scalar = at::scalar_tensor(7);
  const c10::IValue label = c10::ivalue::Tuple::create({labels, weights, scalar});
  const auto cut = detail::rows_of(label, 6, 2, 3).toTupleRef().elements();
  EXPECT_TRUE(at::equal(cut[0].toTensor(), labels.narrow(0, 2, 3)));
  EXPECT_TRUE(at::equal(cut[1].toTensor(), weights));
  EXPECT_TRUE(at::equal(cut[2].toTensor(), scalar));
}

TEST(RowChunks, OutputsAreConcatenatedAndZeroDimTensorsAdded) {
  const auto whole = at::randn({5, 3}, at::kDouble);
  const std::vector<c10::IValue> chunks = {
      c10::ivalue::Tuple::create({whole.narrow(0, 0, 2), at::scalar_tensor(1.5, at::kDouble)}),
      c10::ivalue::Tuple::create({whole.narrow(0, 2, 3), at::scalar_tensor(2.0, at::kDouble)})};
  const auto merged = detail::merge_row_chunks(chunks).toTupleRef().elements();
  EXPECT_TRUE(at::equal(merged[0].toTensor(), whole));
  EXPECT_DOUBLE_EQ(merged[1].toTensor().item<double>(), 3.5);
  // The first chunk's 0-dim tensor is not written through.
  EXPECT_DOUBLE_EQ(chunks[0].toTupleRef().elements()[1].toTensor().item<double>(), 1.5);
}

TEST(RowChunks, InputGradientsAreConcatenatedWhereSplitAndSummedWhereShared) {
  // Input tensors: hidden states split by rows [4, 3], a shared table [2, 3]
  // (each chunk's gradient is of its full shape), and an integer tensor
  // without gradients.
  const std::vector<at::Tensor> whole = {at::zeros({4, 3}), at::zeros({2, 3}),
                                         at::zeros({4}, at::kLong)};
  const auto hidden = at::randn({4, 3});
  const auto table_a = at::randn({2, 3});
  const auto table_b = at::randn({2, 3});
  const std::vector<std::vector<at::Tensor>> chunk_grads = {
      {hidden.narrow(0, 0, 1), table_a, at::Tensor()},
      {hidden.narrow(0, 1, 3), table_b, at::Tensor()}};
  const auto merged = detail::merge_chunk_input_grads(chunk_grads, whole, 0);
  ASSERT_EQ(merged.size(), 3u);
  EXPECT_TRUE(at::equal(merged[0], hidden));
  EXPECT_TRUE(at::allclose(merged[1], table_a + table_b));
  EXPECT_FALSE(merged[2].defined());
}

TEST(RowChunks, AGradientFromSomeChunksOnlyIsAnError) {
  const std::vector<at::Tensor> whole = {at::zeros({2, 3})};
  const std::vector<std::vector<at::Tensor>> chunk_grads = {{at::ones({1, 3})}, {at::Tensor()}};
  try {
    detail::merge_chunk_input_grads(chunk_grads, whole, 5);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("microbatch 5"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace roundpipe::testing
