#include "roundpipe/safetensors.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace roundpipe::safetensors {
namespace {

const std::vector<std::pair<std::string, at::ScalarType>>& dtype_names() {
  static const std::vector<std::pair<std::string, at::ScalarType>> names = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf},  {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}};
  return names;
}

std::string dtype_name(at::ScalarType t) {
  for (const auto& [name, type] : dtype_names()) {
    if (type == t) return name;
  }
  TORCH_CHECK(false, "safetensors: cannot store dtype ", t);
}

at::ScalarType dtype_of(const std::string& name, const std::string& what) {
  for (const auto& [n, type] : dtype_names()) {
    if (n == name) return type;
  }
  TORCH_CHECK(false, what, ": unsupported dtype '", name, "'");
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    TORCH_CHECK(n > 0, "cannot write ", path, ": ", std::strerror(errno));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

at::Tensor File::get(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return t;
  }
  TORCH_CHECK(false, "safetensors: no tensor named '", name, "' (the file holds ", tensors.size(),
              " tensors)");
}

void save_file(const std::string& path, const NamedTensors& tensors,
               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<at::Tensor> contiguous;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    TORCH_CHECK(name != "__metadata__", "safetensors: '__metadata__' is not a tensor name");
    auto t = tensor.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = t.nbytes();
    header[name] = {{"dtype", dtype_name(t.scalar_type())},
                    {"shape", t.sizes().vec()},
                    {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    contiguous.push_back(t);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  TORCH_CHECK(fd >= 0, "cannot create ", tmp, ": ", std::strerror(errno));
  try {
    uint64_t length = text.size();
    unsigned char le[8];
    for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(length >> (8 * i));
    write_all(fd, le, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& t : contiguous) write_all(fd, t.data_ptr(), t.nbytes(), tmp);
    TORCH_CHECK(::fsync(fd) == 0, "cannot flush ", tmp, ": ", std::strerror(errno));
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(tmp);
    throw;
  }
  ::close(fd);
  std::filesystem::rename(tmp, path);
}

std::vector<Entry> parse_header(const std::string& header, uint64_t data_bytes,
                                std::map<std::string, std::string>* metadata,
                                const std::string& what) {
  nlohmann::ordered_json json;  // keeps the header's order
  try {
    json = nlohmann::ordered_json::parse(header);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, what, ": the header is not valid JSON (", e.what(), ")");
  }
  TORCH_CHECK(json.is_object(), what, ": the header must be a JSON object");
  std::vector<Entry> entries;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      TORCH_CHECK(it->is_object(), what, ": __metadata__ must be an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        TORCH_CHECK(m->is_string(), what, ": __metadata__ value '", m.key(), "' is not a string");
        if (metadata) (*metadata)[m.key()] = m->get<std::string>();
      }
      continue;
    }
    const auto& v = *it;
    const std::string where = what + ": tensor '" + it.key() + "'";
    TORCH_CHECK(
        v.is_object() && v.contains("dtype") && v.contains("shape") && v.contains("data_offsets"),
        where, " needs dtype, shape and data_offsets");
    TORCH_CHECK(v["dtype"].is_string(), where, ": dtype must be a string");
    TORCH_CHECK(
        v["shape"].is_array() && v["data_offsets"].is_array() && v["data_offsets"].size() == 2,
        where, ": shape must be a list and data_offsets a pair");
    Entry e;
    e.name = it.key();
    e.dtype = dtype_of(v["dtype"].get<std::string>(), where);
    uint64_t numel = 1;
    for (const auto& d : v["shape"]) {
      TORCH_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0), where,
                  ": shape entries must be non-negative integers");
      const uint64_t n = d.get<uint64_t>();
      TORCH_CHECK(n == 0 || numel <= (uint64_t{1} << 62) / n, where, ": shape is too large");
      numel *= n;
      e.shape.push_back(static_cast<int64_t>(n));
    }
    for (const auto& o : v["data_offsets"]) {
      TORCH_CHECK(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0), where,
                  ": data_offsets must be non-negative integers");
    }
    e.begin = v["data_offsets"][0].get<uint64_t>();
    e.end = v["data_offsets"][1].get<uint64_t>();
    TORCH_CHECK(e.begin <= e.end && e.end <= data_bytes, where, ": data_offsets [", e.begin, ", ",
                e.end, ") lie outside the ", data_bytes, " data bytes (truncated file?)");
    TORCH_CHECK(e.end - e.begin == numel * c10::elementSize(e.dtype), where, ": ", e.end - e.begin,
                " bytes do not hold shape ", e.shape, " of ", v["dtype"]);
    entries.push_back(std::move(e));
  }
  return entries;
}

File load_file(const std::string& path) {
  // Memory-mapped: the tensors are views of the mapping (kept alive by each
  // tensor's deleter), so pages are read only when something touches them.
  const int fd = ::open(path.c_str(), O_RDONLY);
  TORCH_CHECK(fd >= 0, "cannot open safetensors file ", path, ": ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    TORCH_CHECK(false, "cannot stat ", path, ": ", std::strerror(errno));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    TORCH_CHECK(false, path, ": too short for a safetensors file (", size, " bytes)");
  }
  // Private and writable: a write to a view copies its page, never touches the file.
  void* map = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  TORCH_CHECK(map != MAP_FAILED, "cannot map ", path, ": ", std::strerror(errno));
  auto mapping = std::shared_ptr<void>(map, [size](void* p) { ::munmap(p, size); });
  const auto* bytes = static_cast<const unsigned char*>(map);
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  TORCH_CHECK(length <= size - 8, path, ": header length ", length, " exceeds the file (", size,
              " bytes; truncated or not safetensors)");
  const std::string header(reinterpret_cast<const char*>(bytes) + 8, length);
  File file;
  auto entries = parse_header(header, size - 8 - length, &file.metadata, path);
  const unsigned char* data = bytes + 8 + length;
  for (const auto& e : entries) {
    void* start = const_cast<unsigned char*>(data + e.begin);
    auto t = at::from_blob(
        start, e.shape, [mapping](void*) {}, at::TensorOptions().dtype(e.dtype));
    file.tensors.emplace_back(e.name, t);
  }
  return file;
}

}  // namespace roundpipe::safetensors
