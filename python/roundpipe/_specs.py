"""The original's split and merge specs (torch.distributed.pipelining's
TensorChunkSpec, _Replicate, _CustomReducer, in trees shaped like the values)
and its split_input function format, turned into the functions our run
config takes."""
from __future__ import annotations

import functools

import torch


def _is_chunk(spec) -> bool:
    return type(spec).__name__ == "TensorChunkSpec" and hasattr(spec, "split_dim")


def _is_replicate(spec) -> bool:
    return (isinstance(spec, type) and spec.__name__ == "_Replicate") or type(spec).__name__ == "_Replicate"


def _is_reducer(spec) -> bool:
    return type(spec).__name__ == "_CustomReducer" and hasattr(spec, "reduce_fn")


def is_spec_leaf(spec) -> bool:
    return spec is None or _is_chunk(spec) or _is_replicate(spec) or _is_reducer(spec)


def is_spec_tree(spec) -> bool:
    """A spec, or a tuple/list/dict of them (not a function)."""
    if is_spec_leaf(spec):
        return True
    if isinstance(spec, (tuple, list)):
        return all(is_spec_tree(s) for s in spec)
    if isinstance(spec, dict):
        return all(is_spec_tree(s) for s in spec.values())
    return False


def _split_leaf(value, spec, n: int) -> list:
    if _is_replicate(spec) or not isinstance(value, torch.Tensor):
        return [value] * n
    if _is_chunk(spec):
        dim = spec.split_dim
    elif spec is None:  # automatic: tensors with dims along dim 0, scalars replicated
        if value.dim() == 0:
            return [value] * n
        dim = 0
    else:
        raise TypeError(f"{spec!r} cannot split an input (TensorChunkSpec(dim) or _Replicate)")
    if value.size(dim) < n:
        raise ValueError(f"cannot split a dimension of size {value.size(dim)} (dim {dim}) into {n} "
                         "microbatches: lower num_microbatch or pass a larger batch")
    return list(torch.tensor_split(value, n, dim))


def split_tree(value, spec, n: int) -> list:
    """The n microbatches of `value` by `spec` (one spec for a whole subtree,
    or a tree shaped like the value)."""
    if isinstance(spec, (tuple, list)) and not is_spec_leaf(spec):
        if not isinstance(value, (tuple, list)) or len(value) != len(spec):
            raise ValueError(f"a split spec of {len(spec)} entries does not match {type(value).__name__}")
        parts = [split_tree(v, s, n) for v, s in zip(value, spec)]
        return [type(value)(p[m] for p in parts) for m in range(n)]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise ValueError(f"a dict split spec does not match {type(value).__name__}")
        parts = {k: split_tree(v, spec.get(k), n) for k, v in value.items()}
        return [{k: p[m] for k, p in parts.items()} for m in range(n)]
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        parts = [split_tree(v, spec, n) for v in value]
        return [type(value)(p[m] for p in parts) for m in range(n)]
    if isinstance(value, dict):
        parts = {k: split_tree(v, spec, n) for k, v in value.items()}
        return [{k: p[m] for k, p in parts.items()} for m in range(n)]
    return _split_leaf(value, spec, n)


def _merge_leaf(values: list, spec):
    first = values[0]
    if _is_reducer(spec):
        return functools.reduce(spec.reduce_fn, values, spec.init_value)
    if _is_replicate(spec):
        return first
    if isinstance(first, torch.Tensor):
        if _is_chunk(spec):
            return torch.cat(values, spec.split_dim)
        if spec is None:  # automatic: concatenate along dim 0, average scalars
            return torch.stack(values).mean(0) if first.dim() == 0 else torch.cat(values, 0)
    if spec is None or _is_chunk(spec):
        if any(v != first for v in values[1:]):
            raise ValueError(f"microbatch outputs {values!r} differ and cannot be merged: give "
                             "merge_output a _CustomReducer or a function for them")
        return first
    raise TypeError(f"{spec!r} cannot merge outputs")


def merge_tree(values: list, spec):
    """The microbatch outputs `values` merged by `spec`."""
    first = values[0]
    if isinstance(spec, (tuple, list)) and not is_spec_leaf(spec):
        if not isinstance(first, (tuple, list)) or len(first) != len(spec):
            raise ValueError(f"a merge spec of {len(spec)} entries does not match an output of type "
                             f"{type(first).__name__}: give one spec for a tensor output")
        merged = [merge_tree([v[i] for v in values], s) for i, s in enumerate(spec)]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if isinstance(spec, dict):
        merged = {k: merge_tree([v[k] for v in values], spec.get(k)) for k in first}
        return merged if type(first) is dict else type(first)(**merged)
    if isinstance(first, (tuple, list)) and not isinstance(first, torch.Size):
        merged = [merge_tree([v[i] for v in values], spec) for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if isinstance(first, dict):
        return type(first)({k: merge_tree([v[k] for v in values], spec) for k in first})
    return _merge_leaf(values, spec)


def split_input_function(spec):
    """Our split_input (f(args, kwargs, n) -> n (args, kwargs) pairs) from
    the original's: an (args_spec, kwargs_spec) pair of spec trees, or a
    function returning (args_list, kwargs_list)."""
    if callable(spec) and not is_spec_tree(spec):
        def split(args, kwargs, n, f=spec):
            result = f(args, kwargs, n)
            if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (list, tuple))
                    and isinstance(result[1], (list, tuple)) and len(result[0]) == n and len(result[1]) == n
                    and all(isinstance(k, dict) for k in result[1])):
                return list(zip(result[0], result[1]))  # the original's (args_list, kwargs_list)
            return result
        return split
    if not (isinstance(spec, (tuple, list)) and len(spec) == 2):
        raise TypeError("split_input must be a function f(args, kwargs, n), or an (args_spec, kwargs_spec) "
                        "pair of TensorChunkSpec/_Replicate trees (None: automatic)")
    args_spec, kwargs_spec = spec

    def split(args, kwargs, n):
        arg_parts = split_tree(tuple(args), tuple(args_spec) if args_spec is not None else None, n)
        kwarg_parts = split_tree(dict(kwargs), dict(kwargs_spec) if kwargs_spec is not None else None, n)
        return list(zip(arg_parts, kwarg_parts))
    return split


def split_label_function(spec):
    if callable(spec) and not is_spec_tree(spec):
        return spec
    return lambda label, n: split_tree(label, spec, n)


def merge_output_function(spec):
    if callable(spec) and not is_spec_tree(spec):
        return spec
    return lambda outputs: merge_tree(list(outputs), spec)
