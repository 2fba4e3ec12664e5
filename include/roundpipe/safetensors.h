// The safetensors format: an 8-byte little-endian header length, a JSON
// header {name: {dtype, shape, data_offsets}, "__metadata__": {...}}, then
// the raw little-endian tensor bytes.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace roundpipe::safetensors {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

struct File {
  NamedTensors tensors;  // in header order
  std::map<std::string, std::string> metadata;
  at::Tensor get(const std::string& name) const;  // throws naming the file's contents
};

// Writes atomically: to a temporary file beside `path`, flushed to disk,
// then renamed over it; a crash never leaves a half-written file at `path`.
void save_file(const std::string& path, const NamedTensors& tensors,
               const std::map<std::string, std::string>& metadata = {});

// Maps a file and validates its header: the tensors are read-only views of
// the mapping (private: writes never reach the file), paged in when touched. Truncated,
// corrupt or inconsistent files throw a c10::Error naming the file and what
// is wrong.
File load_file(const std::string& path);
// Parses a header and checks it against a data section of `data_bytes`
// (exposed for the fuzz target). Returns (name, dtype, shape, begin, end).
struct Entry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};
std::vector<Entry> parse_header(const std::string& header, uint64_t data_bytes,
                                std::map<std::string, std::string>* metadata,
                                const std::string& what);

}  // namespace roundpipe::safetensors
