// The README's C++ example is examples/readme_example.cpp, built with the
// tests and run by CTest; this test keeps the README's copy identical.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

TEST(Readme, ExampleIsTheBuiltFile) {
  const std::string readme = read(std::string(ROUNDPIPE_SOURCE_DIR) + "/README.md");
  const std::string marker = "<!-- example: examples/readme_example.cpp -->\n```cpp\n";
  const auto start = readme.find(marker);
  ASSERT_NE(start, std::string::npos) << "README lacks the example marker";
  const auto body = start + marker.size();
  const auto end = readme.find("```", body);
  ASSERT_NE(end, std::string::npos);
  EXPECT_EQ(readme.substr(body, end - body),
            read(std::string(ROUNDPIPE_SOURCE_DIR) + "/examples/readme_example.cpp"));
}

}  // namespace
