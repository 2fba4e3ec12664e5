// Training checkpoints: model weights and buffers, master weights, Adam
// state, GradScaler state and the CPU random state, in one directory of
// safetensors and JSON files, written atomically.
#pragma once

#include <map>
#include <string>

#include "roundpipe/optim/adam.h"
#include "roundpipe/optim/grad_scaler.h"
#include "roundpipe/roundpipe.h"

namespace roundpipe {

// Waits for `pipe`'s background work without publishing an async step's
// update (wait_for_background_work(): saving does not change what is
// trained), then writes `dir`: the weights as the next call reads them and
// the masters, one update ahead when an update is pending. The new
// checkpoint is built in a temporary directory and moved into place; a crash
// at any moment leaves either the previous checkpoint or the new one
// (load_checkpoint finds the previous one under "<dir>.previous" when the
// crash fell between the two renames). `adam` and `scaler` may be null.
// `extra` (e.g. the training step) is stored with the rest, atomically.
void save_checkpoint(const std::string& dir, RoundPipe& pipe, optim::Adam* adam,
                     optim::GradScaler* scaler,
                     const std::map<std::string, std::string>& extra = {});

// The `extra` entries of the checkpoint in `dir`, without loading it
// (throws when `dir` holds no RoundPipe checkpoint).
std::map<std::string, std::string> checkpoint_extra(const std::string& dir);

// Restores what save_checkpoint wrote into a RoundPipe over the same model
// architecture (and an Adam built on its optim_parameters()), a pending
// update included (restore_pending_update()), so that training goes on as
// in the run that saved it. Names, shapes and dtypes are checked, and a
// mismatch names the tensor.
// Returns the `extra` entries the checkpoint was saved with.
std::map<std::string, std::string> load_checkpoint(const std::string& dir, RoundPipe& pipe,
                                                   optim::Adam* adam, optim::GradScaler* scaler);

}  // namespace roundpipe
