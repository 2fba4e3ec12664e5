// HuggingFace checkpoint IO of the presets: reading a checkpoint directory
// (one file or an index of shards, per-expert tensors stacked), and writing
// the model (sharded past max_shard_bytes) or its LoRA adapter in peft's
// layout, our own files only, each replaced atomically.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "io/atomic_directory.h"
#include "models/bnb_checkpoint.h"
#include "models/experts.h"
#include "models/modules.h"
#include "roundpipe/models/causal_lm.h"
#include "roundpipe/safetensors.h"

namespace fs = std::filesystem;

namespace roundpipe::models {
namespace {

std::map<std::string, std::string> weight_files(const fs::path& dir) {
  std::map<std::string, std::string> files;  // tensor name -> file
  const auto index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    std::ifstream in(index);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TORCH_CHECK(false, index.string(), " is not valid JSON: ", e.what());
    }
    TORCH_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), index.string(),
                " has no weight_map");
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      TORCH_CHECK(it->is_string(), index.string(), ": weight_map['", it.key(),
                  "'] is not a file name");
      // A plain name in this directory: an index must not reach elsewhere.
      const fs::path file(it->get<std::string>());
      TORCH_CHECK(!file.empty() && file == file.filename() && file != "." && file != "..",
                  index.string(), ": weight_map['", it.key(), "'] = '", file.string(),
                  "' is not a file name in ", dir.string());
      files[it.key()] = (dir / file).string();
    }
    return files;
  }
  const auto single = dir / "model.safetensors";
  TORCH_CHECK(fs::exists(single), "no weights in ", dir.string(),
              ": expected model.safetensors or model.safetensors.index.json");
  files[""] = single.string();
  return files;
}

}  // namespace

std::string CausalLM::hf_name(size_t layer, const std::string& name) const {
  if (layer == 0) return "model." + name;
  if (layer <= static_cast<size_t>(config_.num_hidden_layers)) {
    return "model.layers." + std::to_string(layer - 1) + "." + name;
  }
  if (name == "tied_weight") return "lm_head.weight";
  if (name == "lm_head.weight") return name;
  return "model." + name;
}

std::vector<std::pair<std::string, at::Tensor>> CausalLM::hf_state_dict() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  size_t layer = 0;
  for (const auto& child : sequential_->children()) {
    for (const auto& item : child->named_parameters()) {
      if (item.key() == "tied_weight") continue;  // the embedding, saved once
      out.emplace_back(hf_name(layer, item.key()), item.value());
    }
    ++layer;
  }
  return out;
}

namespace {

// Note [Expert checkpoint layout]
// Checkpoints on disk (the hub's, and what transformers 5 saves) hold each
// expert's projections apart: "<layer>.mlp.experts.<e>.{gate,up,down}_proj.
// weight". The preset (as transformers in memory) stacks them:
// "experts.gate_up_proj" [E, 2I, H] is gate's rows then up's, per expert;
// "experts.down_proj" [E, H, I]. Loading stacks (a copy: stacked experts
// are never the file's mapped pages); saving writes the per-expert tensors.
bool is_stacked_expert_name(const std::string& name) {
  const auto ends = [&](const std::string& suffix) {
    return name.size() > suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  return ends(".experts.gate_up_proj") || ends(".experts.down_proj");
}

// Note [MXFP4 experts]
// GPT-OSS's released checkpoints store the experts' weights in MXFP4 (its
// config's quantization_config): for "<...>.experts.gate_up_proj" the
// tensors "<...>_blocks" [E, out, in / 32, 16] uint8, two 4-bit e2m1 values
// a byte (the low nibble first), and "<...>_scales" [E, out, in / 32] uint8,
// one power of two per 32 values (its exponent + 127). They are
// dequantised as they load, on the host, one expert at a time, into the
// model's dtype and transposed to the preset's [E, in, out]: the host then
// holds 2 bytes a value in bf16 instead of MXFP4's 17/32 (3.8 x; GPT-OSS-20B's
// experts, 19.1 G values, grow from 10.1 GB to 38.2 GB). The values are
// exact in bf16 (e2m1 times a power of two), so nothing is lost but memory.
// save_pretrained writes them dequantised, without the quantization_config.
at::Tensor dequantize_mxfp4(const at::Tensor& blocks, const at::Tensor& scales,
                            at::ScalarType dtype) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && scales.scalar_type() == at::kByte &&
                  blocks.dim() == 4 && scales.dim() == 3 &&
                  blocks.sizes().slice(0, 3) == scales.sizes(),
              "MXFP4 weights need uint8 blocks [experts, out, groups, bytes] and uint8 scales "
              "[experts, out, groups], got ",
              blocks.scalar_type(), " ", blocks.sizes(), " and ", scales.scalar_type(), " ",
              scales.sizes());
  static const float kE2M1[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  const auto values = at::from_blob(const_cast<float*>(kE2M1), {16}, at::kFloat);
  const int64_t E = blocks.size(0), out = blocks.size(1), groups = blocks.size(2);
  const int64_t in = groups * blocks.size(3) * 2;
  auto result = at::empty({E, in, out}, at::TensorOptions().dtype(dtype));
  for (int64_t e = 0; e < E; ++e) {
    const auto bytes = blocks[e].to(at::kLong);  // [out, groups, 16]
    const auto pairs = at::stack(
        {values.index({bytes.bitwise_and(15)}), values.index({bytes.bitwise_right_shift(4)})},
        -1);  // [out, groups, 16, 2]: low nibble first
    const auto exponents = scales[e].to(at::kInt).sub(127).view({out, groups, 1, 1});
    result[e].copy_(at::ldexp(pairs, exponents).view({out, in}).t());
  }
  return result;
}

// The per-expert tensors of a stacked one, in checkpoint order.
safetensors::NamedTensors per_expert_tensors(const std::string& name, const at::Tensor& stacked) {
  const auto dot = name.rfind('.');
  const std::string prefix = name.substr(0, dot + 1), what = name.substr(dot + 1);
  safetensors::NamedTensors out;
  for (int64_t e = 0; e < stacked.size(0); ++e) {
    const std::string expert = prefix + std::to_string(e) + ".";
    if (what == "down_proj") {
      out.emplace_back(expert + "down_proj.weight", stacked[e]);
    } else {
      const auto halves = stacked[e].chunk(2, 0);
      out.emplace_back(expert + "gate_proj.weight", halves[0]);
      out.emplace_back(expert + "up_proj.weight", halves[1]);
    }
  }
  return out;
}

}  // namespace

std::map<std::string, detail::QuantizedWeight*> CausalLM::quantized_weights() const {
  std::map<std::string, detail::QuantizedWeight*> found;
  size_t layer = 0;
  for (const auto& child : sequential_->children()) {
    for (const auto& item : child->named_modules("", /*include_self=*/false)) {
      if (auto* linear = dynamic_cast<detail::LinearImpl*>(item.value().get());
          linear != nullptr && linear->quant)
        found[hf_name(layer, item.key() + ".weight")] = &linear->base;
      if (auto* experts = dynamic_cast<detail::MoeExpertsImpl*>(item.value().get());
          experts != nullptr && experts->quant) {
        found[hf_name(layer, item.key() + ".gate_up_proj")] = &experts->gate_up_quantized;
        found[hf_name(layer, item.key() + ".down_proj")] = &experts->down_quantized;
      }
    }
    ++layer;
  }
  return found;
}

CausalLM CausalLM::from_pretrained(const std::string& dir, CausalLMOptions options) {
  const auto config_path = (fs::path(dir) / "config.json").string();
  auto config = CausalLMConfig::from_json_file(config_path);
  // A checkpoint bitsandbytes quantized (Note [bitsandbytes checkpoints])
  // with adapters to train keeps its format, unless another is asked for;
  // without adapters it is read into full precision.
  const auto stored_format = detail::bnb_checkpoint_format(config_path);
  if (stored_format && !options.quantize_base && options.lora.rank > 0)
    options.set_quantize_base(stored_format->type).set_double_quant(stored_format->double_quant);
  const bool map = options.map_weights && !options.pin_memory;
  // Mapped: the weights are about to be replaced by the file's pages, so
  // they are allocated untouched (no resident memory) instead of initialised.
  // A quantized base too: its weights are quantized as they are read, so
  // drawing and quantizing random ones first would do that work twice.
  const bool skip_init = map || options.quantize_base.has_value();
  CausalLM model(config, skip_init ? CausalLMOptions(options).set_init_weights(false) : options);
  const auto files = weight_files(dir);
  // Each file's tensors by name, mapped when first needed (the tensors keep
  // their mapping alive).
  std::map<std::string, std::map<std::string, at::Tensor>> loaded;
  // The tensor `name`, undefined if the checkpoint has none.
  auto find_tensor = [&](const std::string& name) -> at::Tensor {
    std::string file = files.count("") ? files.at("") : "";
    if (file.empty()) {
      auto it = files.find(name);
      if (it == files.end()) return {};
      file = it->second;
    }
    auto& tensors = loaded[file];
    if (tensors.empty())
      for (auto& [n, t] : safetensors::load_file(file).tensors) tensors.emplace(n, t);
    const auto it = tensors.find(name);
    return it == tensors.end() ? at::Tensor() : it->second;
  };
  // A full-precision tensor: as stored, or dequantized from bitsandbytes'
  // format into the model's dtype (an expert's, in checkpoints that store
  // them one by one).
  auto tensor_named = [&](const std::string& name) {
    if (stored_format)
      if (const auto stored = detail::read_bnb_weight(name, find_tensor))
        return stored->dequantize(options.dtype);
    auto t = find_tensor(name);
    TORCH_CHECK(t.defined(), dir, ": the checkpoint has no tensor '", name, "'");
    return t;
  };
  c10::NoGradGuard no_grad;
  const bool per_expert_on_disk = !config.gpt_oss_experts;
  const auto quantized = model.quantized_weights();
  for (auto& [name, param] : model.hf_state_dict()) {
    if (is_lora_name(name)) continue;                        // an adapter, not the base model's
    if (detail::is_quantization_scale_name(name)) continue;  // made with its weight
    // A quantized weight is read in full precision (a tensor, or an
    // expert stack, at a time) and quantized: `p` stands for it.
    const auto q = quantized.find(name);
    const auto p = q == quantized.end()
                       ? param
                       : at::empty(q->second->shape, at::device(at::kMeta).dtype(options.dtype));
    // Stored quantized by bitsandbytes: in the model's own format, its
    // tensors as they are; otherwise dequantized below.
    const auto stored = stored_format ? detail::read_bnb_weight(name, find_tensor) : std::nullopt;
    if (stored && q != quantized.end()) {
      if (is_4bit(stored->format.type) && q->second->takes(stored->four)) {
        q->second->assign(stored->four);
        continue;
      }
      if (!is_4bit(stored->format.type) && q->second->takes(stored->eight)) {
        q->second->assign(stored->eight);
        continue;
      }
    }
    at::Tensor t;
    if (!per_expert_on_disk && is_stacked_expert_name(name) && !find_tensor(name).defined()) {
      // Note [MXFP4 experts]
      const auto blocks = find_tensor(name + "_blocks"), scales = find_tensor(name + "_scales");
      TORCH_CHECK(blocks.defined() && scales.defined(), dir, ": the checkpoint has no tensor '",
                  name, "' nor its MXFP4 blocks and scales ('", name, "_blocks', '_scales')");
      t = dequantize_mxfp4(blocks, scales, p.scalar_type());
    } else if (per_expert_on_disk && is_stacked_expert_name(name)) {
      // Note [Expert checkpoint layout]
      std::vector<at::Tensor> experts;
      for (const auto& named : per_expert_tensors(name, p))
        experts.push_back(tensor_named(named.first));
      const auto down = name.compare(name.size() - 9, 9, "down_proj") == 0;
      std::vector<at::Tensor> stacked;
      for (size_t i = 0; i < experts.size(); i += down ? 1 : 2)
        stacked.push_back(down ? experts[i] : at::cat({experts[i], experts[i + 1]}, 0));
      t = at::stack(stacked);
    } else {
      t = stored ? stored->dequantize(options.dtype) : tensor_named(name);
    }
    TORCH_CHECK(t.sizes() == p.sizes(), dir, ": '", name, "' has shape ", t.sizes(),
                " in the checkpoint but the config gives ", p.sizes());
    if (q != quantized.end()) {
      TORCH_CHECK(at::isFloatingType(t.scalar_type()), dir, ": '", name, "' is ", t.scalar_type(),
                  "; quantize_base reads a full-precision checkpoint or one bitsandbytes "
                  "quantized (with its quantization_config in config.json)");
      // (In the model's dtype first, as transformers does before bitsandbytes quantizes.)
      q->second->set(t.to(options.dtype));
      continue;
    }
    if (map && t.scalar_type() == p.scalar_type()) {
      p.set_data(t);  // the mapped pages themselves
    } else {
      p.copy_(t);
    }
  }
  return model;
}

void CausalLM::save_adapter(const std::string& dir, const std::string& base_model) const {
  const auto& lora = options_.lora;
  TORCH_CHECK(lora.rank > 0,
              "save_adapter: the model has no LoRA adapters (CausalLMOptions::lora)");
  std::vector<std::string> targets;
  for (const char* t :
       {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    if (lora.targets_projection(t)) targets.emplace_back(t);
  nlohmann::ordered_json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path",
       base_model.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(base_model)},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"use_rslora", lora.use_rslora},
      {"target_modules",
       targets.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(targets)},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"modules_to_save", nullptr},
      {"use_dora", false}};
  std::vector<std::string> expert_weights;
  for (const char* w : {"gate_up_proj", "down_proj"})
    if (lora.targets_experts(w)) expert_weights.push_back(std::string("mlp.experts.") + w);
  if (!expert_weights.empty()) config["target_parameters"] = expert_weights;
  // peft's patterns: a regular expression matched against the module path.
  for (const auto& [weight, r] : lora.expert_rank)
    config["rank_pattern"][".*\\.mlp\\.experts\\." + weight] = r;
  for (const auto& [weight, a] : lora.expert_alpha)
    config["alpha_pattern"][".*\\.mlp\\.experts\\." + weight] = a;
  safetensors::NamedTensors tensors;
  for (const auto& [name, t] : hf_state_dict())
    if (is_lora_name(name))
      tensors.emplace_back("base_model.model." + name, t.detach().contiguous());
  const std::set<std::string> ours = {"adapter_config.json", "adapter_model.safetensors"};
  write_files_into_directory(
      dir,
      [&](const std::string& tmp_dir) {
        const fs::path tmp(tmp_dir);
        std::ofstream(tmp / "adapter_config.json") << config.dump(2);
        safetensors::save_file((tmp / "adapter_model.safetensors").string(), tensors,
                               {{"format", "pt"}});
      },
      [&](const std::string& name) { return ours.count(name) > 0; });
}

bool is_weight_file(const std::string& name) {
  static const std::regex shard(R"(model-[0-9]+-of-[0-9]+\.safetensors)");
  return name == "model.safetensors" || name == "model.safetensors.index.json" ||
         std::regex_match(name, shard);
}

void CausalLM::save_pretrained(const std::string& dir, int64_t max_shard_bytes) const {
  // Only our own files change: a tokenizer or README beside them stays, and
  // the shards of an earlier save that this one does not overwrite go.
  write_files_into_directory(
      dir,
      [&](const std::string& tmp_dir) {
        const fs::path tmp(tmp_dir);
        {
          std::ofstream out(tmp / "config.json");
          out << config_.to_json_string();
        }
        // Shards of at most max_shard_bytes (a larger single tensor gets its own).
        std::vector<safetensors::NamedTensors> shards(1);
        int64_t shard_bytes = 0, total = 0;
        const auto quantized = quantized_weights();
        for (auto [name, t] : hf_state_dict()) {
          if (is_lora_name(name)) continue;  // the base model's weights only
          if (detail::is_quantization_scale_name(name)) continue;
          // A quantized weight is written dequantized, in the model's dtype.
          if (auto it = quantized.find(name); it != quantized.end())
            t = it->second->dequantize(options_.dtype);
          if (shard_bytes > 0 && shard_bytes + static_cast<int64_t>(t.nbytes()) > max_shard_bytes) {
            shards.emplace_back();
            shard_bytes = 0;
          }
          // (Stacked experts go to disk one tensor per expert and projection.)
          auto tensors = is_stacked_expert_name(name) && !config_.gpt_oss_experts
                             ? per_expert_tensors(name, t)
                             : safetensors::NamedTensors{{name, t}};
          for (auto& [saved_name, saved] : tensors) shards.back().emplace_back(saved_name, saved);
          shard_bytes += t.nbytes();
          total += t.nbytes();
        }
        const std::map<std::string, std::string> metadata = {{"format", "pt"}};
        if (shards.size() == 1) {
          safetensors::save_file((tmp / "model.safetensors").string(), shards[0], metadata);
        } else {
          nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}},
                                          {"weight_map", nlohmann::ordered_json::object()}};
          for (size_t i = 0; i < shards.size(); ++i) {
            char name[64];
            std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", i + 1,
                          shards.size());
            safetensors::save_file((tmp / name).string(), shards[i], metadata);
            for (const auto& [tensor, t] : shards[i]) index["weight_map"][tensor] = name;
          }
          std::ofstream out(tmp / "model.safetensors.index.json");
          out << index.dump(2);
        }
      },
      is_weight_file);
}

}  // namespace roundpipe::models
