// Device selection (specs, $ROUNDPIPE_DEVICES) and the round-robin pool.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <sstream>

#include "roundpipe/device.h"

namespace roundpipe {
namespace {

// Whole text as a number (std::stoll alone reads "3abc" as 3 and "-5" as
// a count); std::invalid_argument otherwise.
int64_t whole_number(const std::string& text, int64_t min) {
  size_t pos = 0;
  const int64_t value = std::stoll(text, &pos);
  if (pos != text.size() || value < min) throw std::invalid_argument(text);
  return value;
}

double positive_number(const std::string& text) {
  size_t pos = 0;
  const double value = std::stod(text, &pos);
  if (pos != text.size() || !(value > 0) || !std::isfinite(value)) {
    throw std::invalid_argument(text);
  }
  return value;
}

int64_t parse_size(const std::string& text) {
  size_t pos = 0;
  const double value = std::stod(text, &pos);
  if (!(value > 0) || !std::isfinite(value)) throw std::invalid_argument(text);
  const std::string unit = text.substr(pos);
  double scale = 1;
  if (unit == "" || unit == "B")
    scale = 1;
  else if (unit == "KiB")
    scale = 1024.0;
  else if (unit == "MiB")
    scale = 1024.0 * 1024;
  else if (unit == "GiB")
    scale = 1024.0 * 1024 * 1024;
  else if (unit == "KB")
    scale = 1e3;
  else if (unit == "MB")
    scale = 1e6;
  else if (unit == "GB")
    scale = 1e9;
  else
    TORCH_CHECK(false, "unknown size unit '", unit, "' in '", text,
                "' (use B, KiB, MiB, GiB, KB, MB or GB)");
  return static_cast<int64_t>(value * scale);
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, sep)) parts.push_back(part);
  return parts;
}

}  // namespace

std::string default_device_spec() {
  const char* env = std::getenv("ROUNDPIPE_DEVICES");
  return env ? std::string(env) : std::string("auto");
}

std::vector<CopyChunk> copy_chunks(const std::vector<at::Tensor>& dst,
                                   const std::vector<at::Tensor>& src, int64_t chunk_bytes) {
  TORCH_CHECK(dst.size() == src.size() && chunk_bytes > 0, "copy_chunks: bad arguments");
  std::vector<CopyChunk> chunks(1);
  int64_t filled = 0;  // bytes in chunks.back()
  for (size_t i = 0; i < src.size(); ++i) {
    const int64_t bytes = static_cast<int64_t>(src[i].nbytes());
    if (bytes == 0) continue;
    const bool sliceable = src[i].is_contiguous() && dst[i].is_contiguous();
    const int64_t left = std::max<int64_t>(chunk_bytes - filled, 0);
    if (bytes <= left || !sliceable) {
      if (filled > 0 && bytes > left) {
        chunks.emplace_back();
        filled = 0;
      }
      chunks.back().emplace_back(dst[i].detach(), src[i].detach());
      filled += bytes;
      continue;
    }
    // Slices of whole elements, the first filling what the chunk has left.
    // Detached: a copy is no autograd op (parameters require grad).
    const auto flat_src = src[i].detach().view(-1), flat_dst = dst[i].detach().view(-1);
    const int64_t item = static_cast<int64_t>(src[i].element_size());
    const int64_t per_chunk = std::max<int64_t>(chunk_bytes / item, 1);
    int64_t start = 0;
    while (start < flat_src.numel()) {
      int64_t room = std::max<int64_t>(chunk_bytes - filled, 0) / item;
      if (room == 0) {
        chunks.emplace_back();
        filled = 0;
        room = per_chunk;
      }
      const int64_t n = std::min(room, flat_src.numel() - start);
      chunks.back().emplace_back(flat_dst.narrow(0, start, n), flat_src.narrow(0, start, n));
      filled += n * item;
      start += n;
    }
  }
  if (chunks.back().empty()) chunks.pop_back();
  return chunks;
}

std::vector<DevicePtr> make_devices(const std::string& spec_in) {
  const std::string spec = spec_in.empty() ? "auto" : spec_in;
  const std::string help =
      "Valid device specs: 'auto', 'cuda', 'cuda:0,1' with optional ',mem=SIZE' (a smaller "
      "card's memory), 'sim:N' with optional ',mem=SIZE', ',jitter_us=N', ',gbps=X', "
      "',chunk=SIZE' (e.g. ROUNDPIPE_DEVICES=cuda,mem=24GiB or sim:3,mem=256MiB).";
  if (spec == "auto") {
    if (cuda_device_count() > 0) return make_cuda_devices();
    return make_sim_devices(1);
  }
  if (spec == "cuda" || spec.rfind("cuda:", 0) == 0 || spec.rfind("cuda,", 0) == 0) {
    std::vector<int> indices;
    int64_t memory_cap = 0;
    auto parts = split(spec, ',');
    parts[0] = parts[0] == "cuda" ? "" : parts[0].substr(5);  // the first index, if any
    for (const auto& part : parts) {
      if (part.empty()) continue;
      if (part.rfind("mem=", 0) == 0) {
        try {
          memory_cap = parse_size(part.substr(4));
        } catch (const std::exception&) {
          TORCH_CHECK(false, "bad size '", part.substr(4), "' for mem in '", spec, "'. ", help);
        }
        continue;
      }
      try {
        indices.push_back(static_cast<int>(whole_number(part, 0)));
      } catch (const std::exception&) {
        TORCH_CHECK(false, "bad GPU index '", part, "' in device spec '", spec, "'. ", help);
      }
    }
    return make_cuda_devices(indices, memory_cap);
  }
  if (spec.rfind("sim", 0) == 0) {
    auto parts = split(spec, ',');
    int count = 1;
    if (parts[0] != "sim") {
      TORCH_CHECK(parts[0].rfind("sim:", 0) == 0, "bad device spec '", spec, "'. ", help);
      try {
        count = static_cast<int>(whole_number(parts[0].substr(4), 1));
      } catch (const std::exception&) {
        TORCH_CHECK(false, "bad device count in '", spec, "' (a whole number >= 1). ", help);
      }
    }
    SimDeviceOptions options;
    for (size_t i = 1; i < parts.size(); ++i) {
      const auto eq = parts[i].find('=');
      TORCH_CHECK(eq != std::string::npos, "bad option '", parts[i], "' in '", spec, "'. ", help);
      const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
      TORCH_CHECK(key == "mem" || key == "jitter_us" || key == "gbps" || key == "chunk",
                  "unknown sim option '", key, "'. ", help);
      try {
        if (key == "mem") options.memory_budget_bytes = parse_size(value);
        if (key == "jitter_us") options.copy_jitter_us = whole_number(value, 0);
        if (key == "gbps") options.bandwidth_gbps = positive_number(value);
        if (key == "chunk") options.param_chunk_bytes = parse_size(value);
      } catch (const c10::Error& e) {
        TORCH_CHECK(false, "bad value '", value, "' for sim option '", key,
                    "': ", e.what_without_backtrace(), ". ", help);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "bad value '", value, "' for sim option '", key,
                    "' (sizes and rates must be positive, jitter_us a whole number >= 0). ", help);
      }
    }
    TORCH_CHECK(options.param_chunk_bytes > 0, "chunk must be positive in '", spec, "'. ", help);
    return make_sim_devices(count, options);
  }
  TORCH_CHECK(false, "unknown device spec '", spec, "'. ", help);
}

DevicePool::DevicePool(std::vector<DevicePtr> devices) : devices_(std::move(devices)) {
  TORCH_CHECK(!devices_.empty(), "DevicePool needs at least one device");
  const bool sim = devices_.front()->is_simulated();
  for (const auto& d : devices_) {
    TORCH_CHECK(d->is_simulated() == sim, "a DevicePool cannot mix simulated and CUDA devices (",
                devices_.front()->name(), ", ", d->name(), ")");
  }
}

int DevicePool::take(int count) {
  TORCH_CHECK(count >= 0, "DevicePool::take: count must not be negative");
  std::lock_guard<std::mutex> lock(mu_);
  const int first = cursor_;
  cursor_ = (cursor_ + count) % size();
  return first;
}

#ifndef ROUNDPIPE_WITH_CUDA
bool cuda_backend_compiled() {
  return false;
}
bool register_host_memory(void*, size_t) {
  return false;
}
void unregister_host_memory(void*) {}
int cuda_device_count() {
  return 0;
}
std::vector<DevicePtr> make_cuda_devices(const std::vector<int>&, int64_t) {
  TORCH_CHECK(false,
              "this roundpipe build has no CUDA backend (LibTorch was found without CUDA). "
              "Use ROUNDPIPE_DEVICES=sim:N, or rebuild against a CUDA-enabled torch.");
}
#endif

}  // namespace roundpipe
