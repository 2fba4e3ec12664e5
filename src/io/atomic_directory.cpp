#include "io/atomic_directory.h"

#include <c10/util/Exception.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <set>

namespace fs = std::filesystem;

namespace roundpipe {
namespace {

// Temporaries are named "<dir>.tmp-<pid>" beside a checkpoint and
// ".roundpipe-tmp-<pid>" inside a model output.
constexpr const char* kInsidePrefix = ".roundpipe-tmp-";

std::string this_process() {
  return std::to_string(::getpid());
}

// Whether a temporary named "<prefix><pid>" belongs to no running process
// (ours counts as not running: a temporary of ours is left from an earlier
// write that failed).
bool abandoned(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return false;
  const std::string digits = name.substr(prefix.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 9) {
    return false;
  }
  const pid_t pid = static_cast<pid_t>(std::stol(digits));
  if (pid == ::getpid()) return true;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

int remove_abandoned(const fs::path& folder, const std::string& prefix) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return 0;
  int removed = 0;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    if (abandoned(entry.path().filename().string(), prefix)) {
      fs::remove_all(entry.path(), ec);
      removed += !ec;
    }
  }
  return removed;
}

}  // namespace

std::string normalized_directory(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "an output directory must not be empty");
  // "out/" normalizes to "out/" (an empty last name): drop the separator.
  auto normal = [](const fs::path& p) {
    const auto n = p.lexically_normal();
    return !n.has_filename() && n.has_parent_path() && n != n.root_path() ? n.parent_path() : n;
  };
  fs::path path = normal(dir);
  // "." and ".." have no name to put a sibling beside: resolve them.
  const auto name = path.filename();
  if (name.empty() || name == "." || name == "..") path = normal(fs::absolute(path));
  TORCH_CHECK(path.has_filename(), "cannot write a checkpoint to '", dir,
              "': name a directory below the file system's root");
  TORCH_CHECK(!fs::exists(path) || fs::is_directory(path), "'", dir,
              "' exists and is not a directory: name a new or existing directory");
  return path.string();
}

void write_directory_atomically(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write) {
  const fs::path target(normalized_directory(dir));
  const fs::path tmp = target.string() + ".tmp-" + this_process();
  const fs::path previous = target.string() + ".previous";
  remove_stale_temporaries(target.string());
  // A crash between the two renames of an earlier write left only the
  // previous version: put it back before anything else touches it.
  if (!fs::exists(target) && fs::exists(previous)) fs::rename(previous, target);
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

void write_files_into_directory(const std::string& dir,
                                const std::function<void(const std::string& tmp)>& write,
                                const std::function<bool(const std::string& name)>& is_stale) {
  const fs::path target(normalized_directory(dir));
  fs::create_directories(target);
  remove_stale_temporaries(target.string());
  const fs::path tmp = target / (kInsidePrefix + this_process());
  fs::remove_all(tmp);
  fs::create_directory(tmp);
  std::set<std::string> written;
  try {
    write(tmp.string());
    for (const auto& entry : fs::directory_iterator(tmp)) {
      TORCH_CHECK(entry.is_regular_file(), "internal: ", entry.path().string(),
                  " is not a file; a model output is files only");
      written.insert(entry.path().filename().string());
    }
    // Each file replaces its namesake atomically (same file system).
    for (const auto& name : written) fs::rename(tmp / name, target / name);
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(tmp, ignored);
    throw;
  }
  fs::remove_all(tmp);
  for (const auto& entry : fs::directory_iterator(target)) {
    const auto name = entry.path().filename().string();
    if (entry.is_regular_file() && !written.count(name) && is_stale(name)) fs::remove(entry.path());
  }
}

std::string readable_directory(const std::string& dir) {
  const std::string path = normalized_directory(dir);
  if (!fs::exists(path) && fs::exists(path + ".previous")) return path + ".previous";
  return path;
}

int remove_stale_temporaries(const std::string& dir) {
  const fs::path target(dir);
  const fs::path parent = target.has_parent_path() ? target.parent_path() : fs::path(".");
  return remove_abandoned(parent, target.filename().string() + ".tmp-") +
         remove_abandoned(target, kInsidePrefix);
}

}  // namespace roundpipe
