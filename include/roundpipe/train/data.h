// Training data for roundpipe-train: JSONL datasets, a byte-level fallback
// tokenizer, the built-in addition task, batching and greedy evaluation.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace roundpipe::train {

// One sequence; labels are aligned with input_ids (-100: not trained on).
struct Example {
  std::vector<int64_t> input_ids;
  std::vector<int64_t> labels;
};

// Examples by index, read one batch at a time (a token file maps them
// from disk; JSONL and the built-in tasks hold them in memory).
class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  virtual Example at(int64_t index) const = 0;
};

// `examples` as a Dataset.
std::shared_ptr<Dataset> in_memory(std::vector<Example> examples);
// The examples of `base` at `indices`, in that order.
std::shared_ptr<Dataset> subset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices);
// The examples of `data` at order[begin .. begin + count), wrapping around.
std::vector<Example> gather(const Dataset& data, const std::vector<int64_t>& order, int64_t begin,
                            int64_t count);
// A token file (roundpipe.prepare's, by its first bytes) or JSONL
// (load_jsonl), examples cut to max_tokens; ids must be < vocab_size.
// With a token file and a non-empty model_dir, its tokenizer must be the
// model's (TokenFile::check_model).
std::shared_ptr<Dataset> open_dataset(const std::string& path, int64_t max_tokens,
                                      int64_t vocab_size, const std::string& model_dir);

// Bytes as tokens: 0 = pad, 1 = bos, 2 = eos, byte b = b + 3 (vocab 259).
struct ByteTokenizer {
  static constexpr int64_t kPad = 0, kBos = 1, kEos = 2, kOffset = 3, kVocab = 259;
  static std::vector<int64_t> encode(const std::string& text);
  static std::string decode(const std::vector<int64_t>& ids);
};

// Lines of {"input_ids": [...], "labels": [...]?}, {"text": "..."} or
// {"prompt": "...", "completion": "..."} (only the completion is trained
// on). Sequences longer than max_tokens are cut. Errors name file and line.
std::vector<Example> load_jsonl(const std::string& path, int64_t max_tokens, int64_t vocab_size);

// "a+b=c" with zero-padded a, b < 10^digits and c of digits + 1 digits,
// deterministic in seed; only the answer and eos are trained on.
std::vector<Example> addition_task(int64_t count, int digits, uint64_t seed);

// "abcde|edcba": reverse a random word of `length` letters from a..j.
std::vector<Example> reversal_task(int64_t count, int length, uint64_t seed);

// Rows of examples, [rows, length]: either one example a row, right padded
// (attention_mask set), or packed (position_ids set, no mask).
struct Batch {
  at::Tensor input_ids, attention_mask, labels, position_ids;
  int64_t tokens = 0;       // non-pad tokens
  int64_t loss_tokens = 0;  // labels the loss counts (models::count_loss_tokens)
};
// Examples order[begin .. begin + count) (wrapping around), one a row.
Batch collate(const std::vector<Example>& examples, const std::vector<int64_t>& order,
              int64_t begin, int64_t count);
// Examples [begin, begin + count) of `data` (fewer at its end), one a row.
Batch collate_range(const Dataset& data, int64_t begin, int64_t count);
// The same examples packed into rows of at most max_length tokens and at
// least min_rows rows (so that every microbatch gets a row): longest
// first, each into the row holding the fewest tokens it fits in, so rows
// come out about equally long. In a row, each document's position_ids
// restart at 0 and its first label is -100 (no label crosses from one
// document into the next); the tail padding is one more document of pad
// tokens, labels -100. The model then computes each document as it would
// alone, without a mask (transformers' DataCollatorWithFlattening form).
Batch pack(const std::vector<Example>& examples, const std::vector<int64_t>& order, int64_t begin,
           int64_t count, int64_t max_length, int64_t min_rows);

// Exact-match accuracy of greedy answers on a task of fixed-length prompts
// and answers (addition, reversal); `logits` maps input_ids [batch, length]
// to logits [batch, length, vocab].
double task_accuracy(const std::vector<Example>& examples,
                     const std::function<at::Tensor(const at::Tensor&)>& logits);

}  // namespace roundpipe::train
