"""Activation checkpointing (``torch.utils.checkpoint``) in captured programs.

In the joint graph a checkpointed block appears twice: its forward, and its
recomputation, which torch runs inside the backward when the backward needs the
activations the forward did not keep. Capture tags the recomputed ops and each
checkpointed call's forward ops while it records the graph (``tagging``). torch replays
the forward's RNG state for the recomputation, so a block with dropout draws the same
masks twice; the program's random ops would draw a second, different mask, and the
gradients would silently be those of another network. ``share_random`` gives each
recomputed random op a copy of its forward's draw.

What checkpointing saves here, and how (``tie``). XLA sees the recomputation as a second
copy of the forward's ops on the same values; left alone, its common-subexpression
elimination merges the two and keeps the forward's activations alive until the backward
(29.1 MiB per device for 8 Linear(512) layers at batch 2048 over 2 devices, checkpointed
or not). An optimization barrier does not stop it on the CPU backend, which expands
barriers before CSE runs. So each recomputed region reads its inputs through ``tie``:
``x + where(flag, g[0], 0)``, where ``flag`` is a runtime ``False`` (a program constant
XLA cannot fold) and ``g`` the backward value computed just before the region. The sum
equals ``x`` bit for bit, differs from the forward's operand for XLA (no merge), and depends on the
backward (the recomputation cannot be scheduled early, where it would keep its results
alive as long as the forward's). Measured by XLA's memory plan for one step (6 blocks of
4 Linear(512)+Tanh, batch 1024 per device): 77.1 MiB without checkpointing, 48.1 MiB
with (Decision 14). The cost: one elementwise add per region input per step.

Example (inside capture)::

    with tagging():
        joint = make_fx(fn, ...)(*fakes)
    share_random(joint, name)
    tie_regions(joint)
"""

from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Dict, List

import torch

from ..errors import TraceError

KEY = "recompute"
FRAME = "recompute_block"        # the checkpointed call a recomputed op belongs to
FORWARD = "checkpoint_block"     # the checkpointed call a forward op belongs to
_regions = itertools.count(1)


@contextlib.contextmanager
def tagging():
    """While recording: ops that torch.utils.checkpoint's recomputation creates get
    ``node.meta["recompute"] = region``."""
    import torch.utils.checkpoint as ckpt
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    base, base_forward = ckpt._recomputation_hook, ckpt._checkpoint_hook

    def recorded(hook, key, value):
        """``hook`` (a context manager class) tagging the nodes created inside it."""
        class _Tagging(hook):
            def __enter__(self):
                mode = get_proxy_mode()
                self._graph = mode.tracer.graph if mode is not None else None
                self._before = set(self._graph.nodes) if self._graph is not None else set()
                self._tags = value(self)
                return super().__enter__()

            def __exit__(self, *exc):
                out = super().__exit__(*exc)
                if self._graph is not None:
                    for node in self._graph.nodes:
                        if node not in self._before and node.op == "call_function":
                            for k, v in zip(key, self._tags):
                                node.meta.setdefault(k, v)
                return out
        return _Tagging

    class _Recomputed(recorded(base, (KEY, FRAME), lambda h: (next(_regions), h._frame))):
        def __init__(self, target_frame_ref, gid):
            frame = target_frame_ref()
            self._frame = getattr(frame, "_pathways_block", None)
            super().__init__(target_frame_ref, gid)

    class _Forward(recorded(base_forward, (FORWARD,), lambda h: (h._frame,))):
        def __init__(self, frame):
            frame._pathways_block = self._frame = next(_regions)
            super().__init__(frame)

    ckpt._recomputation_hook, ckpt._checkpoint_hook = _Recomputed, _Forward
    try:
        yield
    finally:
        ckpt._recomputation_hook, ckpt._checkpoint_hook = base, base_forward


def _random(node) -> bool:
    op = node.target
    return node.op == "call_function" and isinstance(op, torch._ops.OpOverload) and \
        torch.Tag.nondeterministic_seeded in op.tags


def share_random(gm, name: str) -> int:
    """The recomputation of a checkpointed block draws what its forward drew, as torch's
    replay of the RNG state makes it: its k-th random op takes a copy of the forward's
    k-th (kept from the forward: a dropout mask's memory, not the activations'). A
    recomputation whose random ops do not pair with its forward's is refused. Returns
    how many draws were shared."""
    graph = gm.graph
    forward: Dict[int, list] = {}
    again: Dict[int, list] = {}
    for node in graph.nodes:
        if not _random(node):
            continue
        if node.meta.get(KEY):
            again.setdefault(node.meta.get(FRAME), []).append(node)
        elif node.meta.get(FORWARD) is not None:
            forward.setdefault(node.meta[FORWARD], []).append(node)
    shared = 0
    for block, redraws in again.items():
        draws = forward.get(block, [])
        if block is None or len(draws) != len(redraws) or any(
                f.target != r.target or not isinstance(f.meta.get("val"), torch.Tensor)
                or f.meta["val"].shape != r.meta.get("val", f.meta["val"]).shape
                for f, r in zip(draws, redraws)):
            op = redraws[0].target.name()
            raise TraceError(
                f"program '{name}': a block under torch.utils.checkpoint draws random "
                f"numbers ({op}) that its recomputation cannot take from its forward. "
                "Checkpoint blocks without dropout, or set the dropout probability of "
                "the checkpointed blocks to 0")
        for f, r in zip(draws, redraws):
            with graph.inserting_after(f):
                kept = graph.call_function(torch.ops.aten.clone.default, (f,))
            kept.meta["val"] = f.meta["val"]
            with graph.inserting_before(r):
                if r.target._schema.is_mutable:   # bernoulli_(t): t takes the draw
                    new = graph.call_function(torch.ops.aten.copy_.default,
                                              (r.args[0], kept))
                else:
                    new = graph.call_function(torch.ops.aten.clone.default, (kept,))
            new.meta.update(r.meta)          # in the recomputed region, as r was
            r.replace_all_uses_with(new)
            graph.erase_node(r)
            shared += 1
    if shared:
        graph.lint()
        gm.recompile()
    return shared



_TIE = None


def tie_op():
    """``pathways::remat_tie(xs) -> xs``: the identity on CPU fakes; replay lowers it
    with ``lower_tie`` (see the module's docstring)."""
    global _TIE
    if _TIE is None:
        @torch.library.custom_op("pathways::remat_tie", mutates_args=())
        def _tie(xs: List[torch.Tensor]) -> List[torch.Tensor]:
            return [x.clone() for x in xs]

        @_tie.register_fake
        def _(xs):
            return [torch.empty_like(x) for x in xs]

        _TIE = torch.ops.pathways.remat_tie.default
    return _TIE


def tie_regions(gm) -> int:
    """Make each recomputed region of ``gm`` read its inputs through one ``tie`` with
    the backward value computed just before it; returns how many regions were tied.

    A region's inputs are the values its ops read from outside it: the checkpointed
    block's inputs and the parameters. Inputs of the program (placeholders, or views of
    them: the parameters) are left alone when another input is tied, because the
    region's ops depend on that one (a tied parameter costs a copy of it per step); a
    region that reads only the program's inputs (a block on the batch) ties them all."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    regions: Dict[int, list] = {}
    for n in nodes:
        if n.meta.get(KEY):
            regions.setdefault(n.meta[KEY], []).append(n)
    tied = 0
    for members in regions.values():
        inside = set(members)
        first = min(members, key=order.get)
        written = _written(members, inside)
        inputs = list(dict.fromkeys(
            a for m in members for a in m.all_input_nodes
            if a not in inside and a not in written
            and isinstance(a.meta.get("val"), torch.Tensor)))
        ext = [a for a in inputs if not _from_inputs(a)] or inputs
        if not ext:
            continue
        latest = next((n for n in reversed(nodes[:order[first]])
                       if n.op == "call_function" and not n.meta.get(KEY)
                       and isinstance(n.meta.get("val"), torch.Tensor)), None)
        if latest is None:
            continue
        with graph.inserting_before(first):
            t = graph.call_function(tie_op(), (ext + [latest],))
            outs = [graph.call_function(operator.getitem, (t, k)) for k in range(len(ext))]
        for a, o in zip(ext, outs):
            for m in members:
                m.replace_input_with(a, o)
        tied += 1
    if tied:
        graph.lint()
        gm.recompile()
    return tied


def _written(members: list, inside: set) -> set:
    """The values from outside a region that its ops write in place (through views made
    inside it): a batch norm's running statistics, which torch's recomputation updates a
    second time. They stay untied, or the update would go to the tie's copy."""
    written = set()
    for m in members:
        schema = getattr(m.target, "_schema", None)
        if m.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for k, arg in enumerate(schema.arguments):
            info = arg.alias_info
            value = m.args[k] if k < len(m.args) else m.kwargs.get(arg.name)
            if info is None or not info.is_write or not isinstance(value, torch.fx.Node):
                continue
            while value in inside and aliases_first(value):
                value = value.args[0]
            written.add(value)
    return written


def aliases_first(node) -> bool:
    """The op returns its first argument or a view of it (``view``, ``copy_``)."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.arguments and node.args
                and schema.arguments[0].alias_info is not None
                and isinstance(node.args[0], torch.fx.Node))


# ops that only view, detach or cast their first argument (autocast's copies of weights)
_ALIASING = {"detach", "alias", "view", "_unsafe_view", "t", "permute", "expand",
             "transpose", "reshape", "_to_copy"}


def _from_inputs(node) -> bool:
    """A program input, or a view or cast of one."""
    while node.op == "call_function" and node.args and \
            getattr(node.target, "__name__", "").split(".")[0] in _ALIASING:
        node = node.args[0]
    return node.op == "placeholder"


def lower_tie(xs: List[torch.Tensor], flag: torch.Tensor) -> List[torch.Tensor]:
    """The XLA lowering of ``tie``: ``xs[:-1]`` plus ``where(flag, xs[-1][0], 0)``, with
    ``flag`` a runtime False; returns as many tensors as ``xs``."""
    *ext, latest = xs
    zero = torch.where(flag, latest.reshape(-1)[0].float(), 0.0)
    return [x if x.dtype == torch.bool else x + zero.to(x.dtype) for x in ext] + [latest]
