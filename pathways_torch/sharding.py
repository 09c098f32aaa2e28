"""Partition specs: how an Array's dimensions map onto a slice's mesh axes.

``P("data", None)`` splits dimension 0 over the mesh axis ``"data"`` and keeps
dimension 1 whole. As in JAX, ``P()`` is fully replicated, and dimensions past the
spec's length are replicated. An entry may be a tuple of axes to split one dimension
over several axes: ``P(("data", "model"))``.

Example::

    x = pw.put(torch.randn(64, 128), s, P("data", None))
"""

from __future__ import annotations

import math
from typing import Iterable, List, Sequence, Tuple, Union

from .errors import ShardingError

AxisEntry = Union[None, str, Tuple[str, ...]]


class P(tuple):
    """A partition spec: one entry per leading tensor dimension (None, an axis, or a tuple)."""

    def __new__(cls, *entries: AxisEntry) -> "P":
        norm = []
        for e in entries:
            if e is None or isinstance(e, str):
                norm.append(e)
            elif isinstance(e, (tuple, list)) and all(isinstance(a, str) for a in e):
                norm.append(tuple(e) if len(e) != 1 else e[0])
            else:
                raise ShardingError(
                    f"P entries must be None, an axis name or a tuple of axis names, got {e!r}"
                )
        return super().__new__(cls, norm)

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def axes(self, dim: int) -> Tuple[str, ...]:
        """The mesh axes that dimension ``dim`` is split over (empty if not split)."""
        if dim >= len(self) or self[dim] is None:
            return ()
        e = self[dim]
        return (e,) if isinstance(e, str) else tuple(e)

    def normalized(self, rank: int) -> "P":
        """The same spec with trailing replicated dimensions dropped."""
        entries = list(self)[:rank]
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)


def as_spec(spec: Union[P, Sequence[AxisEntry], None]) -> P:
    """Accept ``P``, a plain tuple or None (replicated) and return a ``P``."""
    if spec is None:
        return P()
    if isinstance(spec, P):
        return spec
    if isinstance(spec, str):
        return P(spec)
    return P(*spec)


def validate_spec(
    spec: P, shape: Sequence[int], axis_names: Sequence[str], mesh_shape: Sequence[int],
    what: str = "array",
) -> None:
    """Raise ShardingError unless ``spec`` is a valid sharding of ``shape`` on the mesh."""
    sizes = dict(zip(axis_names, mesh_shape))
    if len(spec) > len(shape):
        raise ShardingError(
            f"{what}: spec {spec!r} has {len(spec)} entries but the {what} has rank "
            f"{len(shape)} (shape {tuple(shape)}); give at most one entry per dimension"
        )
    seen = set()
    for dim in range(len(spec)):
        axes = spec.axes(dim)
        for a in axes:
            if a not in sizes:
                raise ShardingError(
                    f"{what}: spec {spec!r} names mesh axis {a!r}, but the slice's axes are "
                    f"{tuple(axis_names)}; use one of those or None"
                )
            if a in seen:
                raise ShardingError(
                    f"{what}: spec {spec!r} uses mesh axis {a!r} twice; each axis may split "
                    f"at most one dimension"
                )
            seen.add(a)
        n = math.prod(sizes[a] for a in axes)
        if n > 1 and shape[dim] % n != 0:
            raise ShardingError(
                f"{what}: dimension {dim} has size {shape[dim]}, which {n} devices of "
                f"axes {axes} cannot split evenly; pad it to a multiple of {n} or replicate "
                f"that dimension (None in the spec)"
            )


def spec_candidates(rank: int, axis_names: Sequence[str]) -> Iterable[P]:
    """Every spec of ``rank`` entries that uses each axis at most once, simplest first."""
    names = list(axis_names)
    options: list = [None] + names
    if len(names) >= 2:
        options += [(a, b) for a in names for b in names if a != b]

    results = []

    def rec(prefix: list, used: set) -> None:
        if len(prefix) == rank:
            results.append(P(*prefix).normalized(rank))
            return
        for o in options:
            axes = () if o is None else ((o,) if isinstance(o, str) else o)
            if used & set(axes):
                continue
            rec(prefix + [o], used | set(axes))

    rec([], set())
    results.sort(key=lambda s: sum(len(s.axes(d)) for d in range(len(s))))
    seen, out = set(), []
    for s in results:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def spec_to_proto(spec: P, msg) -> None:
    """Fill a ``pathways.Spec`` message from a P."""
    for dim in range(len(spec)):
        msg.dims.add().axes.extend(spec.axes(dim))


def spec_from_proto(msg) -> P:
    """The P that a ``pathways.Spec`` message describes."""
    return P(*[(tuple(d.axes) if len(d.axes) > 1 else (d.axes[0] if d.axes else None))
               for d in msg.dims])


def shard_shape(shape: Sequence[int], spec: P, axis_names: Sequence[str],
                mesh_shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape of one device's shard of an array of ``shape`` under ``spec``."""
    sizes = dict(zip(axis_names, mesh_shape))
    return tuple(
        s // math.prod(sizes[a] for a in spec.axes(d)) for d, s in enumerate(shape)
    )


Block = Tuple[Tuple[int, int], ...]     # (start, stop) per dimension


def device_block(shape: Sequence[int], spec: P, axis_names: Sequence[str],
                 mesh_shape: Sequence[int], position: int) -> Block:
    """The part of an array of ``shape`` under ``spec`` that the device at flat mesh
    ``position`` (row-major) holds. A dimension split over several axes is split over
    them major-first, as in JAX."""
    coords = dict(zip(axis_names, _unravel(position, mesh_shape)))
    sizes = dict(zip(axis_names, mesh_shape))
    block = []
    for d, n in enumerate(shape):
        k, parts = 0, 1
        for a in spec.axes(d):
            k, parts = k * sizes[a] + coords[a], parts * sizes[a]
        step = n // parts
        block.append((k * step, (k + 1) * step))
    return tuple(block)


def member_blocks(shape: Sequence[int], spec: P, axis_names: Sequence[str],
                  mesh_shape: Sequence[int], member: int, members: int
                  ) -> Tuple[List[Block], List[int]]:
    """What one host of a slice that spans ``members`` hosts holds of an array.

    Devices are host-major: host ``member`` holds mesh positions ``member * L`` to
    ``(member + 1) * L - 1``, ``L`` = devices per host. Returns the distinct blocks in
    the order their first device comes (what a put sends that host, and what its fetch
    answers), and for each local device the index of its block in that list.

    Example: ``member_blocks((8, 4), P("data"), ("data", "model"), (2, 2), 1, 2)``
    is ``([((4, 8), (0, 4))], [0, 0])``: host 1's two devices both hold rows 4-7."""
    per_host = math.prod(mesh_shape) // members
    blocks: List[Block] = []
    where: List[int] = []
    for p in range(member * per_host, (member + 1) * per_host):
        b = device_block(shape, spec, axis_names, mesh_shape, p)
        if b not in blocks:
            blocks.append(b)
        where.append(blocks.index(b))
    return blocks, where


def host_box(blocks: Sequence[Block], what: str = "array") -> Block:
    """The one box that a host's distinct ``blocks`` fill exactly.

    A host of a slice that spans hosts sees its part of an array as one tensor (what
    ``pw.colocated`` hands its function, and what the function hands back). That needs
    the part to be a box: raises ShardingError when the blocks leave holes in their
    bounding box, as ``P(("model", "data"))`` does when "data" crosses hosts."""
    rank = len(blocks[0])
    box = tuple((min(b[d][0] for b in blocks), max(b[d][1] for b in blocks))
                for d in range(rank))
    filled = sum(math.prod(e - s for s, e in b) for b in blocks)
    if filled != math.prod(e - s for s, e in box):
        raise ShardingError(
            f"{what}: a host's devices hold {len(blocks)} pieces that are not one box of "
            f"the array ({list(blocks)}), so a host cannot see its part as one tensor; "
            "split that dimension over the host-crossing axis first (P(('data', 'model')) "
            "when 'data' crosses hosts) or over one axis")
    return box


def member_region(local_shape: Sequence[int], spec: P, axis_names: Sequence[str],
                  mesh_shape: Sequence[int], member: int, members: int,
                  what: str = "array") -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """The global shape of an array of which host ``member`` holds a region of
    ``local_shape`` under ``spec``, and where that region starts.

    The inverse of ``member_blocks``: what a host that made only its own part of an
    array (a ``pw.colocated`` function's output) needs to place it. Raises
    ShardingError when ``local_shape`` cannot be this host's part of any array.

    Example: on a (2, 2) ("data", "model") mesh over 2 hosts (one "data" row each),
    ``member_region((4, 6), P("data"), ("data", "model"), (2, 2), 1, 2)`` is
    ``((8, 6), (4, 0))``: host 1's 4 rows are rows 4-7 of 8."""
    if len(spec) > len(local_shape):
        raise ShardingError(f"{what}: spec {spec!r} has {len(spec)} entries but the "
                            f"{what} has rank {len(local_shape)} (shape "
                            f"{tuple(local_shape)}); give at most one entry per dimension")
    validate_spec(spec, [0] * len(local_shape), axis_names, mesh_shape, what)  # the axes
    sizes = dict(zip(axis_names, mesh_shape))
    shards = [math.prod(sizes[a] for a in spec.axes(d)) for d in range(len(local_shape))]
    # One element per shard: the blocks then count shards, and the box says which
    # shards this host holds along each dimension.
    blocks, _ = member_blocks(shards, spec, axis_names, mesh_shape, member, members)
    box = host_box(blocks, what)
    shape, start = [], []
    for d, ((s, e), n) in enumerate(zip(box, local_shape)):
        held = e - s
        if n % held:
            raise ShardingError(
                f"{what}: dimension {d} has size {n} on this host, whose devices hold "
                f"{held} shards of it under {spec!r}; return a size divisible by {held}")
        shape.append(n // held * shards[d])
        start.append(n // held * s)
    return tuple(shape), tuple(start)


def _unravel(position: int, mesh_shape: Sequence[int]) -> List[int]:
    out = []
    for n in reversed(mesh_shape):
        out.append(position % n)
        position //= n
    return out[::-1]


def overlaps(a: Block, b: Block) -> bool:
    """Whether two blocks share any element."""
    return all(s1 < e2 and s2 < e1 for (s1, e1), (s2, e2) in zip(a, b))


def intersect(a: Block, b: Block) -> Block:
    """The elements two overlapping blocks share."""
    return tuple((max(s1, s2), min(e1, e2)) for (s1, e1), (s2, e2) in zip(a, b))


def move_plan(shape: Sequence[int], src: Sequence[List[Block]],
              dst: Sequence[List[Block]]) -> List[List[List[Block]]]:
    """What each source host sends each destination host in a move between slices.

    ``src[k]``: the blocks host k of the source holds (one entry, the whole array, for a
    one-host slice); ``dst[j]``: the blocks host j of the destination needs. Returns
    ``plan[k][j]``: the blocks k sends j, so that j gets every element it needs exactly
    once (an element several source hosts hold is sent by the first). Only what is
    needed crosses: moving rows 0-3 of a one-host array to the host that holds them
    sends rows 0-3.

    Example: ``move_plan((4,), [[((0, 4),)]], [[((0, 2),)], [((2, 4),)]])`` is
    ``[[[((0, 2),)], [((2, 4),)]]]``."""
    owner: dict = {}
    for k, blocks in enumerate(src):
        for b in blocks:
            owner.setdefault(b, k)
    plan: List[List[List[Block]]] = [[[] for _ in dst] for _ in src]
    for j, needs in enumerate(dst):
        for n in needs:
            for b, k in owner.items():
                if overlaps(b, n):
                    piece = intersect(b, n)
                    if piece not in plan[k][j]:
                        plan[k][j].append(piece)
    return plan


def whole(shape: Sequence[int]) -> Block:
    """The block that is all of an array of ``shape``."""
    return tuple((0, int(n)) for n in shape)
