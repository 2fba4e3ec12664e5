// Learning-rate schedules: see include/roundpipe/train/lr_schedule.h.
#include "roundpipe/train/lr_schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace roundpipe::train {

LrScheduleKind lr_schedule_from_string(const std::string& text) {
  if (text == "constant") return LrScheduleKind::kConstant;
  if (text == "linear") return LrScheduleKind::kLinear;
  if (text == "cosine") return LrScheduleKind::kCosine;
  TORCH_CHECK(false, "--lr-schedule: unknown learning-rate schedule '", text,
              "': use constant, linear or cosine");
}

int64_t warmup_steps_of(double warmup_ratio, int64_t warmup_steps, int64_t total_steps) {
  return warmup_ratio > 0
             ? static_cast<int64_t>(std::ceil(warmup_ratio * static_cast<double>(total_steps)))
             : warmup_steps;
}

double LrSchedule::at(int64_t done) const {
  if (done < warmup_steps) {
    return peak_lr * static_cast<double>(done) /
           static_cast<double>(std::max<int64_t>(1, warmup_steps));
  }
  const double progress = static_cast<double>(done - warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, total_steps - warmup_steps));
  switch (kind) {
    case LrScheduleKind::kConstant:
      return peak_lr;
    case LrScheduleKind::kLinear:
      return peak_lr * std::max(0.0, 1.0 - progress);
    case LrScheduleKind::kCosine:
      // Half a cosine period, from peak_lr to 0.
      return peak_lr * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
  }
  return peak_lr;
}

}  // namespace roundpipe::train
