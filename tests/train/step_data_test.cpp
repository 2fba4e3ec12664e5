// The run's steps (StepData) and the held-out split, which roundpipe-train
// and the Python roundpipe.train share.
#include <gtest/gtest.h>
#include <roundpipe/train/step_data.h>

#include <algorithm>
#include <map>
#include <set>

namespace roundpipe::testing {
namespace {

using train::Example;

// Example i: i + 1 tokens, all of them i + 3 (so a batch's ids name its
// examples); the first token is context, the rest labels.
std::shared_ptr<train::Dataset> numbered(int64_t count) {
  std::vector<Example> out;
  for (int64_t i = 0; i < count; ++i) {
    Example ex;
    ex.input_ids.assign(i % 7 + 2, i + 3);
    ex.labels = ex.input_ids;
    ex.labels[0] = -100;
    out.push_back(ex);
  }
  return train::in_memory(std::move(out));
}

// The examples a batch holds, by their ids (multiset).
std::multiset<int64_t> examples_of(const train::Batch& batch) {
  std::map<std::pair<int64_t, int64_t>, int64_t> seen;  // (row, id) -> tokens
  const auto ids = batch.input_ids.accessor<int64_t, 2>();
  const auto positions = batch.position_ids.defined() ? batch.position_ids.accessor<int64_t, 2>()
                                                      : batch.input_ids.accessor<int64_t, 2>();
  std::multiset<int64_t> out;
  for (int64_t r = 0; r < ids.size(0); ++r) {
    for (int64_t t = 0; t < ids.size(1); ++t) {
      const bool starts = batch.position_ids.defined() ? positions[r][t] == 0 : t == 0;
      const bool padding = batch.attention_mask.defined()
                               ? batch.attention_mask.accessor<int64_t, 2>()[r][t] == 0
                               : ids[r][t] == 0;
      if (starts && !padding) out.insert(ids[r][t] - 3);
    }
  }
  return out;
}

TEST(StepData, AnEpochTrainsOnEveryExampleOnceInAShuffleBySeed) {
  for (const bool packing : {true, false}) {
    auto options = train::StepDataOptions()
                       .set_batch_size(4)
                       .set_grad_accum(2)
                       .set_seq_len(64)
                       .set_packing(packing)
                       .set_min_rows(2)
                       .set_seed(5);
    train::StepData steps(numbered(24), options);
    ASSERT_EQ(steps.steps_per_epoch(), 3);
    std::multiset<int64_t> epoch0, epoch1;
    std::multiset<int64_t> first_call0, first_call1;
    for (int64_t step = 0; step < 6; ++step) {
      const auto s = steps.at(step);
      ASSERT_EQ(s.batches.size(), 2u);
      int64_t tokens = 0, labelled = 0;
      for (const auto& b : s.batches) {
        tokens += b.tokens;
        labelled += b.loss_tokens;
        if (packing) EXPECT_GE(b.input_ids.size(0), 2) << "a row per microbatch at least";
        for (int64_t e : examples_of(b)) (step < 3 ? epoch0 : epoch1).insert(e);
      }
      EXPECT_EQ(s.tokens, tokens);
      EXPECT_EQ(s.loss_tokens, labelled);
      if (step == 0) first_call0 = examples_of(s.batches[0]);
      if (step == 3) first_call1 = examples_of(s.batches[0]);
    }
    std::multiset<int64_t> all;
    for (int64_t i = 0; i < 24; ++i) all.insert(i);
    EXPECT_EQ(epoch0, all) << "packing " << packing;
    EXPECT_EQ(epoch1, all) << "packing " << packing;
    EXPECT_NE(first_call0, first_call1) << "each epoch has its own shuffle";
    // The same seed gives the same steps; another seed other ones.
    train::StepData again(numbered(24), options);
    EXPECT_TRUE(again.at(4).batches[1].input_ids.equal(steps.at(4).batches[1].input_ids));
    train::StepData other(numbered(24), options.set_seed(6));
    EXPECT_FALSE(other.at(0).batches[0].input_ids.equal(steps.at(0).batches[0].input_ids));
  }
}

// Data parallel: the processes' shares of a call are its examples, and
// every process counts the step's tokens over all of them.
TEST(StepData, ProcessesSplitEachCallAndCountTheWholeStep) {
  auto options = train::StepDataOptions()
                     .set_batch_size(6)
                     .set_grad_accum(2)
                     .set_seq_len(64)
                     .set_min_rows(2)
                     .set_seed(1);
  train::StepData whole(numbered(30), options);
  const auto all = whole.at(3);
  std::multiset<int64_t> shares;
  for (int rank = 0; rank < 3; ++rank) {
    auto opts = options;
    train::StepData mine(numbered(30), opts.set_process(rank, 3));
    const auto s = mine.at(3);
    EXPECT_EQ(s.tokens, all.tokens);
    EXPECT_EQ(s.loss_tokens, all.loss_tokens);
    ASSERT_EQ(s.batches.size(), 2u);
    for (const auto& b : s.batches) {
      EXPECT_EQ(examples_of(b).size(), 2u) << "2 of each call's 6 examples";
      for (int64_t e : examples_of(b)) shares.insert(e);
    }
  }
  std::multiset<int64_t> expected;
  for (const auto& b : all.batches)
    for (int64_t e : examples_of(b)) expected.insert(e);
  EXPECT_EQ(shares, expected);
}

TEST(StepData, BadSizesNameTheFix) {
  auto data = numbered(10);
  auto message = [&](train::StepDataOptions o) {
    try {
      train::StepData steps(data, o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(message(train::StepDataOptions().set_batch_size(6).set_grad_accum(2))
                .find("lower the batch size or the gradient accumulation"),
            std::string::npos);
  EXPECT_NE(message(train::StepDataOptions().set_batch_size(3).set_process(0, 2))
                .find("make the batch size a multiple of 2"),
            std::string::npos);
  EXPECT_EQ(train::steps_per_epoch(10, 3, 1), 3);
  EXPECT_EQ(train::steps_per_epoch(2, 3, 1), 1);
}

TEST(HoldOut, TheLastOfAShuffleAreHeldOutAndTheRestKeepTheirOrder) {
  auto data = numbered(40);
  const auto split = train::hold_out(data, 0.1, 3);
  ASSERT_EQ(split.eval->size(), 4);
  ASSERT_EQ(split.train->size(), 36);
  std::set<int64_t> seen;
  int64_t previous = -1;
  for (int64_t i = 0; i < split.train->size(); ++i) {
    const int64_t id = split.train->at(i).input_ids[0] - 3;
    EXPECT_GT(id, previous) << "training examples in file order";
    previous = id;
    seen.insert(id);
  }
  const auto order = train::shuffled_indices(40, 3 + 7919);
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t id = split.eval->at(i).input_ids[0] - 3;
    EXPECT_EQ(id, order[36 + i]);
    EXPECT_TRUE(seen.insert(id).second) << "held out and trained on: " << id;
  }
  EXPECT_EQ(seen.size(), 40u);
  EXPECT_THROW(train::hold_out(numbered(1), 0.5, 0), c10::Error);
}

}  // namespace
}  // namespace roundpipe::testing
