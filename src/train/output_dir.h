// Where roundpipe-train writes: the model output and the training
// checkpoint, checked before training, and held by one run at a time.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "roundpipe/train/trainer.h"

namespace roundpipe::train {

// Note [One writer per output]
// Two runs writing one --output interleave metrics lines and race on the
// checkpoint's renames. So a writing run holds an exclusive flock(2) on
// "<output>/.roundpipe-train.lock" from before it checks the folder until
// it exits: a second run is refused at start, naming the holder's PID from
// the file. The kernel drops a lock with its process, so after a kill -9
// the file stays but its lock does not, and the next run takes it over. A
// --checkpoint-dir of its own is locked the same way ("<dir>.lock" beside
// it: the directory itself is swapped on every save).
class OutputLock {
 public:
  OutputLock() = default;
  // Takes the lock on `lock_file` (created if missing) or throws naming
  // the holder's PID and `what` the lock guards.
  OutputLock(const std::string& lock_file, const std::string& what);
  ~OutputLock();
  OutputLock(OutputLock&& other) noexcept;
  OutputLock& operator=(OutputLock&& other) noexcept;
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;
  // The PID an earlier holder left in the file where this lock took over a
  // stale one (that process died without releasing it), else 0.
  int taken_over_from() const { return taken_over_from_; }
  // Lets go of the lock now (the destructor does it otherwise).
  void release();

 private:
  int fd_ = -1;
  int taken_over_from_ = 0;
};

struct OutputPaths {
  std::string output;      // the HuggingFace checkpoint at the end
  std::string checkpoint;  // training checkpoints (resume)
  bool has_checkpoint = false;
  int64_t checkpoint_step = -1;
  // What the checkpoint recorded besides its tensors (its step, the
  // run's settings), read without loading it.
  std::map<std::string, std::string> checkpoint_extra;
  OutputLock output_lock, checkpoint_lock;  // held by the writing process
};

// The step a roundpipe-train checkpoint recorded.
int64_t step_of(const std::map<std::string, std::string>& extra, const std::string& where);

// `writer`: this process writes (data parallel: rank 0) and takes the
// locks; the others only read the step of a checkpoint to resume from.
OutputPaths prepare_outputs(const TrainOptions& args, bool writer);

// Copies the tokenizer files of a model directory (tokenizer.json, its
// config, special tokens, chat template, vocabularies, generation config)
// into `output`, each replaced atomically, so that the saved model (or
// adapter) loads with AutoTokenizer.from_pretrained(output) as a
// transformers Trainer's output does. Returns how many it copied.
int copy_tokenizer_files(const std::string& model_dir, const std::string& output);

}  // namespace roundpipe::train
