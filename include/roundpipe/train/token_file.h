// Token files: a tokenised dataset that roundpipe-train maps from disk
// (written by `python -m roundpipe.prepare`). Memory stays constant
// however large the set: a batch reads its examples' pages, nothing is
// parsed per epoch.
//
// Layout (little-endian), Note [Token file]:
//   "RPTOKEN1"  8 bytes
//   uint64      length H of the header
//   header      H bytes of JSON: format, version, num_examples,
//               num_tokens, vocab_size, max_token_id, tokenizer,
//               tokenizer_fingerprint, chat_template_fingerprint, and
//               "sections": {name: [byte offset, byte length]} for
//     offsets   int64[num_examples + 1]: example i is tokens [o[i], o[i+1])
//     input_ids int32[num_tokens]
//     trained   uint8[num_tokens]: 1 where the token is a label (the
//               loss predicts it), 0 where it is context (labels -100)
// Fingerprints are FNV-1a 64 of the tokenizer.json bytes and of the chat
// template's UTF-8 text, as 16 hex digits ("" where there was none).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "roundpipe/train/data.h"

namespace roundpipe::train {

class TokenFile : public Dataset {
 public:
  // Maps `path`; throws naming the file and what is wrong with it.
  // Examples longer than max_tokens are cut to it.
  TokenFile(const std::string& path, int64_t max_tokens);
  ~TokenFile() override;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  // Whether `path` starts as a token file does.
  static bool is_token_file(const std::string& path);

  int64_t size() const override { return num_examples_; }
  Example at(int64_t index) const override;

  // The header's JSON text (what roundpipe.prepare recorded).
  const std::string& header_json() const { return header_json_; }
  int64_t num_tokens() const { return num_tokens_; }
  const std::string& tokenizer() const { return tokenizer_; }

  // Checks that the file's tokens fit a model of `vocab_size` and were
  // made with the tokenizer (and chat template) in `model_dir`, where that
  // directory holds one; throws naming both and the fix.
  void check_model(int64_t vocab_size, const std::string& model_dir) const;

 private:
  std::string path_;
  int64_t max_tokens_;
  void* mapping_ = nullptr;
  size_t mapped_bytes_ = 0;
  std::string header_json_, tokenizer_, tokenizer_fingerprint_, chat_template_fingerprint_;
  int64_t num_examples_ = 0, num_tokens_ = 0, max_token_id_ = -1;
  const int64_t* offsets_ = nullptr;
  const int32_t* input_ids_ = nullptr;
  const uint8_t* trained_ = nullptr;
};

// FNV-1a 64 of `bytes`, as 16 lowercase hex digits (roundpipe.prepare's).
std::string fnv1a64_hex(const std::string& bytes);

}  // namespace roundpipe::train
