"""roundpipe.batch: where the original keeps RoundPipePackedData, the
per-microbatch values of a call with ``merge_output=False``: here
``PackedMicrobatches`` (the original's name refers to it), and how a call's
packed outputs are made and how a next call's arguments are cut by them."""
import torch

from . import _specs


class PackedMicrobatches(list):
    """One value of a call with ``merge_output=False`` per microbatch: a
    list (as the original's RoundPipePackedData); the call returns its
    output's structure with one of these per leaf. Passed to a next
    RoundPipe (anywhere in its arguments), microbatch i takes element i of
    each (no merge, no split)."""

    def __init__(self, outputs: list):
        super().__init__(outputs)

    @property
    def outputs(self) -> list:
        return list(self)

    @property
    def transfer_event(self) -> list:
        """The original's per-microbatch copy events: none here, the outputs
        are on the host when the call returns."""
        return [(None, None) for _ in self]

    def synchronize(self) -> "PackedMicrobatches":
        """Waits for the outputs' copies to the host: they are done when the
        call returns, so this returns at once."""
        return self

    def __repr__(self):
        return f"PackedMicrobatches({len(self)} microbatches)"

    # Glue code between chained RoundPipes that computes with packed outputs
    # (``h = h + block(h)``, ``torch.cat``, ``.shape``) gets them merged as a
    # call without merge_output=False would have returned them.
    def merged(self):
        """The microbatch outputs merged (tensors concatenated on dim 0,
        0-dim tensors averaged), differentiably."""
        return _specs.merge_tree(list(self), None)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def unpack(v):
            if isinstance(v, PackedMicrobatches):
                return v.merged()
            if isinstance(v, (tuple, list)):
                return type(v)(unpack(x) for x in v)
            return v

        return func(*unpack(args), **unpack(kwargs or {}))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.merged(), name)

    def __getitem__(self, index):
        # Microbatch m (an int or slice, as a list); anything else (a
        # tensor's indexing) applies to the merged output.
        if isinstance(index, (int, slice)):
            return list.__getitem__(self, index)
        return self.merged()[index]


def _is_packed(value) -> bool:
    return isinstance(value, PackedMicrobatches)


def _packed_microbatches(args: tuple, kwargs: dict):
    """The microbatches of a call whose arguments hold packed outputs of an
    earlier call (merge_output=False), as (args, kwargs) pairs, or None when
    they hold none. As in the original, each packed value stands for one
    leaf (or a whole output): microbatch i takes its element i. Other
    tensors whose dim 0 is the packed rows in all (a HuggingFace decoder
    layer's attention mask and rotary embeddings, when automatic wrapping
    chains its layers) are cut as those rows are; anything else is the
    same for every microbatch."""
    from torch.utils import _pytree

    leaves = [v for v in _pytree.tree_leaves((args, kwargs), is_leaf=_is_packed) if _is_packed(v)]
    if not leaves:
        return None
    n = len(leaves[0])
    if any(len(v) != n for v in leaves):
        raise ValueError(f"packed inputs of different microbatch counts: {sorted({len(v) for v in leaves})}")

    def rows(i):
        for leaf in _pytree.tree_leaves([v[i] for v in leaves]):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return leaf.shape[0]
        return None

    counts = [rows(i) for i in range(n)]
    total = sum(counts) if all(c is not None for c in counts) else None
    parts, start = [], 0
    for i in range(n):
        def take(v, i=i, s=start):
            if _is_packed(v):
                return v[i]
            if total is not None and isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == total:
                return v[s:s + counts[i]]
            return v
        parts.append(_pytree.tree_map(take, (args, kwargs), is_leaf=_is_packed))
        start += counts[i] or 0
    return parts


def _pack_leaves(microbatches: list):
    """merge_output=False, as the original: the output's structure with one
    PackedMicrobatches per leaf (that leaf of every microbatch); an output
    that is one tensor (or other leaf) is one PackedMicrobatches."""
    from torch.utils import _pytree

    flat = [_pytree.tree_flatten(m) for m in microbatches]
    spec = flat[0][1]
    if spec.is_leaf() or any(f[1] != spec for f in flat):
        return PackedMicrobatches(microbatches)
    return _pytree.tree_unflatten(
        [PackedMicrobatches([f[0][j] for f in flat]) for j in range(len(flat[0][0]))], spec)


def _packed_operator(name):
    def operator(self, *others):
        return getattr(self.merged(), name)(
            *(o.merged() if isinstance(o, PackedMicrobatches) else o for o in others))

    operator.__name__ = name
    return operator


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
              "__rtruediv__", "__matmul__", "__rmatmul__", "__pow__", "__neg__"):
    setattr(PackedMicrobatches, _name, _packed_operator(_name))


RoundPipePackedData = PackedMicrobatches

__all__ = ["PackedMicrobatches", "RoundPipePackedData"]
