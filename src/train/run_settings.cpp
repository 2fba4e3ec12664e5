#include "train/run_settings.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <set>
#include <sstream>

#include "train/option_checks.h"

namespace roundpipe::train {
namespace {

using nlohmann::json;

// Settings that must match: they decide which examples a step trains on,
// and the model it trains (Note [Resume settings]).
json fixed_settings(const TrainOptions& a) {
  return {{"model", a.model},
          {"config", a.model.empty() ? a.config : std::string()},
          {"data", a.data},
          {"task", a.data.empty() ? a.task : std::string()},
          {"train-examples", a.data.empty() ? a.train_examples : 0},
          {"digits", a.data.empty() ? a.digits : 0},
          {"length", a.data.empty() ? a.length : 0},
          {"eval-fraction", a.eval_fraction},
          {"seed", a.seed},
          {"batch-size", a.batch_size},
          {"grad-accum", a.grad_accum},
          {"seq-len", a.seq_len},
          {"packing", a.packing},
          {"dtype", a.dtype},
          {"optim", optim_bits_of(a.optim) == 8 ? "adamw8bit" : "adamw"},  // (its spellings alike)
          {"lora-rank", a.lora_rank},
          {"lora-alpha", a.lora_alpha},
          {"lora-dropout", a.lora_dropout},
          {"lora-targets", a.lora_rank > 0 ? a.lora_targets : std::string()},
          {"lora-target-parameters", a.lora_target_parameters},
          {"quantize-base", a.quantize_base}};
}

// Settings that may change with --allow-resume-change.
json changeable_settings(const TrainOptions& a) {
  return {{"steps", a.steps},
          {"epochs", a.epochs},
          {"lr", a.lr},
          {"lr-schedule", a.lr_schedule},
          {"warmup-steps", a.warmup_steps},
          {"warmup-ratio", a.warmup_ratio},
          {"weight-decay", a.weight_decay},
          {"max-grad-norm", a.max_grad_norm},
          {"reduce-dtype", a.reduce_dtype}};
}

std::set<std::string> names_in(const std::string& list) {
  std::set<std::string> names;
  std::stringstream in(list);
  for (std::string name; std::getline(in, name, ',');) {
    while (!name.empty() && name.front() == '-') name.erase(0, 1);  // "--lr" is "lr"
    if (!name.empty()) names.insert(name);
  }
  return names;
}

}  // namespace

std::string settings_json(const TrainOptions& args) {
  return json{{"fixed", fixed_settings(args)}, {"changeable", changeable_settings(args)}}.dump();
}

void check_resume_settings(const std::map<std::string, std::string>& extra,
                           const TrainOptions& args, const std::string& where,
                           const std::function<void(const std::string&)>& note) {
  const auto allowed = names_in(args.allow_resume_change);
  const auto changeable = changeable_settings(args);
  for (const auto& name : allowed) {
    TORCH_CHECK(changeable.contains(name), "--allow-resume-change ", name,
                ": not a setting that can change on resume; those are ", [&] {
                  std::string names;
                  for (const auto& [key, value] : changeable.items())
                    names += (names.empty() ? "" : ", ") + key;
                  return names;
                }());
  }
  const auto it = extra.find(kSettingsKey);
  if (it == extra.end()) {
    note(where +
         " records no training settings (an older roundpipe-train wrote it): they "
         "are not compared");
    return;
  }
  const auto recorded = json::parse(it->second, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(recorded.is_object() && recorded.contains("fixed") && recorded.contains("changeable"),
              where,
              ": its recorded training settings are unreadable; resume it with the "
              "roundpipe-train that wrote it, or start over with --overwrite");
  const auto fixed = fixed_settings(args);
  for (const auto& [name, was] : recorded["fixed"].items()) {
    const auto now = fixed.contains(name) ? fixed[name] : json();
    TORCH_CHECK(now == was, "--resume: ", name, " was ", was.dump(), " in the run that wrote ",
                where, " and is ", now.dump(), " now; a resumed run must train on the same ",
                "examples and model, so give the same ", name, " (or start over with --overwrite)");
  }
  for (const auto& [name, was] : recorded["changeable"].items()) {
    const auto now = changeable.contains(name) ? changeable[name] : json();
    if (now == was) continue;
    TORCH_CHECK(allowed.count(name), "--resume: ", name, " was ", was.dump(),
                " in the run that wrote ", where, " and is ", now.dump(),
                " now; give the same value, or pass --allow-resume-change ", name,
                " to continue with the new one");
    note("resuming with " + name + " " + now.dump() + " (it was " + was.dump() +
         "): allowed by --allow-resume-change");
  }
}

}  // namespace roundpipe::train
