"""The executor's hot loop, top to bottom: one thread takes the client's ordered ops
off the queue and runs each (an execution, a gang op's fused runs, a put, a transfer, a
release...), then advances the op count that readers wait on.

Part of ``ExecutorService`` (worker/executor.py); the other parts: programs.py (compile
and launch), transfers.py (bytes in and out), backpressure.py (the memory budget),
checkpoint_io.py. Example: the loop is started by the service::

    threading.Thread(target=service._loop, name="executor").start()
"""

from __future__ import annotations

import logging
import traceback

from ..rpc import validate
from ..sharding import spec_from_proto
from .fused import Segment
from .store import Entry
from .transfers import _nbytes

log = logging.getLogger("pathways.executor")


def _donatable(op) -> list:
    """The positions of ``op``'s donated inputs that it reads only once (an input
    passed twice cannot give its memory to an output)."""
    ids = list(op.inputs)
    seen: dict = {}
    for b in ids:
        seen[b] = seen.get(b, 0) + 1
    return [k for k in op.donate if k < len(ids) and seen[ids[k]] == 1]


class OpLoop:
    """The ordered op loop and the execution of programs (a mixin of ExecutorService)."""

    def _loop(self) -> None:
        while True:
            item = self._ahead.popleft() if self._ahead else self._queue.get()
            if item is None:
                return
            kind, msg, index, t_in = item
            if t_in:
                self._queued(kind, msg, index, t_in)
            if kind == "compile":
                fut = index
                try:
                    fut.set_result(self._compile(msg))
                except Exception as e:
                    log.debug("compile failed: %s", traceback.format_exc())
                    fut.set_exception(e)
                continue
            self._process(index, msg)

    def _process(self, index: int, op) -> None:
        which = op.WhichOneof("kind")
        try:
            if which == "gang":
                g = op.gang
                rec = self.rec
                t0 = rec.now() if rec.on else 0
                if g.slice_seq > 0:
                    if g.slice_seq != self._gang_next:   # the client enqueues in order
                        log.error("gang op %d arrived, expected %d", g.slice_seq,
                                  self._gang_next)
                    self._gang_next = g.slice_seq + 1
                    self.gang_positions.append(g.position)
                if self.arbiter is not None and g.host_seq:
                    # Shared devices: the whole gang op runs in one grant, in the
                    # host's gang order (see worker/arbiter.py).
                    with self.arbiter.grant(gang=g.host_seq):
                        self._in_gang = True
                        try:
                            self._gang_ops(g.ops)
                        finally:
                            self._in_gang = False
                else:
                    self._gang_ops(g.ops)
                if t0:
                    rec.add("gang", "gang", t0,
                            detail=f"island position {g.position}, {len(g.ops)} ops")
            else:
                self._one(op)
        except Exception:  # never let one op kill the stream
            log.error("op %s failed: %s", which, traceback.format_exc())
        if index:
            self.store.advance(index)

    def _gang_ops(self, ops) -> None:
        """A recorded graph's ops for this slice, in order. A graph this executor has
        seen before runs its consecutive executions as one fused XLA computation
        (worker/fused.py): traced one by one, launched once."""
        seg = self._fusion.segment(ops, self.rec.on)
        if seg is None:
            for inner in ops:
                self._one(inner)
            return
        for inner in ops:
            if not self._fuse(seg, inner):
                if seg.count:
                    self._flush(seg)
                    seg = Segment()
                self._one(inner)
        self._flush(seg)

    def _one(self, op) -> None:
        which = op.WhichOneof("kind")
        bad = self._invalid(op, which)
        if bad is not None:
            self._reject(which, validate.op_outputs(op), bad,
                         op.recv if which == "recv" else None)
            return
        if which == "execute":
            self._execute(op.execute)
        elif which == "put":
            self._put(op.put)
        elif which == "release":
            self._release(op.release.buffer_ids)
            if op.release.loader_ids:
                from .loader import close_loaders
                close_loaders(self, op.release.loader_ids)
        elif which == "recv":
            r = op.recv
            err = self._room_for(_nbytes(r.meta), r.spec,
                                 f"the transfer into buffer {r.buffer_id}", {r.buffer_id})
            if err is not None:
                # the bytes still arrive; take them off the data socket and drop them
                self._discard_recv(r)
                self.store.put(r.buffer_id, Entry(error=err))
            else:
                self.store.put(r.buffer_id, Entry(None, None, _nbytes(r.meta), "", r,
                                                  self._shards(spec_from_proto(r.spec))))
        elif which == "send":
            self._send(op.send)
        elif which == "barrier":
            self._events.put(self.pb.DispatchEvent(barrier=op.barrier.token))
        elif which == "watch":
            self._watch()
        elif which == "batch":
            self._batch(op.batch)
        elif which == "save":
            t0 = self.rec.now() if self.rec.on else 0
            self._save(op.save)
            self.rec.add("checkpoint", "save", t0, buffer_ids=op.save.buffer_ids,
                         detail=op.save.path)
        elif which == "load":
            t0 = self.rec.now() if self.rec.on else 0
            self._load(op.load)
            self.rec.add("checkpoint", "load", t0, buffer_ids=op.load.buffer_ids,
                         detail=op.load.path)

    def _execute(self, op) -> None:
        prog = self.programs.get(op.program_id)
        if prog is None:
            err = self._err("program", f"unknown program id {op.program_id!r}")
            for b in op.outputs:
                self.store.put(b, Entry(error=err))
            return
        inputs, entries = [], []
        for b in op.inputs:
            e = self.store.get(b)
            if e is None:
                err = self._err("unknown_buffer",
                                f"input buffer {b} of program '{prog.name}' does not exist "
                                "(released or never created)", prog.name)
                break
            self._resolve(e)
            if e.error is not None:
                err = e.error   # the original failure travels downstream unchanged
                break
            if e.donated:
                err = self._err("donated", f"input buffer {b} of program '{prog.name}' was "
                                "donated to an earlier program", prog.name)
                break
            inputs.append(e.tensor)
            entries.append(e)
        else:
            err = None
        if err is None and prog.out_device_bytes > self.budget:
            err = self._err("oom", self._oom_text(prog, prog.out_device_bytes), prog.name)
        donated = _donatable(op) if op.donate else ()
        if err is None:
            # Donated inputs' memory becomes the outputs'.
            need = prog.out_device_bytes - sum(entries[k].nbytes // entries[k].shards
                                               for k in donated)
            if need > 0 and self.store.device_bytes + need > self.budget:
                err = self._make_room(need, f"program '{prog.name}'", set(op.inputs),
                                      prog.name)
        if err is None and donated:
            for k in donated:
                self.store.donate(entries[k])
            self._mark_donated(inputs, donated)
        rec = self.rec
        t0 = rec.now() if rec.on else 0
        done = False                    # run to completion: Waits need not wait
        ran = err is None               # (a failure while running: donations happened)
        if err is None:
            try:
                if self._in_gang:       # inside its gang op's grant: run to the end
                    outs = self._run(prog, inputs)
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                    done = True
                elif self.arbiter is not None:
                    with self.arbiter.grant(
                            more=lambda: bool(self._ahead) or not self._queue.empty()):
                        outs = self._run(prog, inputs)
                        self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                    done = True
                elif t0:
                    # Profiling: run to completion, so the span is the device time.
                    outs = self._run(prog, inputs)
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                    done = True
                elif (prog.cached is not None and tuple(donated) == prog.donate
                      and (outs := self._launch(prog, inputs))):
                    pass                # asynchronous, as below, without tracing again
                else:
                    outs = self._run(prog, inputs)
                    # Asynchronous: the next op's host work overlaps this execution (~30
                    # µs an op instead of ~150 µs with wait=True here). Outputs that
                    # cannot fit were refused above, so executions do not fail for want
                    # of memory.
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=False)
                if len(outs) != len(op.outputs):
                    raise RuntimeError(f"program returned {len(outs)} outputs, "
                                       f"{len(op.outputs)} were declared")
            except Exception as e:
                err = self._err("program", f"program '{prog.name}' failed on {self.where}: "
                                f"{type(e).__name__}: {e}", prog.name)
        if t0:
            rec.add("execute", prog.name, t0, program=prog.name, buffer_ids=op.outputs,
                    detail=f"failed: {err.message}" if err is not None else "")
        if err is not None:
            if ran:
                for b in op.outputs:
                    self.store.put(b, Entry(error=err))
            else:
                self._not_run(op, err)
            return
        put = self.store.put
        for b, o, n, k in zip(op.outputs, outs, prog.out_nbytes, prog.out_shards):
            put(b, Entry(o, None, n, prog.name, None, k, done))
        for k in donated:           # the donated inputs' memory now holds outputs
            gone = self._err("donated", f"buffer {op.inputs[k]} was donated to program "
                             f"'{prog.name}'; read that program's outputs instead", prog.name)
            put(op.inputs[k], Entry(None, gone, 0, prog.name))
        self.executed += 1

    def _not_run(self, op, err) -> None:
        """The outputs of an execution that did not run (``err``: an input failed, or
        no room): each new value of an input updated in place (``op.carry``) keeps
        that input's value, as a torch update that never ran leaves its tensor (a
        training step whose batch failed to load leaves the weights and optimizer
        state as they were, to go on with the next batch); the others fail with
        ``err``."""
        carry = op.carry
        for o, b in enumerate(op.outputs):
            e = self.store.get(op.inputs[carry[o] - 1]) if carry and carry[o] else None
            if e is not None:
                self._resolve(e)
            if e is None or e.error is not None or e.donated or e.tensor is None:
                self.store.put(b, Entry(error=err if e is None or e.error is None
                                        else e.error))
            else:   # the same buffer under the output's id: the client drops the input's
                self.store.put(b, Entry(e.tensor, None, e.nbytes, e.origin, None,
                                        e.shards, e.done))

    def _fuse(self, seg, op) -> bool:
        """Add an execution to ``seg`` (launched at ``_flush``); False for an op that
        must run on its own: not an execution, donating, malformed or too big."""
        if op.WhichOneof("kind") != "execute":
            return False
        x = op.execute
        prog = self.programs.get(x.program_id)
        if prog is None or x.donate or not seg.takes(prog):
            return False
        # What validate.check_execute checks, on the segment's outputs too; anything
        # odd runs alone, where it is checked and reported.
        entries = self.store.entries
        outputs, avals = x.outputs, prog.in_avals
        if len(x.inputs) != len(avals) or len(outputs) != len(prog.out_avals):
            return False
        for b in outputs:
            if seg.produced(b) is not None or b in entries:
                return False
        if len(outputs) > 1 and len(set(outputs)) != len(outputs):
            return False
        sources = []
        for b, aval in zip(x.inputs, avals):
            here = seg.produced(b)
            if here is not None:
                if seg.aval(here) != aval:
                    return False
                sources.append(here)
                continue
            e = entries.get(b)
            if e is None or e.pending is not None or e.error is not None or e.donated:
                return False
            t = e.tensor
            if t is None or t.dtype != aval[0] or t.shape != aval[1]:
                return False
            sources.append(seg.source(b, t))
        if self.store.device_bytes + seg.device_bytes + prog.out_device_bytes > self.budget:
            return False
        seg.add(prog, tuple(sources), outputs)
        return True

    def _flush(self, seg) -> None:
        """Launch ``seg``'s executions as one computation: its cached executable when
        this run was launched before, else traced (and its launch plan kept). Their
        outputs (or the failure) enter the store only now."""
        if not seg.count:
            return
        X = self.torch_xla._XLAC
        key = tuple(seg.key)
        plans = self._fusion.plans
        try:
            plan = plans.get(key)
            outs = self._launch_plan(plan, seg.ext) if plan is not None else None
            if outs is not None:
                self.cached_launches += 1
            else:
                if plan is not None:
                    del plans[key]          # evicted from torch_xla's cache: plan again
                outs, starts = [], []
                for prog, sources, _ in seg.ops:
                    args = [seg.ext[s] if s.__class__ is int else outs[starts[s[0]] + s[1]]
                            for s in sources]
                    starts.append(len(outs))
                    outs.extend(self._run(prog, args))
                if key in plans:            # None: this run cannot be launched cached
                    plan = None
                else:
                    plans[key] = plan = None if self.spmd else self._plan_of(outs, seg.ext)
                if plan is not None:
                    X._xla_warm_up_cache(outs, [])
                    launched = self._launch_plan(plan, seg.ext)
                    if launched is None:
                        plans[key] = None
                        X._xla_sync_multi(outs, [], wait=False)
                    else:
                        outs = launched
                        self.cached_launches += 1
                else:
                    X._xla_sync_multi(outs, [], wait=False)
            if self._in_gang:
                X._xla_wait_device_ops([])
        except Exception as e:  # noqa: BLE001
            names = seg.names()
            err = self._err("program", f"programs {names} (run fused, as a recorded "
                            f"graph) failed on {self.where}: {type(e).__name__}: {e}",
                            names)
            for b, _ in seg.outputs():
                self.store.put(b, Entry(error=err))
            return
        put = self.store.put
        at = 0
        for prog, _, ids in seg.ops:
            for b, o, n, k in zip(ids, outs[at:at + len(ids)], prog.out_nbytes,
                                  prog.out_shards):
                # (inside a gang op: waited for above)
                put(b, Entry(o, None, n, prog.name, None, k, self._in_gang))
            at += len(ids)
        self.executed += seg.count
        self._fusion.launches += 1
        self._fusion.programs += seg.count

    def _launch(self, prog, inputs):
        """``prog``'s cached executable launched on ``inputs`` (its outputs), or None
        after forgetting the plan when torch_xla no longer has it (its compilation cache
        is an LRU): the call is then traced, as the first one was."""
        out = self._launch_plan(prog.cached, inputs)
        if out is None:
            prog.cached = None
        else:
            self.cached_launches += 1
        return out

    def _invalid(self, op, which):
        """Why an op of the stream is malformed (a validate.InvalidMessage), or None.
        Puts are checked chunk by chunk in _put_now."""
        V = validate
        try:
            if which == "execute":
                x = op.execute
                V.check_execute(x, self.programs.get(x.program_id), self.store.entries)
            elif which == "recv":
                V.check_recv(op.recv, self.axis_names, self._cap(),
                             self.store.entries.__contains__)
            elif which == "send":
                V.check_send(op.send)
            elif which == "save":
                V.check_save(op.save, self.store.entries.__contains__)
            elif which == "load":
                V.check_load(op.load, self.axis_names, self._cap(),
                             self.store.entries.__contains__)
            elif which == "batch":
                V.check_new_ids(op.batch.outputs, self.store.entries.__contains__,
                                "a loader batch")
            elif which == "gang":
                raise V.InvalidMessage("a gang op inside a gang op (graphs do not nest)")
            elif which is None:
                raise V.InvalidMessage("an op with no kind")
        except V.InvalidMessage as e:
            return e
        return None

    def _reject(self, which, ids, e, recv=None) -> None:
        """A malformed op: its outputs fail with ``e`` (kind "input", or "oom"), except
        ids of live buffers, which keep their value; an op without outputs is dropped."""
        if not ids:
            log.warning("dropped a malformed %s op on %s: %s", which, self.where, e)
            return
        err = self._err(e.kind, f"refused a malformed {which or 'empty'} op: {e}")
        live = self.store.entries
        if recv is not None and ids[0] not in live:
            self._discard_recv(recv)                # its bytes may still come
        for b in ids:
            if b not in live:
                self.store.put(b, Entry(error=err))

    def _queued(self, kind: str, msg, index, t_in: int) -> None:
        """Record how long an op waited between its arrival and its start (profiling)."""
        program, which = "", kind
        if kind == "op":
            which = msg.WhichOneof("kind")
            if which == "release":
                return
            if which == "execute":
                prog = self.programs.get(msg.execute.program_id)
                program = prog.name if prog is not None else ""
        else:
            program = msg.name
        self.rec.add("queue", program or which, t_in, detail=which, program=program)
