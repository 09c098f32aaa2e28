"""Batches: split into equal parts (microbatches, islands) and placed on a slice."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch.utils import _pytree as pytree

from ..client.array import Array, put
from ..errors import PlacementError, ShapeError, ShardingError
from ..sharding import P, validate_spec


def _axis_size(slice_, axis) -> int:
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    size = 1
    for name in names:
        if name in slice_.axis_names:
            size *= slice_.mesh_shape[slice_.axis_names.index(name)]
    return size


def _place_batch(value, slice_, axis: Optional[str]):
    """Every tensor of a batch pytree on ``slice_``, split along dimension 0 over the mesh
    axis ``axis`` (None: replicated); Arrays are taken as they are, and leaves that are
    not tensors (strings, numbers, None) stay Python values (static in the program).
    A batch the axis does not divide (a DataLoader's last, partial batch) is placed
    replicated: every device computes all of it, and the step has torch's numbers."""
    from torch.nn.utils.rnn import PackedSequence
    packed = [leaf for leaf in pytree.tree_leaves(
        value, is_leaf=lambda v: isinstance(v, PackedSequence))
        if isinstance(leaf, PackedSequence)]
    if packed:
        raise ShapeError(
            "a PackedSequence batch cannot be placed on the devices: its length is the "
            "sum of the sequence lengths (a new shape each batch), and the RNN reads its "
            "batch_sizes on the CPU. Pass the padded batch and the lengths instead, "
            "give the RNN the padded batch, and take each sequence's last output with "
            "out.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, 1, out.shape[2])) "
            "(or mask the padding): the same hidden state for a unidirectional RNN")

    def place(t):
        if isinstance(t, Array) or not isinstance(t, (torch.Tensor, np.ndarray)):
            return t            # an Array as it is; strings, numbers, None are static
        t = torch.as_tensor(t)
        spec = P(axis) if (axis and t.dim()) else P()
        if axis and t.dim() and t.shape[0] % _axis_size(slice_, axis):
            spec = P()
        try:
            validate_spec(spec, t.shape, slice_.axis_names, slice_.mesh_shape, "batch")
        except ShardingError as e:
            raise ShardingError(f"{e}; use a batch size that the data axis divides") \
                from None
        return put(t, slice_, spec)
    return pytree.tree_map(place, value)


def _moved(tree, slice_):
    """Every Array of ``tree`` on ``slice_`` (those already there as they are)."""
    return pytree.tree_map(lambda a: a if not isinstance(a, Array) or a.slice is slice_
                           else a.to(slice_), tree)


def split_pair(inputs, targets, n: int, what: str) -> tuple:
    """``_split`` of a batch's inputs and targets, after checking that every tensor in
    them has as many rows: a micro-batch (an island's share) takes the same rows of
    each, which pairs samples only if dimension 0 is the batch in all of them."""
    rows = {}
    for name, value in (("inputs", inputs), ("targets", targets)):
        for i, t in enumerate(pytree.tree_leaves(value)):
            if isinstance(t, (torch.Tensor, np.ndarray)) and t.ndim:
                rows.setdefault(t.shape[0], f"{name} tensor {i} {tuple(t.shape)}")
    if len(rows) > 1:
        seen = "; ".join(f"{r} rows in {where}" for r, where in rows.items())
        raise ShapeError(
            f"the batch is cut into {n} {what} along dimension 0 of every tensor, and "
            f"its tensors do not all have a row per sample ({seen}): each part would "
            "pair other rows. Make dimension 0 the batch in every tensor (a "
            "sequence-first batch batch-first, targets not flattened), and build what "
            "all samples share (a mask) inside the model")
    return _split(inputs, n, what), _split(targets, n, what)


def _split(value, n: int, what: str) -> list:
    """Split every tensor of a batch pytree into ``n`` equal parts along dimension 0."""
    from ..client.loader import Parts
    leaves, spec = pytree.tree_flatten(value)
    parts = []
    for t in leaves:
        if isinstance(t, Parts):            # a pw.DataLoader batch: already cut, placed
            if len(t) != n:
                raise ShardingError(f"a pw.DataLoader batch cut into {len(t)} parts "
                                    f"cannot be split into {n} {what}; give the loader "
                                    "slice=trainer, so that it cuts batches as the "
                                    "trainer needs")
            parts.append(t.parts)
            continue
        if isinstance(t, Array):
            raise PlacementError(f"an Array cannot be split into {n} {what} in place; "
                                 "pass CPU tensors, or a pw.DataLoader(slice=trainer) "
                                 "batch")
        if not isinstance(t, (torch.Tensor, np.ndarray)):
            parts.append([t] * n)           # a static leaf: the same in every part
            continue
        t = torch.as_tensor(t)
        if t.shape[0] % n:
            raise ShardingError(f"a batch of {t.shape[0]} cannot be split into {n} equal "
                                f"{what}; use a batch size divisible by {n}")
        parts.append(t.chunk(n))
    return [pytree.tree_unflatten([p[i] for p in parts], spec) for i in range(n)]
