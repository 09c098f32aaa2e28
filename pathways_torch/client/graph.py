"""Recorded dataflow graphs: many program calls and transfers, submitted as one unit.

Inside ``with pw.graph():`` calls and transfers return Arrays as usual, but their ops
are held back; leaving the block submits them: the coordinator's gang scheduler gives
the submission one position in the order of every island it touches, and each slice's
executor receives all of its ops in one message (one ``GangOp``), in that order. This
is the paper's ``@pw.program`` over several compiled functions; pipelines use it.

Example::

    with pw.graph():
        h = stage0(x)
        h = stage1(h.to(s1))
        y = stage2(h.to(s2))
    y.torch()
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional

from .. import tracing
from ..errors import PathwaysError
from ..rpc import pathways_pb2 as pb

_local = threading.local()
_submit_lock = threading.Lock()


class SeqCell:
    """The stream position of ops recorded in a graph, known once it is submitted."""

    __slots__ = ("value", "dropped")

    def __init__(self) -> None:
        self.value: Optional[int] = None
        self.dropped: Optional[BaseException] = None   # the error that ended the block

    def __int__(self) -> int:
        if self.value is None:
            if self.dropped is not None:
                raise PathwaysError(
                    "this Array comes from a `with pw.graph():` block that raised "
                    f"{type(self.dropped).__name__} ({self.dropped}), so nothing it "
                    "recorded was submitted and it never will be: run the block again")
            raise PathwaysError(
                "this Array comes from a pw.graph() that has not been submitted yet: "
                "leave the `with pw.graph():` block before reading it")
        return self.value


def seq_of(seq) -> int:
    return seq if isinstance(seq, int) else int(seq)


def current() -> Optional["Graph"]:
    return getattr(_local, "graph", None)


class Graph:
    """Ops recorded per executor connection, submitted together. Use ``pw.graph()``."""

    def __init__(self) -> None:
        self._ops: Dict[object, List[pb.Op]] = {}
        self._cells: Dict[object, SeqCell] = {}
        self._slices: Dict[object, object] = {}
        self.positions: Dict[str, int] = {}
        self.submitted = False
        # Every Array the recorded ops create or read stays alive until submission, so
        # that no release can overtake the ops (which are held back until then).
        self._keep: List[object] = []
        # What recording changed in Arrays from before the block (an input updated in
        # place now names the update's buffer; a donated input is marked): undone, in
        # reverse, if the block raises, since nothing it recorded will run.
        self._undo: List[Callable[[], None]] = []

    def keep(self, *arrays) -> None:
        self._keep.extend(arrays)

    def on_abort(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def record(self, conn, op: pb.Op) -> SeqCell:
        self._ops.setdefault(conn, []).append(op)
        return self._cells.setdefault(conn, SeqCell())

    def submit(self) -> None:
        from . import runtime
        if self.submitted:
            return
        self.submitted = True
        if not self._ops:
            self._keep.clear()
            return
        state = runtime.get_state()
        t0 = tracing.CLIENT.now() if tracing.CLIENT.on else 0
        conns = list(self._ops)
        slice_ids = [c.slice_id for c in conns]
        with _submit_lock:
            positions, seqs, host_seqs = state.schedule(slice_ids)
            host_seqs = host_seqs or [[] for _ in conns]
            for conn, pos, seq, hs in zip(conns, positions, seqs, host_seqs):
                self._cells[conn].value = conn.send_gang(pos, seq, self._ops[conn], hs)
                self.positions[conn.slice_id] = pos
        self._keep.clear()
        self._undo.clear()
        if t0:
            tracing.CLIENT.add("dispatch", "graph", t0, detail=", ".join(
                f"{sid}@{p}" for sid, p in self.positions.items()))

    def __enter__(self) -> "Graph":
        if current() is not None:
            raise PathwaysError("pw.graph() blocks do not nest")
        _local.graph = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.graph = None
        if exc_type is None:
            self.submit()
        else:
            for undo in reversed(self._undo):
                undo()
            self._undo.clear()
            self._keep.clear()
            for cell in self._cells.values():
                cell.dropped = exc


def graph() -> Graph:
    """Record the program calls and transfers of a block and submit them as one graph."""
    return Graph()
