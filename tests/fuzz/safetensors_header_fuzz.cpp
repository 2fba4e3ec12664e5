// libFuzzer target: the safetensors header parser must reject any input with
// a c10::Error, never crash, hang or read out of bounds.
#include <c10/util/Exception.h>
#include <roundpipe/safetensors.h>

#include <cstdint>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 8) return 0;
  uint64_t data_bytes = 0;
  for (int i = 0; i < 8; ++i) data_bytes |= static_cast<uint64_t>(data[i]) << (8 * i);
  const std::string header(reinterpret_cast<const char*>(data) + 8, size - 8);
  std::map<std::string, std::string> metadata;
  try {
    auto entries =
        roundpipe::safetensors::parse_header(header, data_bytes % (1 << 20), &metadata, "fuzz");
    for (const auto& e : entries) {
      if (e.begin > e.end || e.end > data_bytes % (1 << 20))
        __builtin_trap();  // accepted out of bounds
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
