// What the roundpipe-train tests share: a tiny run on simulated devices
// writing into the process's temporary directory.
#pragma once

#include <roundpipe/errors.h>
#include <roundpipe/train/trainer.h>

#include <string>

#include "test_util.h"

namespace roundpipe::testing {

inline std::string temp(const std::string& name) {
  return (process_temp_dir() / ("train_" + name)).string();
}

inline train::TrainOptions tiny(const std::string& name) {
  train::TrainOptions o;
  o.config = std::string(ROUNDPIPE_SOURCE_DIR) + "/configs/qwen3-tiny/config.json";
  o.devices = "sim:2";
  o.output = temp(name);
  o.log_every = 100;
  return o;
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return error_message(e);
  }
  return "(no error)";
}

}  // namespace roundpipe::testing
