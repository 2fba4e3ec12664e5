#include "roundpipe/atomic_directory.h"

#include <unistd.h>

#include <filesystem>

namespace fs = std::filesystem;

namespace roundpipe {

void write_directory_atomically(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write) {
  const fs::path target(dir);
  const fs::path tmp = target.string() + ".tmp-" + std::to_string(::getpid());
  const fs::path previous = target.string() + ".previous";
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  try {
    write(tmp.string());
  } catch (...) {
    fs::remove_all(tmp);
    throw;
  }
  fs::remove_all(previous);
  if (fs::exists(target)) fs::rename(target, previous);
  fs::rename(tmp, target);
  fs::remove_all(previous);
}

std::string readable_directory(const std::string& dir) {
  if (!fs::exists(dir) && fs::exists(dir + ".previous")) return dir + ".previous";
  return dir;
}

}  // namespace roundpipe
