// The training settings a roundpipe-train checkpoint records, and the
// comparison a --resume makes with them.
#pragma once

#include <functional>
#include <map>
#include <string>

#include "roundpipe/train/trainer.h"

namespace roundpipe::train {

// The checkpoint's extra entry that holds them (JSON).
inline constexpr const char* kSettingsKey = "settings";

// Note [Resume settings]
// A resumed run continues the interrupted one only if it trains the same
// way: the same examples in the same order (data, task, seed, batch size,
// accumulation, sequence length, held-out split), the same model and
// numbers (model, dtype, LoRA). Those must match; a change is refused,
// naming the setting. Settings that can change safely, at the user's word:
// the length of the run (steps, epochs) and the optimizer's schedule (lr,
// its schedule and warmup, weight decay, clipping, the reduce dtype), with
// --allow-resume-change NAME[,NAME] and a note of old and new value.
// Settings that change no result (devices, microbatches, recompute grain,
// pinning, logging, checkpoint frequency) are not recorded.
std::string settings_json(const TrainOptions& args);

// Compares `args` with the settings in a checkpoint's extra entries
// (nothing recorded: a checkpoint of an older roundpipe-train, a note), and
// throws naming the first setting that differs unless allowed; `note`
// prints a line.
void check_resume_settings(const std::map<std::string, std::string>& extra,
                           const TrainOptions& args, const std::string& where,
                           const std::function<void(const std::string&)>& note);

}  // namespace roundpipe::train
