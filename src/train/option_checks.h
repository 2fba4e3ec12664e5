// roundpipe-train's checks of its options: each names the option, what it
// accepts and what it got. validate() (trainer.h) checks the options alone,
// before anything is read; check_sizes() the sizes against the data, before
// the model loads. And what the checked options ask of the model.
#pragma once

#include <roundpipe/models/causal_lm.h>
#include <roundpipe/train/trainer.h>

#include <cstdint>

namespace roundpipe::train {

void check_sizes(const TrainOptions& options, int64_t train_examples, int processes);

// The model's options: its dtype, the loss chunk, LoRA (fp32 adapters on a
// half-precision base, as peft keeps them) and a 4-bit base.
models::CausalLMOptions model_options(const TrainOptions& options, c10::ScalarType dtype);

// AdamConfig::optim_bits of --optim (32 for adamw, 8 for adamw8bit); any
// other name is an error that lists the choices.
int optim_bits_of(const std::string& optim);

}  // namespace roundpipe::train
