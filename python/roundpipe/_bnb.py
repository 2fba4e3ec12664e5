"""A model that transformers loaded with bitsandbytes (BitsAndBytesConfig
load_in_4bit or load_in_8bit) as the presets' quantized base (Note [Quantized
base weights in the presets]): each quantized projection's tensors become the
preset's parameters as they are, no copy and no requantization, so the preset
computes on bitsandbytes' values bit for bit."""
from __future__ import annotations

import warnings

import torch

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _strip_base_layers(name):
    """peft's wrapped name without its wrappers: "experts.base_layer.base_layer.down_proj" -> "experts.down_proj"."""
    while ".base_layer." in name or name.endswith(".base_layer"):
        name = name.replace(".base_layer.", ".")
        if name.endswith(".base_layer"):
            name = name[:-len(".base_layer")]
    return name


def _four_bit(name, module):
    """(the format, the preset's tensors) of a bitsandbytes Linear4bit."""
    weight = module.weight
    state = weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes repacks for its CPU inference kernel; undo it as its
        # own state_dict does.
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse
        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
        state = weight.quant_state
    if state.blocksize != 64:
        raise NotImplementedError(f"{name}: 4-bit blocks of {state.blocksize} values; the preset takes bitsandbytes' "
                                  "default of 64 (quantize with it, or load the full-precision model)")
    if tuple(state.shape) != (module.out_features, module.in_features):
        raise ValueError(f"{name}: a 4-bit weight of shape {tuple(state.shape)} in a "
                         f"{module.in_features} -> {module.out_features} projection")
    # The parameter itself where it can be (pin_model="alloc" then moves
    # bitsandbytes' own tensors into pinned memory rather than copying them).
    tensors = {"weight": weight if weight.dtype == torch.uint8 else weight.data.view(torch.uint8).reshape(-1, 1)}
    if state.nested:
        if state.state2.blocksize != 256:
            raise NotImplementedError(f"{name}: double-quantized scales in blocks of {state.state2.blocksize}; "
                                      "the preset takes bitsandbytes' 256")
        tensors.update(weight_absmax=state.absmax, weight_nested_absmax=state.state2.absmax,
                       weight_nested_code=state.state2.code,
                       weight_nested_offset=torch.as_tensor(state.offset, dtype=torch.float32).reshape(1))
    else:
        tensors.update(weight_absmax=state.absmax)
    compute = getattr(module, "compute_dtype", None)
    return (state.quant_type, bool(state.nested), compute), tensors


def _eight_bit(name, module):
    """(the format, the preset's tensors) of a bitsandbytes Linear8bitLt."""
    weight = module.weight
    scale = getattr(weight, "SCB", None)
    if scale is None and getattr(module, "state", None) is not None:
        scale = module.state.SCB
    if weight.dtype != torch.int8 or scale is None:
        raise ValueError(f"{name}: its 8-bit weight is not quantized (bitsandbytes quantizes it when the model "
                         "moves to a device, and never with llm_int8_has_fp16_weight=True): load with device_map, "
                         "e.g. device_map='cpu', and without llm_int8_has_fp16_weight")
    return ("int8", False, None), {"weight": weight, "weight_scale": scale}


def quantized_base(hf, parameters):
    """(the preset's quantize_base options for `hf`, or None if bitsandbytes
    quantized none of it; the names of the quantized tensors): `parameters`
    (the preset's names -> tensors) gets the quantized projections' tensors
    in place of bitsandbytes' weights. What the preset cannot take is an
    error naming the fix."""
    found = {}
    for name, module in hf.named_modules():
        if hasattr(module, "base_layer"):
            continue  # peft's wrapper: its base_layer is the bitsandbytes module
        kind = type(getattr(module, "weight", None)).__name__
        if kind == "Params4bit":
            found[_strip_base_layers(name)] = _four_bit(name, module)
        elif kind == "Int8Params":
            found[_strip_base_layers(name)] = _eight_bit(name, module)
    if not found:
        return None, set()
    formats = {f[:2] for f, _ in found.values()}
    if len(formats) != 1:
        raise NotImplementedError(f"the preset takes one quantization for all projections, found {sorted(formats)}")
    expected = set()  # every decoder layer's dense projections
    for i, layer in enumerate(hf.model.layers):
        for n, _ in layer.named_modules():
            n = _strip_base_layers(n)
            if n.rsplit(".", 1)[-1] in _PROJECTIONS and "experts" not in n:
                expected.add(f"model.layers.{i}.{n}")
    if set(found) != expected:
        extra, missing = sorted(set(found) - expected), sorted(expected - set(found))
        raise NotImplementedError(
            "the preset quantizes the decoder layers' projections (q/k/v/o, gate/up/down), all of them: "
            + (f"bitsandbytes also quantized {extra[:4]}; " if extra else "")
            + (f"it left {missing[:4]} in full precision; " if missing else "")
            + "load with the default llm_int8_skip_modules")
    (quant_type, nested), = formats
    compute = {f[2] for f, _ in found.values()} - {None}
    names = set()
    for name, (_, tensors) in found.items():
        del parameters[name + ".weight"]
        parameters.update({f"{name}.{k}": t for k, t in tensors.items()})
        names.update(f"{name}.{k}" for k in tensors)
    dtypes = {p.dtype for n, p in parameters.items() if ".lora_" not in n and n not in names}
    if compute and compute != dtypes:
        warnings.warn(f"the preset computes in the model's dtype {sorted(map(str, dtypes))}, not in "
                      f"bnb_4bit_compute_dtype {sorted(map(str, compute))}", stacklevel=3)
    return dict(type=quant_type, double_quant=nested, experts=False), names
