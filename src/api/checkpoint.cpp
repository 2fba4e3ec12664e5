#include "roundpipe/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/full.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "io/atomic_directory.h"
#include "roundpipe/distributed.h"
#include "roundpipe/errors.h"
#include "roundpipe/safetensors.h"

namespace fs = std::filesystem;

namespace roundpipe {
namespace {

void write_json(const fs::path& path, const nlohmann::json& json) {
  std::ofstream out(path);
  out << json.dump(2);
  out.flush();
  TORCH_CHECK(out.good(), "cannot write ", path.string());
}

nlohmann::json read_json(const fs::path& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "checkpoint file missing: ", path.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, path.string(), " is not valid JSON: ", e.what());
  }
}

// The tensors of one kind a checkpoint holds: one file, or one per
// process that kept a share of them (sharded optimizer state).
struct Saved {
  std::vector<safetensors::File> files;
  std::string what;  // for messages
  int64_t count() const {
    int64_t n = 0;
    for (const auto& f : files) n += static_cast<int64_t>(f.tensors.size());
    return n;
  }
  at::Tensor get(const std::string& name) const {
    for (const auto& f : files) {
      for (const auto& [n, t] : f.tensors) {
        if (n == name) return t;
      }
    }
    TORCH_CHECK(false, what, ": no tensor '", name,
                "'. Was the checkpoint saved from another architecture?");
  }
};

std::string shard_file(const std::string& kind, int rank, int world, const std::string& ext) {
  char name[96];
  std::snprintf(name, sizeof(name), "%s-rank%05d-of-%05d.%s", kind.c_str(), rank, world,
                ext.c_str());
  return name;
}

// `kind`.safetensors, or the `shards` files kind-rank*-of-<shards>.
Saved load_saved(const fs::path& source, const std::string& kind, int shards) {
  Saved saved;
  if (shards == 0) {
    saved.what = (source / (kind + ".safetensors")).string();
    saved.files.push_back(safetensors::load_file(saved.what));
    return saved;
  }
  saved.what = (source / shard_file(kind, 0, shards, "safetensors")).string() + " and the other " +
               std::to_string(shards - 1) + " shards";
  for (int r = 0; r < shards; ++r)
    saved.files.push_back(
        safetensors::load_file((source / shard_file(kind, r, shards, "safetensors")).string()));
  return saved;
}

// Copies each saved tensor into the live tensor of the same name. `whole`:
// the live tensors are all the model has (not one process's share), so the
// counts must agree too.
void restore(const Saved& saved, const std::vector<std::pair<std::string, at::Tensor>>& live,
             bool whole) {
  TORCH_CHECK(!whole || saved.count() == static_cast<int64_t>(live.size()), saved.what,
              ": the checkpoint holds ", saved.count(), " tensors, the model ", live.size(),
              ". Was it saved from another architecture?");
  c10::NoGradGuard no_grad;
  for (const auto& [name, tensor] : live) {
    auto from = saved.get(name);
    TORCH_CHECK(from.sizes() == tensor.sizes(), saved.what, ": '", name, "' has shape ",
                from.sizes(), " in the checkpoint and ", tensor.sizes(), " in the model");
    tensor.copy_(from);
  }
}

// The Adam state of `master` to restore into: 8-bit when the checkpoint's
// moments are codes (`quantized`), float32 otherwise.
torch::optim::AdamParamState& adam_state(optim::Adam& adam, const at::Tensor& master,
                                         bool quantized) {
  auto& states = adam.state();
  const auto key = master.unsafeGetTensorImpl();
  auto& slot = states[key];
  if (quantized) {
    slot = std::make_unique<optim::QuantizedAdamParamState>();
  } else {
    slot = std::make_unique<torch::optim::AdamParamState>();
  }
  return static_cast<torch::optim::AdamParamState&>(*slot);
}

// checkpoint.json of the checkpoint in `dir`, its format checked.
nlohmann::json read_meta(const std::string& dir) {
  const fs::path source(readable_directory(dir));
  TORCH_CHECK(fs::exists(source / "checkpoint.json"), "no RoundPipe checkpoint in ", dir);
  auto meta = read_json(source / "checkpoint.json");
  TORCH_CHECK(meta.is_object() && meta.value("format", "") == "roundpipe-checkpoint", dir,
              " is not a RoundPipe checkpoint");
  return meta;
}

std::map<std::string, std::string> extra_of(const nlohmann::json& meta, const std::string& dir) {
  std::map<std::string, std::string> extra;
  const auto it = meta.find("extra");
  if (it == meta.end()) return extra;
  TORCH_CHECK(it->is_object(), dir, "/checkpoint.json: 'extra' must be an object");
  for (const auto& [key, value] : it->items()) {
    TORCH_CHECK(value.is_string(), dir, "/checkpoint.json: extra '", key, "' must be a string");
    extra[key] = value.get<std::string>();
  }
  return extra;
}

}  // namespace

std::map<std::string, std::string> checkpoint_extra(const std::string& dir) {
  return extra_of(read_meta(dir), dir);
}

namespace {

// The process's masters and their Adam state, as files `master_file` and
// `optimizer_file` in `dir`; returns the Adam step of each master.
nlohmann::json write_optimizer_state(const fs::path& dir, const std::string& master_file,
                                     const std::string& optimizer_file, RoundPipe& pipe,
                                     optim::Adam* adam) {
  const auto masters = pipe.optim_named_parameters();
  safetensors::save_file((dir / master_file).string(), masters);
  nlohmann::json steps = nlohmann::json::object();
  if (!adam) return steps;
  safetensors::NamedTensors moments;
  for (const auto& [name, master] : masters) {
    auto it = adam->state().find(master.unsafeGetTensorImpl());
    if (it == adam->state().end()) continue;
    auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
    steps[name] = s.step();
    moments.emplace_back(name + ".exp_avg", s.exp_avg());
    moments.emplace_back(name + ".exp_avg_sq", s.exp_avg_sq());
    if (s.max_exp_avg_sq().defined())
      moments.emplace_back(name + ".max_exp_avg_sq", s.max_exp_avg_sq());
    if (const auto* q = dynamic_cast<const optim::QuantizedAdamParamState*>(&s)) {
      moments.emplace_back(name + ".exp_avg_absmax", q->exp_avg_absmax);
      moments.emplace_back(name + ".exp_avg_sq_absmax", q->exp_avg_sq_absmax);
    }
  }
  safetensors::save_file((dir / optimizer_file).string(), moments);
  return steps;
}

// What every checkpoint holds besides the optimizer's state: the model's
// weights and buffers, the CPU random state and checkpoint.json (`meta`).
void write_common_files(const fs::path& dir, RoundPipe& pipe, optim::Adam* adam,
                        optim::GradScaler* scaler, nlohmann::json meta) {
  auto state = pipe.named_parameters();
  for (auto& b : pipe.named_buffers()) state.push_back(b);
  safetensors::save_file((dir / "model.safetensors").string(), state);
  if (adam) {
    const auto& c = adam->config();
    meta["adam"]["lr"] = c.lr;
    meta["adam"]["beta1"] = c.beta1;
    meta["adam"]["beta2"] = c.beta2;
    meta["adam"]["eps"] = c.eps;
    meta["adam"]["weight_decay"] = c.weight_decay;
    meta["adam"]["amsgrad"] = c.amsgrad;
    meta["adam"]["maximize"] = c.maximize;
    meta["adam"]["decoupled_weight_decay"] = c.decoupled_weight_decay;
    meta["adam"]["optim_bits"] = c.optim_bits;
  }
  if (scaler) meta["grad_scaler"] = scaler->state_dict();
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    safetensors::save_file((dir / "rng.safetensors").string(), {{"cpu", gen.get_state()}});
  }
  write_json(dir / "checkpoint.json", meta);
}

// Sharded saves: every process says whether its part failed (`error`, empty
// if not), and every process throws if any did, instead of some waiting
// for the others until the group's timeout.
void agree(const DataParallelOptions& dp, const std::string& error, const std::string& doing) {
  auto failed = at::full({1}, error.empty() ? 0.0 : 1.0, at::kDouble);
  all_reduce_sum(dp.process_group, failed);
  TORCH_CHECK(error.empty(), doing, " failed on rank ", dp.rank(), ": ", error);
  TORCH_CHECK(failed.item<double>() == 0, doing, " failed on ", failed.item<double>(),
              " other process(es) of ", dp.world_size(), " (their output says why)");
}

bool sharded(const RoundPipe& pipe) {
  const auto* dp = pipe.data_parallel();
  return dp != nullptr && dp->shard_optimizer_state && dp->world_size() > 1;
}

}  // namespace

void save_checkpoint(const std::string& dir, RoundPipe& pipe, optim::Adam* adam,
                     optim::GradScaler* scaler, const std::map<std::string, std::string>& extra) {
  // Not synchronize(): publishing an async step's update here would give the
  // next call fresher weights than it reads without a checkpoint. The
  // weights are saved as the next call reads them, the masters one update
  // ahead, and loading restores that state.
  const bool update_pending = pipe.wait_for_background_work();
  nlohmann::json meta = {{"format", "roundpipe-checkpoint"},
                         {"version", 1},
                         {"update_pending", update_pending},
                         {"extra", extra}};
  if (!sharded(pipe)) {
    write_directory_atomically(dir, [&](const std::string& tmp_dir) {
      const fs::path tmp(tmp_dir);
      const auto steps =
          write_optimizer_state(tmp, "master.safetensors", "optimizer.safetensors", pipe, adam);
      if (adam) meta["adam"]["steps"] = steps;
      write_common_files(tmp, pipe, adam, scaler, meta);
    });
    return;
  }
  // Sharded optimizer state: each process writes its share (masters,
  // moments, their steps) into "<dir>.optimizer-shares", which must be on a
  // file system every process sees; rank 0 then builds the checkpoint
  // around them and swaps it into place as above.
  const auto& dp = *pipe.data_parallel();
  const int rank = dp.rank(), world = dp.world_size();
  const fs::path shares(normalized_directory(dir) + ".optimizer-shares");
  std::string error;
  auto attempt = [&](const std::function<void()>& part) {
    error.clear();
    try {
      part();
    } catch (const std::exception& e) {
      error = error_message(e);
    }
  };
  attempt([&] {
    if (rank != 0) return;
    fs::remove_all(shares);  // of a save that failed
    fs::create_directories(shares);
  });
  agree(dp, error, "save_checkpoint: making " + shares.string());
  attempt([&] {
    const auto steps =
        write_optimizer_state(shares, shard_file("master", rank, world, "safetensors"),
                              shard_file("optimizer", rank, world, "safetensors"), pipe, adam);
    write_json(shares / shard_file("optimizer", rank, world, "json"), {{"steps", steps}});
  });
  agree(dp, error,
        "save_checkpoint: writing this process's optimizer state into " + shares.string());
  attempt([&] {
    if (rank != 0) return;
    write_directory_atomically(dir, [&](const std::string& tmp_dir) {
      const fs::path tmp(tmp_dir);
      for (const auto& file : fs::directory_iterator(shares))
        fs::rename(file.path(), tmp / file.path().filename());
      meta["optimizer_shards"] = world;
      write_common_files(tmp, pipe, adam, scaler, meta);
    });
    fs::remove_all(shares);
  });
  agree(dp, error, "save_checkpoint: writing " + dir + " on rank 0");
}

std::map<std::string, std::string> load_checkpoint(const std::string& dir, RoundPipe& pipe,
                                                   optim::Adam* adam, optim::GradScaler* scaler) {
  const fs::path source(readable_directory(dir));
  const auto meta = read_meta(dir);
  const auto extra = extra_of(meta, dir);
  const auto shards_entry = meta.find("optimizer_shards");
  TORCH_CHECK(shards_entry == meta.end() ||
                  (shards_entry->is_number_integer() && shards_entry->get<int>() >= 1),
              dir, "/checkpoint.json: optimizer_shards must be a positive integer");
  const int shards = shards_entry == meta.end() ? 0 : shards_entry->get<int>();
  pipe.synchronize();

  auto state = pipe.named_parameters();
  for (auto& b : pipe.named_buffers()) state.push_back(b);
  restore(load_saved(source, "model", 0), state, /*whole=*/true);
  // The masters this process keeps (all of them, unless sharded), from the
  // checkpoint's one file or its shards, whatever the process count was.
  const bool whole = !sharded(pipe);
  restore(load_saved(source, "master", shards), pipe.optim_named_parameters(), whole);

  if (adam) {
    TORCH_CHECK(meta.contains("adam"), dir, " holds no Adam state");
    const auto& a = meta["adam"];
    const auto& c = adam->config();
    TORCH_CHECK(a["amsgrad"].get<bool>() == c.amsgrad &&
                    a["decoupled_weight_decay"].get<bool>() == c.decoupled_weight_decay &&
                    a["maximize"].get<bool>() == c.maximize,
                dir,
                ": the Adam options (amsgrad, decoupled_weight_decay, maximize) differ from "
                "the checkpoint's");
    // Checkpoints from before 8-bit state hold float32 moments.
    const int saved_bits = a.value("optim_bits", 32);
    TORCH_CHECK(saved_bits == c.optim_bits, dir, ": the checkpoint's optimizer state is ",
                saved_bits, "-bit and this optimizer's ", c.optim_bits,
                "-bit; resume with the optimizer it was saved with (",
                saved_bits == 8 ? "Adam8bit / --optim adamw8bit" : "Adam / --optim adamw", ")");
    adam->set_lr(a["lr"].get<double>());
    nlohmann::json steps = shards == 0 ? a["steps"] : nlohmann::json::object();
    for (int r = 0; r < shards; ++r)
      steps.update(read_json(source / shard_file("optimizer", r, shards, "json"))["steps"]);
    const auto moments = load_saved(source, "optimizer", shards);
    for (const auto& [name, master] : pipe.optim_named_parameters()) {
      if (!steps.contains(name)) continue;
      auto exp_avg = moments.get(name + ".exp_avg").clone();
      const bool quantized = exp_avg.scalar_type() == at::kByte;
      auto& s = adam_state(*adam, master, quantized);
      s.step(steps[name].get<int64_t>());
      s.exp_avg(exp_avg);
      s.exp_avg_sq(moments.get(name + ".exp_avg_sq").clone());
      if (c.amsgrad) s.max_exp_avg_sq(moments.get(name + ".max_exp_avg_sq").clone());
      if (quantized) {
        auto& q = static_cast<optim::QuantizedAdamParamState&>(s);
        q.exp_avg_absmax = moments.get(name + ".exp_avg_absmax").clone();
        q.exp_avg_sq_absmax = moments.get(name + ".exp_avg_sq_absmax").clone();
      }
    }
  }
  if (scaler) {
    TORCH_CHECK(meta.contains("grad_scaler"), dir, " holds no GradScaler state");
    scaler->load_state_dict(meta["grad_scaler"].get<std::map<std::string, double>>());
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(safetensors::load_file((source / "rng.safetensors").string()).get("cpu"));
  }
  const auto pending = meta.find("update_pending");
  TORCH_CHECK(pending == meta.end() || pending->is_boolean(), dir,
              ": checkpoint.json's update_pending must be true or false");
  if (pending != meta.end() && pending->get<bool>()) pipe.restore_pending_update();
  return extra;
}

}  // namespace roundpipe
