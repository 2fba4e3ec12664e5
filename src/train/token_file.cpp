#include "roundpipe/train/token_file.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace roundpipe::train {
namespace {

namespace fs = std::filesystem;
constexpr char kMagic[8] = {'R', 'P', 'T', 'O', 'K', 'E', 'N', '1'};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The chat template a model directory's tokenizer loads, as transformers
// reads it: chat_template.jinja, else tokenizer_config.json's
// "chat_template" string; "" where there is none.
std::string chat_template_of(const fs::path& dir) {
  std::string text;
  if (fs::exists(dir / "chat_template.jinja")) {
    text = read_text(dir / "chat_template.jinja");
  } else if (fs::exists(dir / "tokenizer_config.json")) {
    const auto config = nlohmann::json::parse(read_text(dir / "tokenizer_config.json"), nullptr,
                                              /*allow_exceptions=*/false);
    const auto templates = config.is_object() && config.contains("chat_template")
                               ? config["chat_template"]
                               : nlohmann::json();
    if (templates.is_string()) text = templates.get<std::string>();
    // Several named templates: the "default" one.
    if (templates.is_array()) {
      for (const auto& t : templates)
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
            t["template"].is_string())
          text = t["template"].get<std::string>();
    }
  }
  // Line ends as transformers reads the file (text mode): "\n".
  std::string normalised;
  normalised.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i)
    if (!(text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n')) normalised += text[i];
  return normalised;
}

}  // namespace

std::string fnv1a64_hex(const std::string& bytes) {
  uint64_t hash = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

bool TokenFile::is_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char magic[8] = {};
  return in.read(magic, sizeof(magic)) && std::memcmp(magic, kMagic, sizeof(magic)) == 0;
}

TokenFile::TokenFile(const std::string& path, int64_t max_tokens)
    : path_(path), max_tokens_(max_tokens) {
  TORCH_CHECK(max_tokens >= 2, "TokenFile: max_tokens must be at least 2, got ", max_tokens);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "cannot open token file ", path, ": ", std::strerror(errno));
  struct stat info {};
  const bool stat_ok = ::fstat(fd, &info) == 0;
  mapped_bytes_ = stat_ok ? static_cast<size_t>(info.st_size) : 0;
  void* mapping =
      mapped_bytes_ > 0 ? ::mmap(nullptr, mapped_bytes_, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int error = errno;
  ::close(fd);
  TORCH_CHECK(mapping != MAP_FAILED, "cannot map token file ", path, ": ",
              mapped_bytes_ == 0 ? "it is empty" : std::strerror(error));
  mapping_ = mapping;
  const auto* bytes = static_cast<const char*>(mapping_);
  const auto fail = [&](const std::string& what) {
    TORCH_CHECK_VALUE(false, path, " is not a valid token file (", what,
                      "): write it again with python -m roundpipe.prepare");
  };
  try {
    if (mapped_bytes_ < 16 || std::memcmp(bytes, kMagic, sizeof(kMagic)) != 0)
      fail("it does not start with RPTOKEN1");
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, bytes + 8, sizeof(header_bytes));
    if (header_bytes > mapped_bytes_ - 16) fail("its header runs past the end");
    header_json_.assign(bytes + 16, header_bytes);
    const auto header = nlohmann::json::parse(header_json_, nullptr, false);
    if (!header.is_object() || header.value("format", "") != "roundpipe-tokens")
      fail("its header is not a roundpipe-tokens JSON object");
    TORCH_CHECK_VALUE(header.value("version", 0) == 1, path, " is a token file of version ",
                      header.value("version", 0),
                      "; this roundpipe reads version 1: prepare it again with this roundpipe");
    num_examples_ = header.value("num_examples", int64_t{-1});
    num_tokens_ = header.value("num_tokens", int64_t{-1});
    max_token_id_ = header.value("max_token_id", int64_t{-1});
    if (max_token_id_ < 0) fail("no max_token_id");
    tokenizer_ = header.value("tokenizer", "");
    tokenizer_fingerprint_ = header.value("tokenizer_fingerprint", "");
    chat_template_fingerprint_ = header.value("chat_template_fingerprint", "");
    // (Counts bounded by the file's size first: no product below overflows.)
    if (num_examples_ < 1 || num_tokens_ < 0 ||
        static_cast<uint64_t>(num_examples_) >= mapped_bytes_ / 8 ||
        static_cast<uint64_t>(num_tokens_) > mapped_bytes_)
      fail("its num_examples or num_tokens is missing or larger than the file");
    if (!header.contains("sections") || !header["sections"].is_object()) fail("no sections");
    // Each section within the file, aligned for its type, of its size.
    const auto section = [&](const char* name, int64_t count, size_t item) -> const void* {
      const auto& sections = header["sections"];
      if (!sections.contains(name)) fail(std::string("no ") + name);
      const auto& where = sections[name];
      if (!where.is_array() || where.size() != 2 || !where[0].is_number_unsigned() ||
          !where[1].is_number_unsigned())
        fail(std::string("section ") + name + " is not [offset, length]");
      const auto offset = where[0].get<uint64_t>(), length = where[1].get<uint64_t>();
      if (length != static_cast<uint64_t>(count) * item || offset % item != 0 ||
          offset > mapped_bytes_ || length > mapped_bytes_ - offset)
        fail(std::string("section ") + name + " has the wrong size or lies outside the file");
      return bytes + offset;
    };
    offsets_ = static_cast<const int64_t*>(section("offsets", num_examples_ + 1, 8));
    input_ids_ = static_cast<const int32_t*>(section("input_ids", num_tokens_, 4));
    trained_ = static_cast<const uint8_t*>(section("trained", num_tokens_, 1));
    // Offsets from 0 to num_tokens, never decreasing: every example lies
    // within the tokens (checked once here, not per read).
    if (offsets_[0] != 0 || offsets_[num_examples_] != num_tokens_)
      fail("its offsets do not span its tokens");
    for (int64_t i = 0; i < num_examples_; ++i)
      if (offsets_[i + 1] < offsets_[i])
        fail("its offsets decrease at example " + std::to_string(i));
  } catch (const nlohmann::json::exception& e) {
    ::munmap(mapping_, mapped_bytes_);
    mapping_ = nullptr;
    TORCH_CHECK_VALUE(false, path, " is not a valid token file (its header: ", e.what(),
                      "): write it again with python -m roundpipe.prepare");
  } catch (...) {
    ::munmap(mapping_, mapped_bytes_);
    mapping_ = nullptr;
    throw;
  }
}

TokenFile::~TokenFile() {
  if (mapping_ != nullptr) ::munmap(mapping_, mapped_bytes_);
}

Example TokenFile::at(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < num_examples_, path_, ": example ", index,
              " is outside the file's ", num_examples_);
  const int64_t begin = offsets_[index], end = offsets_[index + 1];  // (checked at open)
  const int64_t length = std::min(end - begin, max_tokens_);
  Example ex;
  ex.input_ids.assign(input_ids_ + begin, input_ids_ + begin + length);
  ex.labels.resize(length);
  for (int64_t t = 0; t < length; ++t) {
    // The header's max_token_id was checked against the model; an id past
    // it (or negative) is a damaged file, not one for the embedding.
    TORCH_CHECK(ex.input_ids[t] >= 0 && ex.input_ids[t] <= max_token_id_, path_, ": example ",
                index, " holds token id ", ex.input_ids[t], " outside the header's 0..",
                max_token_id_, "; write the file again with python -m roundpipe.prepare");
    ex.labels[t] = trained_[begin + t] ? ex.input_ids[t] : -100;
  }
  return ex;
}

void TokenFile::check_model(int64_t vocab_size, const std::string& model_dir) const {
  TORCH_CHECK(max_token_id_ < vocab_size, path_, " holds token id ", max_token_id_, " (tokenizer ",
              tokenizer_, ") but the model's vocabulary has ", vocab_size,
              " tokens: prepare the data with the model's own tokenizer (--tokenizer ",
              model_dir.empty() ? "<the model>" : model_dir, ")");
  if (model_dir.empty()) return;
  const fs::path dir(model_dir);
  if (!tokenizer_fingerprint_.empty() && fs::exists(dir / "tokenizer.json")) {
    const auto theirs = fnv1a64_hex(read_text(dir / "tokenizer.json"));
    TORCH_CHECK(theirs == tokenizer_fingerprint_, path_, " was tokenised by ", tokenizer_,
                " (tokenizer.json fingerprint ", tokenizer_fingerprint_, "), but ", model_dir,
                " has another tokenizer.json (", theirs,
                "): prepare the data again with --tokenizer ", model_dir);
  }
  const bool has_tokenizer = fs::exists(dir / "tokenizer_config.json");
  if (!chat_template_fingerprint_.empty() && has_tokenizer) {
    const auto template_text = chat_template_of(dir);
    const auto theirs = template_text.empty() ? std::string("none") : fnv1a64_hex(template_text);
    TORCH_CHECK(theirs == chat_template_fingerprint_, path_,
                " applied a chat template (fingerprint ", chat_template_fingerprint_,
                ") that is not ", model_dir, "'s (", theirs,
                "): the model would be trained on another conversation format; prepare the data "
                "again with --tokenizer ",
                model_dir);
  }
}

}  // namespace roundpipe::train
