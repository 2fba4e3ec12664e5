#include "train/hf_cache.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

namespace roundpipe::train {

namespace fs = std::filesystem;

namespace {

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

// The snapshot directory of a cached repo folder, or "" without one.
std::string snapshot_of(const fs::path& repo) {
  std::ifstream ref(repo / "refs" / "main");
  std::string commit;
  if (ref >> commit && fs::is_directory(repo / "snapshots" / commit))
    return (repo / "snapshots" / commit).string();
  std::vector<fs::path> snapshots;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(repo / "snapshots", ec))
    if (entry.is_directory()) snapshots.push_back(entry.path());
  return snapshots.size() == 1 ? snapshots.front().string() : "";
}

}  // namespace

std::string huggingface_hub_cache() {
  if (!env("HF_HUB_CACHE").empty()) return env("HF_HUB_CACHE");
  if (!env("HF_HOME").empty()) return (fs::path(env("HF_HOME")) / "hub").string();
  if (!env("XDG_CACHE_HOME").empty())
    return (fs::path(env("XDG_CACHE_HOME")) / "huggingface" / "hub").string();
  return (fs::path(env("HOME")) / ".cache" / "huggingface" / "hub").string();
}

std::string resolve_model_path(const std::string& model) {
  if (model.empty() || fs::is_directory(model)) return model;
  const fs::path cache = huggingface_hub_cache();
  const auto slash = model.find('/');
  const bool hub_name =
      model.find('/', slash == std::string::npos ? 0 : slash + 1) == std::string::npos &&
      model.front() != '.' && model.front() != '/';
  TORCH_CHECK(hub_name, "--model ", model, ": no such directory");
  std::vector<fs::path> candidates;
  if (slash != std::string::npos) {
    candidates.push_back(cache /
                         ("models--" + model.substr(0, slash) + "--" + model.substr(slash + 1)));
  } else {
    std::error_code ec;
    const std::string suffix = "--" + model;
    for (const auto& entry : fs::directory_iterator(cache, ec)) {
      const auto name = entry.path().filename().string();
      if (name.rfind("models--", 0) == 0 && name.size() > suffix.size() &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0)
        candidates.push_back(entry.path());
    }
    TORCH_CHECK(candidates.size() <= 1, "--model ", model, " matches ", candidates.size(),
                " models in the HuggingFace cache ", cache.string(),
                ": name one as ORG/NAME (for example ",
                candidates.front().filename().string().substr(8), " with -- as /)");
  }
  std::string snapshot = candidates.empty() ? "" : snapshot_of(candidates.front());
  TORCH_CHECK(!snapshot.empty(), "--model ", model,
              ": no such directory, and not in the HuggingFace cache ", cache.string(),
              " (HF_HUB_CACHE / HF_HOME; nothing is downloaded): fetch it with `hf download ",
              slash == std::string::npos ? "ORG/" + model : model,
              "` (or huggingface-cli download), or give the model's directory");
  return snapshot;
}

}  // namespace roundpipe::train
