#include "train/output_dir.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/models/causal_lm.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>

#include "io/atomic_directory.h"

namespace roundpipe::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLockName = ".roundpipe-train.lock";

int pid_in(const std::string& file) {
  std::ifstream in(file);
  int pid = 0;
  in >> pid;
  return in ? pid : 0;
}

}  // namespace

OutputLock::OutputLock(const std::string& lock_file, const std::string& what) {
  const int previous = pid_in(lock_file);
  fd_ = ::open(lock_file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, "cannot open the lock file ", lock_file, ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err == EWOULDBLOCK, "cannot lock ", lock_file, ": ", std::strerror(err));
    const int holder = pid_in(lock_file);
    TORCH_CHECK(false, "another roundpipe-train run",
                holder > 0 ? " (PID " + std::to_string(holder) + ")" : std::string(),
                " is writing to ", what,
                ": wait for it to finish, or give this run another --output");
  }
  // Ours now: a holder named in the file died without releasing it.
  if (previous > 0 && previous != ::getpid()) taken_over_from_ = previous;
  const std::string pid = std::to_string(::getpid()) + "\n";
  [[maybe_unused]] const int truncated = ::ftruncate(fd_, 0);
  [[maybe_unused]] const auto written = ::pwrite(fd_, pid.data(), pid.size(), 0);
}

OutputLock::~OutputLock() {
  release();
}

void OutputLock::release() {
  if (fd_ < 0) return;
  // Emptied on the way out: a PID left in the file names a run that died
  // holding the lock (taken_over_from), not one that finished.
  [[maybe_unused]] const int truncated = ::ftruncate(fd_, 0);
  ::close(fd_);  // (closing releases the lock)
  fd_ = -1;
}

OutputLock::OutputLock(OutputLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), taken_over_from_(other.taken_over_from_) {}

OutputLock& OutputLock::operator=(OutputLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::exchange(other.fd_, -1);
    taken_over_from_ = other.taken_over_from_;
  }
  return *this;
}

int64_t step_of(const std::map<std::string, std::string>& extra, const std::string& where) {
  const auto it = extra.find("step");
  TORCH_CHECK(it != extra.end(), where, " was not written by roundpipe-train (no step)");
  const std::string& text = it->second;
  size_t used = 0;
  int64_t step = -1;
  try {
    step = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TORCH_CHECK(!text.empty() && used == text.size() && step >= 0, where,
              ": the step must be a whole number >= 0, got '", text, "'");
  return step;
}

namespace {

// The step of the roundpipe-train checkpoint in `dir`, -1 when there is
// none (no directory, or an empty one); an error for anything else.
int64_t existing_checkpoint_step(const std::string& dir) {
  const fs::path source(readable_directory(dir));
  if (!fs::exists(source) || fs::is_empty(source)) return -1;
  TORCH_CHECK(fs::exists(source / "checkpoint.json"), dir,
              " exists and is not a RoundPipe training checkpoint (no checkpoint.json): choose "
              "another --checkpoint-dir, or move that directory away");
  return step_of(checkpoint_extra(dir), dir);
}

// A directory can be written to: made if missing, a file created and removed.
void check_writable(const fs::path& dir, const std::string& what) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(!ec, "cannot create ", what, " ", dir.string(), ": ", ec.message());
  const fs::path probe = dir / (".roundpipe-probe-" + std::to_string(::getpid()));
  { std::ofstream(probe) << "probe"; }
  const bool ok = fs::exists(probe);
  fs::remove(probe, ec);
  TORCH_CHECK(ok, "cannot write to ", what, " ", dir.string(),
              ": check its permissions and free space");
}

// The writer's checks once it holds the output's lock: the checkpoint's
// own lock, a model or an earlier run's checkpoint that is not to be
// replaced, and that both places can be written.
void check_outputs(const TrainOptions& args, OutputPaths& paths) {
  if (!args.checkpoint_dir.empty()) {
    paths.checkpoint_lock =
        OutputLock(paths.checkpoint + ".lock", "--checkpoint-dir " + paths.checkpoint);
  }
  for (const auto* lock : {&paths.output_lock, &paths.checkpoint_lock}) {
    if (lock->taken_over_from() > 0) {
      std::printf("took over the lock of process %d, which is no longer running\n",
                  lock->taken_over_from());
    }
  }
  const int removed =
      remove_stale_temporaries(paths.output) + remove_stale_temporaries(paths.checkpoint);
  if (removed > 0) {
    std::printf("removed %d temporary director%s left by interrupted runs\n", removed,
                removed == 1 ? "y" : "ies");
  }
  // The model output: other files there are kept; an earlier model is
  // replaced only when asked to.
  if (!args.overwrite && !args.resume) {
    for (const auto& entry : fs::directory_iterator(paths.output)) {
      const auto name = entry.path().filename().string();
      if (name == kLockName) continue;
      TORCH_CHECK(name != "config.json" && !models::is_weight_file(name), "--output ", paths.output,
                  " already holds a model (", name,
                  "): pass --overwrite to replace it, or choose another directory");
    }
  }
  paths.checkpoint_step = existing_checkpoint_step(paths.checkpoint);
  paths.has_checkpoint = paths.checkpoint_step >= 0;
  if (paths.has_checkpoint) paths.checkpoint_extra = checkpoint_extra(paths.checkpoint);
  TORCH_CHECK(!paths.has_checkpoint || args.resume || args.overwrite, paths.checkpoint,
              " holds a training checkpoint (step ", paths.checkpoint_step,
              ") of an earlier run: pass --resume to continue it, or --overwrite to start over "
              "(it is replaced at the first save)");
  check_writable(paths.output, "--output");
  const fs::path checkpoint(paths.checkpoint);
  check_writable(checkpoint.has_parent_path() ? checkpoint.parent_path() : fs::path("."),
                 "the directory of the training checkpoint");
}

}  // namespace

// `writer`: this process writes (data parallel: rank 0); the others only
// read the step of a checkpoint to resume from.
OutputPaths prepare_outputs(const TrainOptions& args, bool writer) {
  OutputPaths paths;
  paths.output = normalized_directory(args.output);
  paths.checkpoint = normalized_directory(args.checkpoint_dir.empty() ? paths.output + ".ckpt"
                                                                      : args.checkpoint_dir);
  TORCH_CHECK(paths.checkpoint != paths.output,
              "--checkpoint-dir and --output name the same directory; give them different ones");
  if (!writer) {
    paths.checkpoint_step = args.resume ? existing_checkpoint_step(paths.checkpoint) : -1;
    paths.has_checkpoint = paths.checkpoint_step >= 0;
    if (paths.has_checkpoint) paths.checkpoint_extra = checkpoint_extra(paths.checkpoint);
    return paths;
  }
  // Before anything is read or removed (Note [One writer per output]).
  const bool created = !fs::exists(paths.output);
  {
    std::error_code ec;
    fs::create_directories(paths.output, ec);
    TORCH_CHECK(!ec, "cannot create --output ", paths.output, ": ", ec.message());
  }
  const auto lock_file = (fs::path(paths.output) / kLockName).string();
  paths.output_lock = OutputLock(lock_file, "--output " + paths.output);
  try {
    check_outputs(args, paths);
  } catch (...) {
    // A start that fails leaves nothing: the folder it made (holding only
    // the lock) goes again; one that was there stays.
    if (created) {
      std::error_code ec;
      fs::remove(lock_file, ec);
      paths.output_lock.release();
      fs::remove(paths.output, ec);  // (only if empty)
    }
    throw;
  }
  return paths;
}

int copy_tokenizer_files(const std::string& model_dir, const std::string& output) {
  if (model_dir.empty()) return 0;
  static const char* const kNames[] = {"tokenizer.json",
                                       "tokenizer_config.json",
                                       "special_tokens_map.json",
                                       "added_tokens.json",
                                       "chat_template.jinja",
                                       "chat_template.json",
                                       "vocab.json",
                                       "merges.txt",
                                       "tokenizer.model",
                                       "generation_config.json"};
  int copied = 0;
  for (const char* name : kNames) {
    const fs::path from = fs::path(model_dir) / name;
    if (!fs::is_regular_file(from)) continue;
    const fs::path to = fs::path(output) / name;
    const fs::path tmp = fs::path(output) / ("." + std::string(name) + ".tmp");
    fs::copy_file(from, tmp, fs::copy_options::overwrite_existing);
    fs::rename(tmp, to);
    ++copied;
  }
  return copied;
}

}  // namespace roundpipe::train
