// roundpipe-train's checks of its options: each names the option, what it
// accepts and what it got. validate() (trainer.h) checks the options alone,
// before anything is read; check_sizes() the sizes against the data, before
// the model loads.
#pragma once

#include <roundpipe/train/trainer.h>

#include <cstdint>

namespace roundpipe::train {

void check_sizes(const TrainOptions& options, int64_t train_examples, int processes);

}  // namespace roundpipe::train
