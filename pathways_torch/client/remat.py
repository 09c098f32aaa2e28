"""Activation checkpointing (``torch.utils.checkpoint``) in captured programs.

In the joint graph a checkpointed block appears twice: its forward, and its
recomputation, which torch runs inside the backward when the backward needs the
activations the forward did not keep. Capture tags the recomputed ops while it records
the graph (``tagging``), to refuse what would be wrong: a checkpointed block that draws
random numbers (dropout). torch replays the forward's RNG state for the recomputation;
the program's random ops would draw a second, different mask, and the gradients would
silently be those of another network.

What checkpointing saves here: nothing, on the CPU backend. XLA sees two identical
computations of the same values and merges them (common-subexpression elimination), so
the step's planned memory equals the unchecked model's (31.1 MiB per device for 8
Linear(512) blocks at batch 2048, both ways). Passing each recomputed block's inputs and
the backward's latest value through an optimization barrier, as
``torch_xla.utils.checkpoint`` does, keeps the recomputation but raised the plan to
45.0 MiB on XLA's CPU scheduler (43.0 MiB barriering only activations), so it is not
done (docs/architecture.md, Decision 14).

Example (inside capture)::

    with tagging():
        joint = make_fx(fn, ...)(*fakes)
    check_random(joint, name)
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from ..errors import TraceError

KEY = "recompute"
_regions = itertools.count(1)


@contextlib.contextmanager
def tagging():
    """While recording: ops that torch.utils.checkpoint's recomputation creates get
    ``node.meta["recompute"] = region``."""
    import torch.utils.checkpoint as ckpt
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    base = ckpt._recomputation_hook

    class _Tagged(base):
        def __enter__(self):
            mode = get_proxy_mode()
            self._graph = mode.tracer.graph if mode is not None else None
            self._before = set(self._graph.nodes) if self._graph is not None else set()
            self._region = next(_regions)
            return super().__enter__()

        def __exit__(self, *exc):
            out = super().__exit__(*exc)
            if self._graph is not None:
                for node in self._graph.nodes:
                    if node not in self._before and node.op == "call_function":
                        node.meta.setdefault(KEY, self._region)
            return out

    ckpt._recomputation_hook = _Tagged
    try:
        yield
    finally:
        ckpt._recomputation_hook = base


def check_random(gm, name: str) -> None:
    """Refuse random ops in a recomputed block (see the module's docstring)."""
    for node in gm.graph.nodes:
        op = node.target
        if node.meta.get(KEY) and isinstance(op, torch._ops.OpOverload) and \
                torch.Tag.nondeterministic_seeded in op.tags:
            raise TraceError(
                f"program '{name}': a block under torch.utils.checkpoint draws random "
                f"numbers ({op.name()}, e.g. dropout); its recomputation would draw "
                "different ones than its forward. Checkpoint blocks without dropout, or "
                "set the dropout probability of the checkpointed blocks to 0")
