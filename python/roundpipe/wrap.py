"""wrap_model_to_roundpipe: presets for HuggingFace causal LMs (and a peft
model's view of one); the automatic wrapping of models without one is in
auto_wrap.py."""
from __future__ import annotations

import math
import sys
import warnings
from typing import Optional

import torch
from torch import nn

from . import _C, distributed
from .roundpipe import RoundPipe
from ._bnb import _strip_base_layers, quantized_base
from .auto_wrap import AutoRoundPipe, _auto_wrap, _param_bytes
from .run_config import RoundPipeRunConfig, default_num_microbatch

# HuggingFace class name -> native preset (the C++ Qwen3/Llama layers).
PRESETS = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
           "LlamaForCausalLM": "llama", "GptOssForCausalLM": "gpt_oss"}


class CausalLMRoundPipe(RoundPipe):
    """A HuggingFace Qwen3/Llama causal LM run by RoundPipe's native layers:
    an input adapter (embedding, rotary cos/sin and the attention layout,
    made once per microbatch and handed along), one layer per decoder block, and
    an output adapter (final norm, lm_head, loss). The layers compute on the
    HuggingFace model's own parameter tensors, so ``save_pretrained`` and
    ``state_dict`` of the original see the trained weights (after
    ``synchronize()``).

    Call it like the HuggingFace model: ``model(input_ids, attention_mask=None,
    labels=None, position_ids=None, return_logits=None,
    num_items_in_batch=None)`` returns a ``CausalLMOutputWithPast``: with
    labels, the loss and the logits, as transformers and the original
    (``return_logits`` defaults to True there). ``return_logits=False`` (per
    call, or the wrap's) computes the loss chunk by chunk without
    materialising the [tokens, vocab] logits; ``forward_backward`` with the
    default ``loss_fn`` and no ``return_outputs``, where no logits can be
    seen, does so by itself.

    - Padding (``attention_mask``, left or right) and packed documents
      (``position_ids`` restarting at 0 for each, no mask: what
      ``DataCollatorWithFlattening`` gives) run as variable-length sequences
      without a [T, T] mask; an all-ones mask is the same as none. Padding
      positions get a zero attention output, as with transformers'
      ``flash_attention_2`` (its ``sdpa`` path differs there, in the logits
      at padding positions only).
    - Losses follow transformers and the original (Note [Microbatch losses]):
      each microbatch's ``output.loss`` is that microbatch's mean over its
      labelled tokens, or its sum divided by ``num_items_in_batch`` when the
      caller gives it; ``forward`` averages the microbatch losses and
      ``forward_backward`` returns the sum of ``loss_fn``'s values. With the
      default ``loss_fn`` (the original has none that works for a preset),
      ``forward_backward`` trains on the whole batch's token-weighted mean,
      whatever ``num_microbatch`` is: each microbatch's loss is its share.
    """

    def __init__(self, model: nn.Module, return_logits: Optional[bool] = None, loss_chunk_tokens: int = 2048,
                 grouped_experts: bool = True, expert_chunk_tokens: int = 4096, **kwargs):
        hf, parameters, lora = _peft_view(model)
        # A bitsandbytes-quantized model's projections: their own tensors.
        quantize_base, quantized = quantized_base(hf, parameters)
        dtypes = {p.dtype for n, p in parameters.items() if ".lora_" not in n and n not in quantized}
        if len(dtypes) != 1:
            raise ValueError(f"the {type(hf).__name__} preset needs one parameter dtype, found {sorted(map(str, dtypes))}; "
                             "convert the model with .to(dtype) first")
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError("load the model on the CPU (RoundPipe moves layers to the GPUs itself)")
        # None: the original's default (logits returned), skipped where unseen.
        logits_default = True if return_logits is None else bool(return_logits)
        layers = _C.preset_layers(hf.config.to_json_string(), dtypes.pop(), parameters,
                                  logits_default, int(loss_chunk_tokens), lora, bool(grouped_experts),
                                  int(expert_chunk_tokens), quantize_base)
        super().__init__(model, _layers=layers, **kwargs)
        object.__setattr__(self, "_logits_by_default", return_logits is None)

    def forward(self, *args, logits_to_keep=0, **kwargs):
        """As the HuggingFace model's: ``logits_to_keep`` = k > 0 keeps the
        logits of the last k positions (a 1-D tensor: those positions)."""
        out = super().forward(*args, **kwargs)
        return _keep_logits(out, logits_to_keep)

    def forward_backward(self, input_args=(), input_kwargs=None, label=None, loss_fn=None,
                         return_outputs=False, run_config=None):
        if (loss_fn is None and not return_outputs and self._logits_by_default
                and "return_logits" not in (input_kwargs or {})):
            # Nobody sees the logits: the loss in chunks, without them.
            input_kwargs = dict(input_kwargs or {}, return_logits=False)
        result = super().forward_backward(input_args, input_kwargs, label, loss_fn, return_outputs,
                                          run_config)
        shares = loss_fn is None and (input_kwargs or {}).get("num_items_in_batch") is None
        if isinstance(result, tuple) and shares:
            # The merged outputs average the microbatch shares: give them
            # the batch's loss, the shares' sum.
            loss, out = result
            if getattr(out, "loss", None) is not None:
                out.loss = loss.to(out.loss.device)
        return result

    # Note [Microbatch losses]
    # As in transformers and the original, a microbatch's loss is its own
    # mean over its labelled tokens unless num_items_in_batch is given (then
    # its sum divided by that), so a script written for the original
    # (loss_fn=lambda o, _: o.loss / num_microbatch) trains the same here.
    # Given, the count is the caller's for the whole batch: forward()
    # averages the microbatch losses, so each gets count / num_microbatch
    # and the average is the batch's sum / count, as transformers computes
    # it on the whole batch; forward_backward sums them, so each gets the
    # count. The default loss_fn of forward_backward (ours; the original's
    # returns the output, which a preset cannot backpropagate) counts the
    # whole batch's labelled tokens itself: the losses are shares that add
    # up to the batch's token-weighted mean, the same for any
    # num_microbatch. Our training tools pass their count explicitly.
    def _call_extras(self, args, kwargs, view, fused):
        """num_items_in_batch for every microbatch (Note [Microbatch
        losses])."""
        labels = kwargs.get("labels")
        if not isinstance(labels, torch.Tensor):
            return {}
        labels = _loss_labels(labels, kwargs.get("shift_labels"), kwargs.get("ignore_index", -100))
        items = kwargs.get("num_items_in_batch")
        if items is None:
            if not view.whole_batch_loss:
                return {}  # each microbatch's own mean
            if labels.dim() != 2:
                raise ValueError(f"labels must be [batch, sequence], got shape {tuple(labels.shape)}")
            items = _C.count_loss_tokens(labels)
            if items == 0:
                return {}  # no labelled token: every microbatch's loss is 0
        items = float(items)
        if not fused and not view.pack_output:  # (a batch of fewer rows: that many microbatches)
            items /= min(view.num_microbatch or default_num_microbatch(len(self.devices)), labels.shape[0])
        return {"num_items_in_batch": items}

    @staticmethod
    def _engine_input(args, kwargs):
        kwargs = dict(kwargs)
        names = ("input_ids", "attention_mask")
        for name, value in zip(names, args):
            if name in kwargs:
                raise TypeError(f"got multiple values for {name}")
            kwargs[name] = value
        if len(args) > len(names):
            raise TypeError("pass arguments after attention_mask by keyword (labels=..., return_logits=...)")
        input_ids = kwargs.pop("input_ids", None)
        inputs_embeds = kwargs.pop("inputs_embeds", None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids (a [batch, sequence] tensor of token ids) and "
                             "inputs_embeds, as transformers' models take them")
        for name, value in (("input_ids", input_ids), ("inputs_embeds", inputs_embeds)):
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
        attention_mask = kwargs.pop("attention_mask", None)
        labels = kwargs.pop("labels", None)
        position_ids = kwargs.pop("position_ids", None)
        return_logits = kwargs.pop("return_logits", None)
        items = kwargs.pop("num_items_in_batch", None)
        if kwargs.pop("use_cache", None) or kwargs.pop("past_key_values", None) is not None:
            warnings.warn("the preset keeps no KV cache: use_cache and past_key_values are ignored",
                          UserWarning, stacklevel=3)
        labels = _loss_labels(labels, kwargs.pop("shift_labels", None), kwargs.pop("ignore_index", -100))
        kwargs.pop("cache_position", None)  # positions come from position_ids (default: 0..T-1)
        kwargs.pop("return_dict", None)  # the output is always a CausalLMOutputWithPast
        unknown = [k for k, v in kwargs.items() if not (v is None or v is False or (type(v) is int and v == 0))]
        if unknown:
            raise TypeError(f"the causal LM preset does not take {unknown}; it takes input_ids or inputs_embeds, "
                            "attention_mask, labels, position_ids, return_logits, num_items_in_batch, "
                            "ignore_index, shift_labels, logits_to_keep (and ignores use_cache, "
                            "past_key_values, cache_position)")
        # An all-ones mask masks nothing: leave it out here, on the CPU, so the
        # devices never look at it (with position_ids it stays: transformers
        # then does not split packed documents, and neither do we).
        if isinstance(attention_mask, torch.Tensor) and position_ids is None and bool(attention_mask.all()):
            attention_mask = None
        value = (input_ids, attention_mask, labels,
                 None if return_logits is None else bool(return_logits),
                 position_ids, None if items is None else float(items))
        return value if inputs_embeds is None else value + (inputs_embeds,)

    @staticmethod
    def _user_microbatch_output(output):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if isinstance(output, tuple):
            return CausalLMOutputWithPast(loss=output[0], logits=output[1])
        if isinstance(output, torch.Tensor) and output.dim() == 0:
            return CausalLMOutputWithPast(loss=output)
        return CausalLMOutputWithPast(logits=output)


def _hf_model_of(model: nn.Module) -> nn.Module:
    """The HuggingFace model inside peft's wrappers (a PeftModel, a
    LoraModel), or the model itself."""
    if type(model).__name__.startswith("PeftModel") and hasattr(model, "base_model"):
        model = model.base_model
    if type(model).__name__ == "LoraModel" and hasattr(model, "model"):
        model = model.model
    return model


def _peft_view(model: nn.Module):
    """(the HuggingFace model, its parameters under the preset's names, the
    LoRA options or None) of a causal LM, plain or with peft's LoRA layers
    (a PeftModel, a LoraModel, or the model inside LoraModel(...).model).
    peft's names map to the preset's: "q_proj.base_layer.weight" ->
    "q_proj.weight", "q_proj.lora_A.<adapter>.weight" ->
    "q_proj.lora_A.weight". What the preset cannot compute is an error."""
    hf = _hf_model_of(model)
    lora_layers = [(n, m) for n, m in hf.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    if any(hasattr(m, "original_module") and hasattr(m, "modules_to_save") for m in hf.modules()):
        raise NotImplementedError("peft's modules_to_save (a trainable copy of a whole module) is not supported "
                                  "by the preset: leave modules_to_save unset")
    if not lora_layers:
        return hf, dict(hf.named_parameters(remove_duplicate=False)), None
    active = {a for _, m in lora_layers for a in m.active_adapters}
    if len(active) != 1:
        raise NotImplementedError(f"the preset runs one active LoRA adapter, the model has {sorted(active)}")
    adapter = active.pop()
    specs, targets, expert_weights = {}, set(), set()  # specs: per projection or expert weight
    for name, m in lora_layers:
        if m.use_dora.get(adapter, False):
            raise NotImplementedError("DoRA (use_dora=True) is not supported by the preset: use plain LoRA")
        drop = m.lora_dropout[adapter]
        r, alpha, scaling = m.r[adapter], m.lora_alpha[adapter], m.scaling[adapter]
        rslora = r > 1 and math.isclose(scaling, alpha / math.sqrt(r))
        if not (rslora or math.isclose(scaling, alpha / r)):
            raise NotImplementedError(f"{name}: LoRA scaling {scaling} is neither alpha / r nor alpha / sqrt(r)")
        spec = (r, float(alpha), float(getattr(drop, "p", 0.0)), rslora)
        if hasattr(m, "parameter_name"):  # peft's ParamWrapper: target_parameters
            expert_weights.add(_strip_base_layers(name).rsplit(".", 1)[-1] + "." + m.parameter_name)
            specs.setdefault(m.parameter_name, set()).add(spec)
        else:
            targets.add(name.rsplit(".", 1)[-1])
            specs.setdefault("projections", set()).add(spec)
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    if not targets <= projections:
        raise NotImplementedError(f"LoRA on {sorted(targets - projections)}: the preset takes it on the decoder "
                                  f"layers' projections {sorted(projections)}")
    experts = {"experts.gate_up_proj", "experts.down_proj"}
    if not expert_weights <= experts:
        raise NotImplementedError(f"LoRA on the parameters {sorted(expert_weights - experts)}: the preset takes "
                                  f"target_parameters on the experts' {sorted(experts)}")
    # One rank and alpha for the projections, and one per expert weight (peft
    # gives the fused gate_up_proj twice the rank and alpha when it maps
    # target_modules gate_proj + up_proj onto it); one dropout and scaling rule.
    if any(len(v) != 1 for v in specs.values()) or len({v[2:] for s in specs.values() for v in s}) != 1:
        raise NotImplementedError("LoRA with different ranks, alphas or dropouts per module (rank_pattern, "
                                  "alpha_pattern) is not supported by the preset, except per expert weight")
    expected = 0  # every decoder layer's targeted projections and expert weights
    for layer in hf.model.layers:
        expected += len(targets & {k.rsplit(".", 1)[-1] for k, _ in layer.named_modules() if k})
        expected += len(expert_weights) if hasattr(layer.mlp, "experts") else 0
    if len(lora_layers) != expected:
        raise NotImplementedError("LoRA on some decoder layers only (layers_to_transform) is not supported by the "
                                  "preset: adapt every layer")
    specs = {k: v.pop() for k, v in specs.items()}
    rank, alpha, dropout, rslora = specs.get("projections") or specs[sorted(specs)[0]]
    expert_rank = {k: v[0] for k, v in specs.items() if k != "projections" and v[0] != rank}
    expert_alpha = {k: v[1] for k, v in specs.items() if k != "projections" and v[1] != alpha}
    parameters = {}
    for n, t in hf.named_parameters(remove_duplicate=False):
        if ".lora_" in n:
            # (Nested expert adapters keep peft's "base_layer" in their names.)
            n = n.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")
        else:
            n = _strip_base_layers(n)
        parameters[n] = t
    dtype = lora_layers[0][1].lora_A[adapter].weight.dtype
    return hf, parameters, dict(rank=rank, alpha=alpha, dropout=dropout, use_rslora=rslora,
                                targets=sorted(targets), target_parameters=sorted(expert_weights),
                                expert_rank=expert_rank, expert_alpha=expert_alpha, dtype=dtype)


def _loss_labels(labels, shift_labels, ignore_index):
    """transformers' loss keywords as the preset's labels (which it shifts
    left by one, -100 ignored): `ignore_index` values become -100, and
    `shift_labels` (already shifted: position t's target) moves one right.
    Since the preset never gives the last position a target, shift_labels
    must leave it ignored."""
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if shift_labels is not None and labels is not None:
        if not isinstance(shift_labels, torch.Tensor) or shift_labels.dim() != 2:
            raise TypeError("shift_labels must be a [batch, sequence] tensor of token ids")
        if bool((shift_labels[:, -1] != ignore_index).any()):
            raise ValueError("shift_labels gives the last position a target, which the preset's loss "
                             "never has (it predicts position t + 1 from t within the sequence): set "
                             f"shift_labels[:, -1] = {ignore_index}, or pass unshifted labels")
        labels = torch.cat([torch.full_like(shift_labels[:, :1], ignore_index), shift_labels[:, :-1]], 1)
    if labels is not None and ignore_index != -100:
        labels = labels.masked_fill(labels == ignore_index, -100)
    return labels


def _keep_logits(out, logits_to_keep):
    """HuggingFace's logits_to_keep on a merged output: an int k > 0 keeps
    the last k positions, a 1-D tensor the positions it lists."""
    logits = getattr(out, "logits", None)
    if logits is None:
        return out
    if isinstance(logits_to_keep, torch.Tensor):
        out.logits = logits[:, logits_to_keep]
    elif logits_to_keep:
        out.logits = logits[:, -int(logits_to_keep):]
    return out


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: Optional[bool] = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: Optional[int] = None,
    skip_modules=(),
    override_config: Optional[dict] = None,
    model_run_config: Optional[RoundPipeRunConfig] = None,
    name: Optional[str] = None,
    **roundpipe_kwargs,
):
    """Wraps `model` in a RoundPipe.

    - use_sequential_preset: True requires a preset (HuggingFace
      Qwen3ForCausalLM, LlamaForCausalLM), None uses one when it exists and
      otherwise wraps automatically, False wraps automatically
    - lower_threshold / upper_threshold (bytes): automatic wrapping runs each
      submodule of at most upper_threshold bytes (default: 1/8 of the model)
      as one RoundPipe layer; parts under lower_threshold stay on the CPU
    - skip_modules: submodules (the modules, their paths or class names)
      never wrapped
    - override_config: {module: RoundPipeRunConfig} for that module's
      RoundPipe (the original's); {name: value} sets model.config.name
    - preset options in roundpipe_kwargs: return_logits (None: logits
      with the loss, as the original's True, except in forward_backward
      calls that cannot show them; False: never with labels),
      loss_chunk_tokens (2048), grouped_experts (True: a mixture of experts
      as grouped matrix products, False: one per expert),
      expert_chunk_tokens (4096: a microbatch of more tokens runs its
      experts chunk by chunk, recomputing a chunk's activations in
      backward; 0: never); the rest go to RoundPipe()
    - a preset model that transformers loaded with bitsandbytes
      (BitsAndBytesConfig load_in_4bit or load_in_8bit, device_map="cpu"),
      peft on top or not, keeps its quantized projections as they are: the
      preset dequantizes them on the device (README, QLoRA)
    Returns a RoundPipe (CausalLMRoundPipe for presets), or an AutoRoundPipe
    when the model cannot become one Sequential.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model_to_roundpipe takes a torch.nn.Module, got {type(model).__name__}")
    # The original's override_config maps a module to its RoundPipeRunConfig;
    # a name maps to a model.config attribute set before wrapping (ours).
    configs = {}
    for key, value in (override_config or {}).items():
        if isinstance(key, nn.Module):
            if not isinstance(value, RoundPipeRunConfig):
                raise TypeError("override_config maps a module to a RoundPipeRunConfig, got "
                                f"{type(value).__name__} for {type(key).__name__}")
            configs[id(key)] = value
        else:
            setattr(model.config, key, value)
    preset = PRESETS.get(type(_hf_model_of(model)).__name__)
    if use_sequential_preset is True and preset is None:
        raise NotImplementedError(
            f"no preset for {type(model).__name__}; presets exist for {sorted(PRESETS)}. Pass "
            "use_sequential_preset=None to fall back to automatic wrapping, or build an nn.Sequential "
            "and wrap it with RoundPipe()")
    common = dict(model_run_config=model_run_config, name=name)
    if preset is not None and use_sequential_preset is not False:
        pipe = CausalLMRoundPipe(model, **common, **roundpipe_kwargs)
        if use_sequential_preset is None:  # as the original says it, on stderr
            print(f'[INFO] Replace model "{pipe.name}" of type {type(model).__name__} with a sequential '
                  "preset from roundpipe.models\n[INFO] If this is not expected, call "
                  "wrap_model_to_roundpipe with use_sequential_preset=False", file=sys.stderr)
        return pipe
    for key in ("return_logits", "loss_chunk_tokens", "grouped_experts", "expert_chunk_tokens"):
        if key in roundpipe_kwargs:
            raise TypeError(f"{key} applies to presets only")
    if isinstance(model, nn.Sequential):
        if id(model) in configs:
            common["model_run_config"] = configs[id(model)]
        return RoundPipe(model, **common, **roundpipe_kwargs)
    # Data parallel (roundpipe.distributed): one average over every master,
    # the parts' and the glue's, in AutoRoundPipe.step; the parts' own
    # RoundPipes take no group.
    group = distributed.resolve_group(roundpipe_kwargs.get("process_group"))
    if group is not None:
        if roundpipe_kwargs.get("shard_optimizer_state"):
            raise NotImplementedError(
                f"shard_optimizer_state is not supported by automatic wrapping, and {type(model).__name__} has "
                "no preset: wrap an nn.Sequential of its layers with RoundPipe(), or leave the state replicated")
        distributed.check_same_weights(model.named_parameters(), group, type(model).__name__)
    roundpipe_kwargs["process_group"] = False
    upper = upper_threshold if upper_threshold is not None else max(_param_bytes(model) // 8, lower_threshold)
    pipes = []
    _auto_wrap(model, lower_threshold, upper, list(skip_modules or ()), pipes,
               dict(model_run_config=model_run_config, **roundpipe_kwargs), configs)
    return AutoRoundPipe(model, pipes, roundpipe_kwargs.get("optim_dtype"), group,
                         roundpipe_kwargs.get("reduce_dtype"))
