"""How a Trainer lays parameters, optimizer state and batches out on a slice.

Every strategy here is a choice of partition specs; XLA's SPMD partitioner inserts the
collectives (the gradient all-reduce of data parallelism, the gathers of FSDP, the
reductions of tensor parallelism) inside the one compiled step program.

Example::

    pw.Trainer(model, opt, loss_fn, slice=s, parallelism=pw.DataParallel("data"))
    pw.Trainer(model, opt, loss_fn, slice=s,
               parallelism=pw.TensorParallel({"0.weight": P("model", None)}, batch_axis="data"))
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Dict, Optional, Sequence

from ..errors import PathwaysError
from ..sharding import P


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Batch split over ``axis`` (dimension 0); parameters and optimizer state replicated."""

    axis: str = "data"

    def param_spec(self, name: str, shape: Sequence[int], mesh: Dict[str, int]) -> P:
        return P()

    @property
    def batch_axis(self) -> str:
        """The mesh axis that dimension 0 of every batch tensor is split over."""
        return self.axis


@dataclasses.dataclass(frozen=True)
class FullyShardedDataParallel(DataParallel):
    """As DataParallel, and every parameter (and its optimizer state) is split over
    ``axis`` along its first dimension that the axis divides; the others stay whole."""

    def param_spec(self, name: str, shape: Sequence[int], mesh: Dict[str, int]) -> P:
        n = mesh[self.axis]
        for d, size in enumerate(shape):
            if size % n == 0 and size >= n:
                return P(*([None] * d + [self.axis]))
        return P()


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """Explicit per-parameter specs (others replicated); batch split over ``batch_axis``."""

    param_specs: Dict[str, P] = dataclasses.field(default_factory=dict)
    batch_axis: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.param_specs, dict) or not all(
                isinstance(n, str) and isinstance(v, P) for n, v in self.param_specs.items()):
            raise PathwaysError(
                f"TensorParallel takes param_specs, a dict of parameter name -> P(...) "
                f"(for example {{'0.weight': P('model', None)}}), and batch_axis=, not "
                f"{self.param_specs!r}; to split only the batch over an axis, use "
                "DataParallel(axis)")

    def param_spec(self, name: str, shape: Sequence[int], mesh: Dict[str, int]) -> P:
        return self.param_specs.get(name, P())

    def check_names(self, names: Sequence[str]) -> None:
        """Refuse specs for names the model does not have (a typo would silently leave
        that parameter replicated)."""
        import difflib
        unknown = [n for n in self.param_specs if n not in set(names)]
        if unknown:
            hints = {n: difflib.get_close_matches(n, names, n=1) for n in unknown}
            said = ", ".join(f"{n!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                             for n, h in hints.items())
            raise PathwaysError(
                f"TensorParallel has specs for {said}, which the model has no parameter "
                "or buffer of: name them as model.named_parameters() does")


def mesh_sizes(slice_) -> Dict[str, int]:
    return dict(zip(slice_.axis_names, slice_.mesh_shape))


def shard_count(spec: P, mesh: Dict[str, int]) -> int:
    return math.prod(mesh[a] for d in range(len(spec)) for a in spec.axes(d))


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """GPipe over several slices: stage i's forward and backward run on ``slices[i]``.

    ``stages``: the number of stages to split an ``nn.Sequential`` into (contiguous,
    balanced by layer count), or a list of index ranges ``[(0, 3), (3, 6)]``.
    ``microbatches``: the batch is split into this many; activations and gradients
    move between slices through the dataflow graph; one optimizer step per batch.
    ``axis``: a mesh axis of the stages' slices over which each micro-batch is split
    (data parallel inside every stage: pipeline x data parallelism); without it a
    stage's devices all compute the whole micro-batch.
    ``per_program``: how many micro-batches one stage program computes, one after the
    other (default 1). Each is still its own micro-batch (normalised by itself, its
    gradient added in order), so the numbers are those of ``microbatches``; what changes
    is the cost. A step makes ``microbatches / per_program`` forwards and backwards per
    stage instead of ``microbatches``, and moves the group's activations in one
    transfer: worth it when a micro-batch's program takes little longer than the
    runtime's cost per program (a few hundred µs here). The stages then overlap
    ``microbatches / per_program`` groups, so the pipeline's bubble grows as it would
    with fewer micro-batches.

    Example::

        stages = [pw.slice((2,), axis_names=("data",)) for _ in range(4)]
        pw.Trainer(model, opt, loss_fn, parallelism=pw.Pipeline(4, 8, stages, axis="data"))
        pw.Pipeline(4, 8, stages, per_program=4)    # 2 programs of 4 micro-batches
    """

    stages: object
    microbatches: int
    slices: tuple
    axis: Optional[str] = None
    per_program: int = 1

    def __post_init__(self):
        object.__setattr__(self, "slices", tuple(self.slices))
        k, m = self.per_program, self.microbatches
        try:
            ok = operator.index(k) >= 1 and operator.index(m) % operator.index(k) == 0
        except TypeError:
            ok = False
        if not ok or isinstance(k, bool):
            raise PathwaysError(
                f"Pipeline(microbatches={m!r}, per_program={k!r}): per_program must be a "
                "positive integer that divides microbatches (1, the default, runs each "
                "micro-batch as its own programs)")
        if self.axis is not None:
            missing = [i for i, s in enumerate(self.slices) if self.axis not in s.axis_names]
            if missing:
                raise PathwaysError(
                    f"Pipeline(axis={self.axis!r}): the slice of stage {missing[0]} has "
                    f"axes {tuple(self.slices[missing[0]].axis_names)}; give every stage "
                    f"a slice with a {self.axis!r} axis (pw.slice(shape, "
                    f"axis_names=({self.axis!r},)))")


@dataclasses.dataclass(frozen=True)
class MultiIsland:
    """Data parallel across islands: each slice (one per island) holds a replica and
    trains on its share of the batch (SPMD over ``axis`` inside the island); gradients
    are exchanged between islands over DCN transfers and every replica applies the
    same update."""

    slices: tuple
    axis: str = "data"

    def __post_init__(self):
        object.__setattr__(self, "slices", tuple(self.slices))
