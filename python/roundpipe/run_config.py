"""Run settings (per call > per model > default) and execute plans."""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import torch


def default_num_microbatch(num_devices: int) -> int:
    """The microbatch count of a call that gives none: devices + 1, as the
    original (the engine's own default, include/roundpipe/run_config.h)."""
    from . import _C

    return _C.default_num_microbatch(num_devices)


@dataclasses.dataclass
class RoundPipeRunConfig:
    """Every field left None takes the model-level value (the RoundPipe's
    ``model_run_config``), then the default.

    - requires_grad: connect outputs to autograd (default: torch grad mode)
    - output_device: where merged outputs go (default: CPU)
    - preserve_rng_state: replay dropout exactly in recompute (default: True)
    - recompute_grain: "stage" or "layer" (less device memory), or
      "layer_from_stage" (about the device memory of "layer", the host
      memory of "stage": only each backward stage's input is kept on the
      host, at one extra forward of its other layers); None: the automatic plan chooses
      (layer until activations are measured, then stage where it fits)
    - num_microbatch: microbatches per call (default: number of devices + 1)
    - split_input: f(args, kwargs, n) -> list of n (args, kwargs) pairs (or
      the original's (args_list, kwargs_list)), or the original's
      (args_spec, kwargs_spec) of TensorChunkSpec / _Replicate trees
    - split_label: f(label, n) -> list of n labels, or a spec tree
    - merge_output: f(list of microbatch outputs) -> output, a spec tree
      (TensorChunkSpec, _Replicate, _CustomReducer), True (automatic), or
      False to return a PackedMicrobatches that a next RoundPipe takes as
      its input without splitting again
    - execute_plan: a ModelExecutePlan (default: the engine's plan)
    """

    requires_grad: Optional[bool] = None
    output_device: Optional[Union[str, torch.device]] = None
    preserve_rng_state: Optional[bool] = None
    recompute_grain: Optional[str] = None
    num_microbatch: Optional[int] = None
    split_input: Optional[Callable[..., Sequence[Any]]] = None
    split_label: Optional[Callable[[Any, int], Sequence[Any]]] = None
    merge_output: Optional[Union[Callable[[list], Any], bool]] = None
    execute_plan: Optional["ModelExecutePlan"] = None

    def __post_init__(self):
        if self.recompute_grain not in (None, "stage", "layer", "layer_from_stage"):
            raise ValueError(
                f"recompute_grain must be 'stage', 'layer' or 'layer_from_stage', got {self.recompute_grain!r}"
            )
        if self.num_microbatch is not None and (not isinstance(self.num_microbatch, int) or self.num_microbatch < 1):
            raise ValueError(f"num_microbatch must be a positive int, got {self.num_microbatch!r}")
        from ._specs import is_spec_tree

        # Functions, or the original's specs (TensorChunkSpec, _Replicate,
        # _CustomReducer from torch.distributed.pipelining.microbatch, in
        # trees shaped like the values).
        if self.split_input is not None and not callable(self.split_input) and not (
                isinstance(self.split_input, (tuple, list)) and len(self.split_input) == 2
                and all(is_spec_tree(s) for s in self.split_input)):
            raise TypeError("split_input must be a function f(args, kwargs, n) or an (args_spec, kwargs_spec) "
                            f"pair of specs, got {type(self.split_input).__name__}")
        if self.split_label is not None and not callable(self.split_label) and not is_spec_tree(self.split_label):
            raise TypeError("split_label must be a function f(label, n) or a spec tree, got "
                            f"{type(self.split_label).__name__}")
        # True is the original's "automatic" too; unlike None it beats a
        # model-level False.
        if (self.merge_output not in (None, True, False) and not callable(self.merge_output)
                and not is_spec_tree(self.merge_output)):
            raise TypeError("merge_output must be a function of the list of microbatch outputs, a spec "
                            "tree, True (automatic, as None) or False")
        if self.execute_plan is not None and not isinstance(self.execute_plan, ModelExecutePlan):
            raise TypeError("execute_plan must be a ModelExecutePlan")
        if self.execute_plan is not None:  # as the original: later edits of the plan do not leak in
            self.execute_plan = copy.deepcopy(self.execute_plan)


def _as_range(r) -> tuple:
    if isinstance(r, range):
        if r.step != 1 or len(r) == 0:
            raise ValueError(f"plan ranges must be non-empty with step 1, got {r}")
        return (r.start, r.stop)
    begin, end = r
    return (int(begin), int(end))


class ModelExecutePlan:
    """Which layers each stage runs: ``fwd_plan`` lists ascending layer
    ranges covering the model (or the layers before the fused tail stage in
    forward_backward), ``bwd_plan`` lists ranges deep to shallow, and in
    forward_backward ``bwd_plan[0]`` is the fused tail stage. Ranges are
    ``range(begin, end)`` or ``(begin, end)`` pairs (end exclusive).
    ``tail_replicas`` > 1 (forward_backward, with the fused tail stage the
    whole model): that stage runs on this many devices at once, each taking
    every k-th microbatch."""

    def __init__(self, fwd_plan: Sequence = (), bwd_plan: Sequence = (), tail_replicas: int = 1):
        self.fwd_plan = [range(*_as_range(r)) for r in fwd_plan]
        self.bwd_plan = [range(*_as_range(r)) for r in bwd_plan]
        self.tail_replicas = int(tail_replicas)

    def _forward_ranges(self):
        return [(r.start, r.stop) for r in self.fwd_plan]

    def _backward_ranges(self):
        return [(r.start, r.stop) for r in self.bwd_plan]

    def validate(self, num_layers: int, fused: bool) -> None:
        """Raises naming what is wrong unless the plan fits the model."""
        from . import _C

        _C.Engine.validate_plan(self, num_layers, fused)

    def check_valid(self, num_layers: int, run_type: str) -> None:
        """The original's check: ValueError naming what is wrong unless the
        plan fits a model of `num_layers` for `run_type` ("infer": the
        forward ranges alone; "train"; "fused")."""
        if run_type not in ("infer", "train", "fused"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        try:
            if run_type == "infer":
                ModelExecutePlan(self.fwd_plan, [range(0, num_layers)]).validate(num_layers, False)
            else:
                self.validate(num_layers, run_type == "fused")
        except (RuntimeError, ValueError) as e:
            raise ValueError(str(e).splitlines()[0]) from e

    @staticmethod
    def auto(run_type: str, *models, min_stages: Optional[int] = None, upper_threshold: float = 1.1,
             model_memory_limit: Optional[float] = None, num_microbatch: Optional[int] = None,
             verbose: bool = False):
        """The automatic plan of each model for `run_type`: "fused" for
        forward_backward, "train" (or "forward") for forward with backward,
        "infer" for forward alone (its fwd_plan). Stages balanced on
        per-layer costs (measured times once known, parameter bytes until
        then), under model_memory_limit (GiB; default: the model's, else
        what the smallest device has left). One model gives a plan, several
        a list (each planned alone), none []. Raises naming the smallest
        feasible limit when none fits; verbose prints the stages with their
        predicted times and memory. With several models and "fused", all
        but the last get a "train" plan (they run forward() with grad, the
        last forward_backward), as in the original. upper_threshold is the original's cap on
        stage workloads: our planner scores every candidate workload by
        simulating the schedule instead, so it has no effect."""
        if run_type not in ("fused", "train", "forward", "infer"):
            raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")
        plans = []
        for i, model in enumerate(models):
            n = (num_microbatch or model.model_run_config.num_microbatch
                 or default_num_microbatch(len(model.devices)))
            # As the original: in a chain for "fused", every model but the
            # last runs forward() with grad (its backward through autograd),
            # so it gets a training plan with a full forward plan.
            fused = run_type == "fused" and i == len(models) - 1
            (fwd, bwd, replicas), text = model._engine.auto_plan(
                fused, n, 0 if min_stages is None else int(min_stages), model_memory_limit)
            if verbose:
                print(text)
            plans.append(ModelExecutePlan(fwd, [] if run_type == "infer" else bwd, replicas))
        return plans[0] if len(plans) == 1 else plans

    def __repr__(self):
        replicas = f", tail_replicas={self.tail_replicas}" if self.tail_replicas != 1 else ""
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan}, bwd_plan={self.bwd_plan}{replicas})"

    def __eq__(self, other):
        return (isinstance(other, ModelExecutePlan) and self.fwd_plan == other.fwd_plan
                and self.bwd_plan == other.bwd_plan and self.tail_replicas == other.tail_replicas)
