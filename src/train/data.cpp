#include "roundpipe/train/data.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <roundpipe/models/causal_lm.h>
#include <roundpipe/train/token_file.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

namespace roundpipe::train {

namespace {

class InMemory : public Dataset {
 public:
  explicit InMemory(std::vector<Example> examples) : examples_(std::move(examples)) {}
  int64_t size() const override { return static_cast<int64_t>(examples_.size()); }
  Example at(int64_t index) const override { return examples_.at(index); }

 private:
  std::vector<Example> examples_;
};

class Subset : public Dataset {
 public:
  Subset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices)
      : base_(std::move(base)), indices_(std::move(indices)) {
    for (int64_t i : indices_)
      TORCH_CHECK(i >= 0 && i < base_->size(), "subset: index ", i, " outside the dataset of ",
                  base_->size(), " examples");
  }
  int64_t size() const override { return static_cast<int64_t>(indices_.size()); }
  Example at(int64_t index) const override { return base_->at(indices_.at(index)); }

 private:
  std::shared_ptr<const Dataset> base_;
  std::vector<int64_t> indices_;
};

}  // namespace

std::shared_ptr<Dataset> in_memory(std::vector<Example> examples) {
  return std::make_shared<InMemory>(std::move(examples));
}

std::shared_ptr<Dataset> subset(std::shared_ptr<const Dataset> base, std::vector<int64_t> indices) {
  return std::make_shared<Subset>(std::move(base), std::move(indices));
}

std::vector<Example> gather(const Dataset& data, const std::vector<int64_t>& order, int64_t begin,
                            int64_t count) {
  TORCH_CHECK(!order.empty(), "gather: no examples to take from");
  std::vector<Example> out;
  out.reserve(count);
  const auto n = static_cast<int64_t>(order.size());
  for (int64_t j = 0; j < count; ++j) out.push_back(data.at(order[(begin + j) % n]));
  return out;
}

std::shared_ptr<Dataset> open_dataset(const std::string& path, int64_t max_tokens,
                                      int64_t vocab_size, const std::string& model_dir) {
  if (TokenFile::is_token_file(path)) {
    auto file = std::make_shared<TokenFile>(path, max_tokens);
    file->check_model(vocab_size, model_dir);
    return file;
  }
  return in_memory(load_jsonl(path, max_tokens, vocab_size));
}

std::vector<int64_t> ByteTokenizer::encode(const std::string& text) {
  std::vector<int64_t> ids;
  for (unsigned char c : text) ids.push_back(static_cast<int64_t>(c) + kOffset);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) {
  std::string text;
  for (int64_t id : ids) {
    if (id >= kOffset && id < kVocab) text.push_back(static_cast<char>(id - kOffset));
  }
  return text;
}

namespace {

// bos, the prompt (not trained on), the completion, eos.
Example prompt_completion(const std::string& prompt, const std::string& completion) {
  Example ex;
  ex.input_ids.push_back(ByteTokenizer::kBos);
  ex.labels.push_back(-100);
  for (int64_t id : ByteTokenizer::encode(prompt)) {
    ex.input_ids.push_back(id);
    ex.labels.push_back(-100);
  }
  for (int64_t id : ByteTokenizer::encode(completion)) {
    ex.input_ids.push_back(id);
    ex.labels.push_back(id);
  }
  ex.input_ids.push_back(ByteTokenizer::kEos);
  ex.labels.push_back(ByteTokenizer::kEos);
  return ex;
}

// A JSON array of whole numbers (nlohmann would read 3.7 as 3).
std::vector<int64_t> token_list(const nlohmann::json& value, const std::string& where,
                                const char* field) {
  TORCH_CHECK(value.is_array(), where, ": ", field, " must be a list of token ids");
  std::vector<int64_t> out;
  out.reserve(value.size());
  for (const auto& item : value) {
    TORCH_CHECK(item.is_number_integer(), where, ": ", field, " must hold whole numbers, found ",
                item.dump());
    out.push_back(item.get<int64_t>());
  }
  return out;
}

std::string text_field(const nlohmann::json& j, const char* field, const std::string& where) {
  TORCH_CHECK(j[field].is_string(), where, ": ", field, " must be a string, found ",
              j[field].dump());
  return j[field].get<std::string>();
}

}  // namespace

std::vector<Example> load_jsonl(const std::string& path, int64_t max_tokens, int64_t vocab_size) {
  TORCH_CHECK(max_tokens >= 2, "load_jsonl: max_tokens must be at least 2, got ", max_tokens);
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "cannot open dataset ", path);
  std::vector<Example> out;
  std::string line;
  int64_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, where, ": not valid JSON (", e.what(), ")");
    }
    TORCH_CHECK(j.is_object(), where, ": each line must be a JSON object");
    Example ex;
    if (j.contains("input_ids")) {
      ex.input_ids = token_list(j["input_ids"], where, "input_ids");
      ex.labels = j.contains("labels") ? token_list(j["labels"], where, "labels") : ex.input_ids;
      TORCH_CHECK(ex.labels.size() == ex.input_ids.size(), where,
                  ": labels and input_ids differ in length");
    } else if (j.contains("text") || j.contains("prompt")) {
      TORCH_CHECK(vocab_size >= ByteTokenizer::kVocab, where,
                  ": raw text needs the byte-level tokenizer (vocab >= 259) but the model's vocab "
                  "is ",
                  vocab_size, "; pre-tokenise the dataset into input_ids");
      const std::string prompt = j.contains("prompt") ? text_field(j, "prompt", where) : "";
      const std::string text = j.contains("completion") ? text_field(j, "completion", where)
                               : j.contains("text")     ? text_field(j, "text", where)
                                                        : "";
      ex = prompt_completion(prompt, text);
    } else {
      TORCH_CHECK(false, where, ": a line needs input_ids, text, or prompt and completion");
    }
    for (int64_t id : ex.input_ids) {
      TORCH_CHECK(id >= 0 && id < vocab_size, where, ": token id ", id, " is outside the vocab (",
                  vocab_size, ")");
    }
    for (int64_t label : ex.labels) {
      TORCH_CHECK(label == -100 || (label >= 0 && label < vocab_size), where, ": label ", label,
                  " is outside the vocab (", vocab_size, "); use -100 for tokens not trained on");
    }
    if (static_cast<int64_t>(ex.input_ids.size()) > max_tokens) {
      ex.input_ids.resize(max_tokens);
      ex.labels.resize(max_tokens);
    }
    if (ex.input_ids.size() >= 2) out.push_back(std::move(ex));
  }
  TORCH_CHECK(!out.empty(), path, " holds no usable examples");
  return out;
}

std::vector<Example> addition_task(int64_t count, int digits, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int64_t limit = 1;
  for (int i = 0; i < digits; ++i) limit *= 10;
  auto padded = [](int64_t v, int width) {
    std::string s = std::to_string(v);
    return std::string(width - s.size(), '0') + s;
  };
  std::vector<Example> out;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t a = static_cast<int64_t>(rng() % limit), b = static_cast<int64_t>(rng() % limit);
    out.push_back(prompt_completion(padded(a, digits) + "+" + padded(b, digits) + "=",
                                    padded(a + b, digits + 1)));
  }
  return out;
}

std::vector<Example> reversal_task(int64_t count, int length, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Example> out;
  for (int64_t i = 0; i < count; ++i) {
    std::string word;
    for (int c = 0; c < length; ++c) word.push_back(static_cast<char>('a' + rng() % 10));
    out.push_back(prompt_completion(word + "|", std::string(word.rbegin(), word.rend())));
  }
  return out;
}

Batch collate(const std::vector<Example>& examples, const std::vector<int64_t>& order,
              int64_t begin, int64_t count) {
  int64_t length = 0;
  for (int64_t i = 0; i < count; ++i) {
    length =
        std::max<int64_t>(length, examples[order[(begin + i) % order.size()]].input_ids.size());
  }
  Batch batch;
  batch.input_ids = at::full({count, length}, ByteTokenizer::kPad, at::kLong);
  batch.attention_mask = at::zeros({count, length}, at::kLong);
  batch.labels = at::full({count, length}, -100, at::kLong);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto mask = batch.attention_mask.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  for (int64_t i = 0; i < count; ++i) {
    const auto& ex = examples[order[(begin + i) % order.size()]];
    for (size_t t = 0; t < ex.input_ids.size(); ++t) {
      ids[i][t] = ex.input_ids[t];
      mask[i][t] = 1;
      labels[i][t] = ex.labels[t];
    }
    batch.tokens += static_cast<int64_t>(ex.input_ids.size());
  }
  batch.loss_tokens = models::count_loss_tokens(batch.labels);
  return batch;
}

Batch collate_range(const Dataset& data, int64_t begin, int64_t count) {
  TORCH_CHECK(begin >= 0 && begin < data.size() && count >= 1, "examples ", begin, " + ", count,
              " are not in the data's ", data.size());
  const int64_t n = std::min(count, data.size() - begin);
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), begin);
  const auto examples = gather(data, order, 0, n);
  std::iota(order.begin(), order.end(), 0);  // (now of `examples`)
  return collate(examples, order, 0, n);
}

namespace {

// Documents into rows: longest first, each into the row with the fewest
// tokens that it fits in (a new row when none has room).
std::vector<std::vector<const Example*>> balanced_rows(const std::vector<const Example*>& docs,
                                                       int64_t max_length, int64_t min_rows) {
  int64_t total = 0;
  for (const auto* doc : docs) total += static_cast<int64_t>(doc->input_ids.size());
  const int64_t start_rows = std::max(min_rows, (total + max_length - 1) / max_length);
  std::vector<std::vector<const Example*>> rows(start_rows);
  std::vector<int64_t> used(start_rows, 0);
  std::vector<size_t> longest_first(docs.size());
  std::iota(longest_first.begin(), longest_first.end(), 0);
  std::stable_sort(longest_first.begin(), longest_first.end(), [&](size_t a, size_t b) {
    return docs[a]->input_ids.size() > docs[b]->input_ids.size();
  });
  for (size_t i : longest_first) {
    const int64_t length = static_cast<int64_t>(docs[i]->input_ids.size());
    int64_t best = -1;
    for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
      if (used[r] + length <= max_length && (best < 0 || used[r] < used[best])) best = r;
    }
    if (best < 0) {
      rows.emplace_back();
      used.push_back(0);
      best = static_cast<int64_t>(rows.size()) - 1;
    }
    rows[best].push_back(docs[i]);
    used[best] += length;
  }
  return rows;
}

}  // namespace

Batch pack(const std::vector<Example>& examples, const std::vector<int64_t>& order, int64_t begin,
           int64_t count, int64_t max_length, int64_t min_rows) {
  TORCH_CHECK(min_rows >= 1 && min_rows <= count, "packing ", count, " examples into at least ",
              min_rows,
              " rows (one per microbatch) is not possible: raise --batch-size to at least the "
              "number of microbatches, or lower --microbatches");
  std::vector<const Example*> docs;
  for (int64_t i = 0; i < count; ++i) {
    const Example& ex = examples[order[(begin + i) % order.size()]];
    TORCH_CHECK(static_cast<int64_t>(ex.input_ids.size()) <= max_length, "an example of ",
                ex.input_ids.size(), " tokens does not fit a packed row of ", max_length,
                " (load_jsonl cuts examples to --seq-len)");
    docs.push_back(&ex);
  }
  const auto rows = balanced_rows(docs, max_length, min_rows);
  int64_t length = 0;
  for (const auto& row : rows) {
    int64_t used = 0;
    for (const auto* doc : row) used += static_cast<int64_t>(doc->input_ids.size());
    length = std::max(length, used);
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  Batch batch;
  batch.input_ids = at::full({n, length}, ByteTokenizer::kPad, at::kLong);
  batch.labels = at::full({n, length}, -100, at::kLong);
  batch.position_ids = at::zeros({n, length}, at::kLong);
  auto ids = batch.input_ids.accessor<int64_t, 2>();
  auto labels = batch.labels.accessor<int64_t, 2>();
  auto positions = batch.position_ids.accessor<int64_t, 2>();
  for (int64_t r = 0; r < n; ++r) {
    int64_t t = 0;
    for (const auto* doc : rows[r]) {
      for (size_t j = 0; j < doc->input_ids.size(); ++j, ++t) {
        ids[r][t] = doc->input_ids[j];
        labels[r][t] = j == 0 ? -100 : doc->labels[j];  // nothing predicts across documents
        positions[r][t] = static_cast<int64_t>(j);
      }
      batch.tokens += static_cast<int64_t>(doc->input_ids.size());
    }
    // The padding: a document of its own, attending only to itself.
    for (int64_t p = 0; t < length; ++t, ++p) positions[r][t] = p;
  }
  batch.loss_tokens = models::count_loss_tokens(batch.labels);
  return batch;
}

double task_accuracy(const std::vector<Example>& examples,
                     const std::function<at::Tensor(const at::Tensor&)>& logits) {
  // Prompts and answers have fixed lengths in the task: decode all at once.
  const auto& first = examples.front();
  const int64_t prompt =
      std::find_if(first.labels.begin(), first.labels.end(), [](int64_t l) { return l != -100; }) -
      first.labels.begin();
  const int64_t answer = static_cast<int64_t>(first.input_ids.size()) - prompt - 1;  // without eos
  const int64_t n = static_cast<int64_t>(examples.size());
  auto ids = at::zeros({n, prompt}, at::kLong);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = 0; t < prompt; ++t) ids[i][t] = examples[i].input_ids[t];
  }
  for (int64_t step = 0; step < answer; ++step) {
    auto next = logits(ids).select(1, ids.size(1) - 1).argmax(-1).to(at::kLong);
    ids = at::cat({ids, next.unsqueeze(1)}, 1);
  }
  int64_t correct = 0;
  auto got = ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    bool ok = true;
    for (int64_t t = 0; t < answer; ++t)
      ok = ok && got[i][prompt + t] == examples[i].input_ids[prompt + t];
    correct += ok;
  }
  return static_cast<double>(correct) / static_cast<double>(n);
}

}  // namespace roundpipe::train
