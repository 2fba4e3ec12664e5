#include "roundpipe/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/atomic_directory.h"
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

// Copies each saved tensor into the live tensor of the same name.
void restore(const safetensors::File& file,
             const std::vector<std::pair<std::string, at::Tensor>>& live, const std::string& what) {
  TORCH_CHECK(file.tensors.size() == live.size(), what, ": the checkpoint holds ",
              file.tensors.size(), " tensors, the model ", live.size(),
              ". Was it saved from another architecture?");
  c10::NoGradGuard no_grad;
  for (const auto& [name, tensor] : live) {
    auto saved = file.get(name);
    TORCH_CHECK(saved.sizes() == tensor.sizes(), what, ": '", name, "' has shape ", saved.sizes(),
                " in the checkpoint and ", tensor.sizes(), " in the model");
    tensor.copy_(saved);
  }
}

torch::optim::AdamParamState& adam_state(optim::Adam& adam, const at::Tensor& master) {
  auto& states = adam.state();
  auto key = master.unsafeGetTensorImpl();
  auto it = states.find(key);
  if (it == states.end()) {
    it = states.emplace(key, std::make_unique<torch::optim::AdamParamState>()).first;
  }
  return static_cast<torch::optim::AdamParamState&>(*it->second);
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

void save_checkpoint(const std::string& dir, RoundPipe& pipe, optim::Adam* adam,
                     optim::GradScaler* scaler, const std::map<std::string, std::string>& extra) {
  // Not synchronize(): publishing an async step's update here would give the
  // next call fresher weights than it reads without a checkpoint. The
  // weights are saved as the next call reads them, the masters one update
  // ahead, and loading restores that state.
  const bool update_pending = pipe.wait_for_background_work();
  write_directory_atomically(dir, [&](const std::string& tmp_dir) {
    const fs::path tmp(tmp_dir);
    auto state = pipe.named_parameters();
    for (auto& b : pipe.named_buffers()) state.push_back(b);
    safetensors::save_file((tmp / "model.safetensors").string(), state);
    safetensors::save_file((tmp / "master.safetensors").string(), pipe.optim_named_parameters());

    nlohmann::json meta = {{"format", "roundpipe-checkpoint"},
                           {"version", 1},
                           {"update_pending", update_pending},
                           {"extra", extra}};
    if (adam) {
      safetensors::NamedTensors moments;
      nlohmann::json steps = nlohmann::json::object();
      for (const auto& [name, master] : pipe.optim_named_parameters()) {
        auto it = adam->state().find(master.unsafeGetTensorImpl());
        if (it == adam->state().end()) continue;
        auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
        steps[name] = s.step();
        moments.emplace_back(name + ".exp_avg", s.exp_avg());
        moments.emplace_back(name + ".exp_avg_sq", s.exp_avg_sq());
        if (s.max_exp_avg_sq().defined())
          moments.emplace_back(name + ".max_exp_avg_sq", s.max_exp_avg_sq());
      }
      safetensors::save_file((tmp / "optimizer.safetensors").string(), moments);
      const auto& c = adam->config();
      meta["adam"] = {{"steps", steps},
                      {"lr", c.lr},
                      {"beta1", c.beta1},
                      {"beta2", c.beta2},
                      {"eps", c.eps},
                      {"weight_decay", c.weight_decay},
                      {"amsgrad", c.amsgrad},
                      {"maximize", c.maximize},
                      {"decoupled_weight_decay", c.decoupled_weight_decay}};
    }
    if (scaler) meta["grad_scaler"] = scaler->state_dict();
    {
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      safetensors::save_file((tmp / "rng.safetensors").string(), {{"cpu", gen.get_state()}});
    }
    write_json(tmp / "checkpoint.json", meta);
  });
}

std::map<std::string, std::string> load_checkpoint(const std::string& dir, RoundPipe& pipe,
                                                   optim::Adam* adam, optim::GradScaler* scaler) {
  const fs::path source(readable_directory(dir));
  const auto meta = read_meta(dir);
  const auto extra = extra_of(meta, dir);
  pipe.synchronize();

  auto state = pipe.named_parameters();
  for (auto& b : pipe.named_buffers()) state.push_back(b);
  restore(safetensors::load_file((source / "model.safetensors").string()), state,
          (source / "model.safetensors").string());
  restore(safetensors::load_file((source / "master.safetensors").string()),
          pipe.optim_named_parameters(), (source / "master.safetensors").string());

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
    adam->set_lr(a["lr"].get<double>());
    const auto moments = safetensors::load_file((source / "optimizer.safetensors").string());
    for (const auto& [name, master] : pipe.optim_named_parameters()) {
      if (!a["steps"].contains(name)) continue;
      auto& s = adam_state(*adam, master);
      s.step(a["steps"][name].get<int64_t>());
      s.exp_avg(moments.get(name + ".exp_avg").clone());
      s.exp_avg_sq(moments.get(name + ".exp_avg_sq").clone());
      if (c.amsgrad) s.max_exp_avg_sq(moments.get(name + ".max_exp_avg_sq").clone());
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
