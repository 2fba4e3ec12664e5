// Split and merge rules of REFERENCE.md section 3, with explicit expected values.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/microbatch.h>

namespace roundpipe {
namespace {

TEST(Microbatch, ChunkSizesPutTheRemainderFirst) {
  EXPECT_EQ(chunk_sizes(7, 3), (std::vector<int64_t>{3, 2, 2}));
  EXPECT_EQ(chunk_sizes(8, 4), (std::vector<int64_t>{2, 2, 2, 2}));
  EXPECT_EQ(chunk_sizes(5, 1), (std::vector<int64_t>{5}));
}

TEST(Microbatch, SplitsBatchTensorsAndReplicatesTheRest) {
  auto x = at::arange(14).reshape({7, 2});
  auto table = at::arange(3);   // dim 0 is not the batch: replicated
  auto scalar = at::tensor(5);  // 0-dim: replicated
  auto value = c10::ivalue::Tuple::create({x, table, scalar, c10::IValue(1.5), c10::IValue("tag")});
  auto parts = split_microbatches(value, 3);
  ASSERT_EQ(parts.size(), 3u);
  int64_t row = 0;
  for (int i = 0; i < 3; ++i) {
    const auto& e = parts[i].toTupleRef().elements();
    const int64_t rows = i == 0 ? 3 : 2;
    EXPECT_TRUE(at::equal(e[0].toTensor(), x.narrow(0, row, rows)));
    EXPECT_TRUE(at::equal(e[1].toTensor(), table));
    EXPECT_TRUE(at::equal(e[2].toTensor(), scalar));
    EXPECT_EQ(e[3].toDouble(), 1.5);
    EXPECT_EQ(e[4].toStringRef(), "tag");
    row += rows;
  }
}

TEST(Microbatch, SplitsInsideListsAndDicts) {
  c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
  dict.insert("ids", at::arange(4));
  c10::List<at::Tensor> list({at::ones({4, 2}), at::zeros({3})});
  auto parts = split_microbatches(c10::ivalue::Tuple::create({dict, list}), 2);
  const auto& e = parts[1].toTupleRef().elements();
  EXPECT_TRUE(at::equal(e[0].toGenericDict().at("ids").toTensor(), at::arange(2, 4)));
  EXPECT_EQ(e[1].toTensorList().get(0).size(0), 2);
  EXPECT_EQ(e[1].toTensorList().get(1).size(0), 3);  // not batch-sized: replicated
}

TEST(Microbatch, MergeConcatenatesAveragesAndChecksEquality) {
  std::vector<c10::IValue> parts;
  for (int i = 0; i < 3; ++i) {
    parts.push_back(c10::ivalue::Tuple::create({at::full({i + 1, 2}, i),
                                                at::scalar_tensor(static_cast<double>(i)),
                                                c10::IValue(int64_t{7})}));
  }
  auto merged = merge_microbatches(parts);
  const auto& e = merged.toTupleRef().elements();
  EXPECT_EQ(e[0].toTensor().size(0), 6);
  EXPECT_EQ(e[0].toTensor()[5][1].item<int64_t>(), 2);
  EXPECT_DOUBLE_EQ(e[1].toTensor().item<double>(), 1.0);  // mean of 0, 1, 2
  EXPECT_EQ(e[2].toInt(), 7);
}

TEST(Microbatch, MergeRejectsDifferingNonTensors) {
  std::vector<c10::IValue> parts = {c10::IValue(int64_t{1}), c10::IValue(int64_t{2})};
  try {
    merge_microbatches(parts);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs between microbatches"), std::string::npos);
  }
}

TEST(Microbatch, SplitErrorsNameTheFix) {
  try {
    split_microbatches(at::ones({2, 3}), 4);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lower num_microbatch to at most 2"), std::string::npos);
  }
  try {
    split_microbatches(c10::IValue(int64_t{3}), 2);
    FAIL();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tensor with a batch"), std::string::npos);
  }
}

}  // namespace
}  // namespace roundpipe
