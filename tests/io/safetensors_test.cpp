// safetensors round trips and the errors corrupt or truncated files give.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <roundpipe/safetensors.h>

#include "test_util.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace roundpipe {
namespace {

std::string temp_path(const std::string& name) {
  return (roundpipe::testing::process_temp_dir() / name).string();
}

std::string error_loading(const std::string& path) {
  try {
    safetensors::load_file(path);
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "(loaded)";
}

void write_raw(const std::string& path, const std::string& header, const std::string& data) {
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
  out << header << data;
}

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  const auto path = temp_path("roundtrip.safetensors");
  safetensors::NamedTensors tensors;
  for (auto dtype : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt,
                     at::kByte, at::kBool}) {
    tensors.emplace_back(std::string("t_") + c10::toString(dtype),
                         (at::rand({3, 5}) * 10).to(dtype));
  }
  tensors.emplace_back("empty", at::empty({0, 4}));
  tensors.emplace_back("scalar", at::scalar_tensor(2.5));
  tensors.emplace_back("strided", at::arange(12.0).reshape({3, 4}).t());
  safetensors::save_file(path, tensors, {{"format", "pt"}});
  auto file = safetensors::load_file(path);
  ASSERT_EQ(file.tensors.size(), tensors.size());
  EXPECT_EQ(file.metadata.at("format"), "pt");
  for (size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file.tensors[i].first, tensors[i].first);
    EXPECT_TRUE(at::equal(file.tensors[i].second, tensors[i].second)) << tensors[i].first;
  }
}

TEST(Safetensors, CorruptAndTruncatedFilesGiveClearErrors) {
  const auto path = temp_path("bad.safetensors");
  safetensors::save_file(path, {{"w", at::ones({4, 4})}});
  {  // truncated data
    auto size = std::filesystem::file_size(path);
    std::filesystem::resize_file(path, size - 10);
    EXPECT_NE(error_loading(path).find("outside the"), std::string::npos) << error_loading(path);
  }
  write_raw(path, "{not json", "");
  EXPECT_NE(error_loading(path).find("not valid JSON"), std::string::npos);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}})",
            std::string(16, '\0'));
  EXPECT_NE(error_loading(path).find("do not hold shape"), std::string::npos);
  write_raw(path, R"({"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,1]}})", std::string(1, '\0'));
  EXPECT_NE(error_loading(path).find("unsupported dtype 'Q7'"), std::string::npos);
  write_raw(path, R"({"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
            std::string(4, '\0'));
  EXPECT_NE(error_loading(path).find("non-negative"), std::string::npos);
  write_raw(path, R"({"w":{"dtype":"F32"}})", "");
  EXPECT_NE(error_loading(path).find("needs dtype, shape and data_offsets"), std::string::npos);
  {
    std::ofstream out(path, std::ios::binary);
    out << "abc";
  }
  EXPECT_NE(error_loading(path).find("too short"), std::string::npos);
  {
    std::ofstream out(path, std::ios::binary);
    out << std::string("\xff\xff\xff\xff\x00\x00\x00\x00", 8) << "{}";
  }
  EXPECT_NE(error_loading(path).find("exceeds the file"), std::string::npos);
  EXPECT_NE(error_loading(temp_path("missing.safetensors")).find("cannot open"), std::string::npos);
}

}  // namespace
}  // namespace roundpipe
