// Learning-rate schedules for roundpipe-train: transformers' own
// (get_constant_schedule_with_warmup, get_linear_schedule_with_warmup,
// get_cosine_schedule_with_warmup), so a run moved from the Trainer or TRL
// keeps its learning rates.
#pragma once

#include <cstdint>
#include <string>

namespace roundpipe::train {

enum class LrScheduleKind { kConstant, kLinear, kCosine };
// "constant", "linear" or "cosine"; throws naming the choices.
LrScheduleKind lr_schedule_from_string(const std::string& text);

// A run's warmup updates: ceil(warmup_ratio * total_steps) when a ratio is
// given (transformers' TrainingArguments.get_warmup_steps), else warmup_steps.
int64_t warmup_steps_of(double warmup_ratio, int64_t warmup_steps, int64_t total_steps);

struct LrSchedule {
  LrScheduleKind kind = LrScheduleKind::kConstant;
  double peak_lr = 3e-4;
  int64_t warmup_steps = 0;  // linear from 0 to peak_lr over these updates
  int64_t total_steps = 1;   // linear and cosine reach 0 here

  // The learning rate of the update that follows `done` updates (0-based,
  // as transformers' LambdaLR counts: with warmup the first update's is 0).
  double at(int64_t done) const;
};

}  // namespace roundpipe::train
