"""Compiling a program on an executor, and launching it: traced once on placeholders,
compiled under torch_xla's graph hash, later launched from the cache without tracing
(docs/architecture.md, Decisions 3 and 20).

Example (what ``Compile`` does)::

    reply = service._compile(request)      # service.programs[request.program_id] is set
"""

from __future__ import annotations

import logging
import os
import re
import time

from ..rpc import codec
from ..sharding import spec_from_proto, spec_to_proto
from .memory import gib

log = logging.getLogger("pathways.executor")


class _Program:
    __slots__ = ("name", "xla_name", "comp", "params", "constants", "out_specs", "out_bytes",
                 "out_nbytes", "out_shards", "donate", "out_device_bytes", "in_avals",
                 "cached", "hlo_bytes", "out_avals", "program_id")

    def __init__(self, name, xla_name, comp, params, constants, out_specs):
        self.donate = ()
        self.in_avals = []            # (torch dtype, shape) of each flat input
        self.out_bytes = 0
        self.out_nbytes = []
        self.out_device_bytes = 0     # bytes its outputs take on each device
        self.out_shards = []
        self.name = name
        self.xla_name = xla_name
        self.comp = comp
        self.params = params          # list of ("i", k) or ("c", k)
        self.constants = constants    # device tensors
        self.out_specs = out_specs    # list of spec tuples, or None
        # (graph hash, feed) for torch_xla's _run_cached_graph: the compiled executable
        # launched without re-tracing; feed: per HLO parameter, an input position (>= 0)
        # or -1 and the constant's device tensor. None: trace each call.
        self.cached = None
        self.hlo_bytes = 0            # the size of its HLO (fused runs are capped by it)
        self.out_avals = []           # (torch dtype, shape) of each output
        self.program_id = ""


class Programs:
    """Compile and launch programs (a mixin of ExecutorService)."""

    def _compile(self, req):
        import torch_xla.core.xla_builder as xb
        t0 = time.perf_counter()
        torch, dev = self.torch, self.device
        xla_name = "xla::" + (re.sub(r"\W", "_", req.name) or "program")
        comp = xb.computation_from_module_proto(req.name or "program", req.hlo)
        constants = [codec.from_bytes(c.data, c.meta.dtype, c.meta.shape).to(dev)
                     for c in req.constants]
        params = [("i", p.input) if p.WhichOneof("source") == "input" else ("c", p.constant)
                  for p in req.params]
        out_specs = ([tuple(spec_from_proto(s)) for s in req.out_specs]
                     if req.has_out_specs else None)
        prog = _Program(req.name, xla_name, comp, params, constants, out_specs)
        prog.donate = tuple(req.donate)
        prog.hlo_bytes = len(req.hlo)
        prog.program_id = req.program_id
        prog.in_avals = [(codec.dtype_from_name(m.dtype), tuple(m.shape))
                         for m in req.inputs]

        def placeholders():
            out = []
            for meta, spec in zip(req.inputs, req.input_specs):
                cpu = torch.zeros(tuple(meta.shape), dtype=codec.dtype_from_name(meta.dtype))
                if self.spmd:
                    t = cpu.to(dev)
                    self._shard(t, spec_from_proto(spec))
                else:
                    t = self._device_data(cpu)     # a parameter, even a 0-dim zero
                out.append(t)
            # donated like the real inputs, so the cached executable aliases the same way
            self._mark_donated(out, prog.donate)
            return out

        for attempt in range(2):
            ph = placeholders()
            outs = self._run(prog, ph)
            plan = self._cached_plan(prog, ph, outs)
            prog.out_nbytes = [codec.nbytes(o.dtype, o.shape) for o in outs]
            prog.out_avals = [(o.dtype, tuple(o.shape)) for o in outs]
            prog.out_bytes = sum(prog.out_nbytes)
            # Not yet knowing the shardings, refuse only what no sharding could fit.
            if out_specs is None and prog.out_bytes > self.budget * len(self.mesh.device_ids):
                raise MemoryError(self._oom_text(prog, prog.out_bytes))
            try:
                if out_specs is not None or plan is not None:
                    # Output shardings are given (or trivial): compile only, under the
                    # graph hash that _run_cached_graph looks up.
                    self.torch_xla._XLAC._xla_warm_up_cache(outs, [])
                else:
                    # Run once on zeros to learn the shardings XLA's propagation chose.
                    self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
                break
            except RuntimeError:
                # A wait reports the failure of an *earlier* asynchronous execution on
                # these devices (that failure is its own program's, reported with it).
                if attempt:
                    raise
        if plan is not None:
            prog.cached = self._check_plan(plan, ph, len(outs))
        reply = self.pb.CompileReply()
        for o in outs:
            spec, hlo = self._spec_of(o)
            prog.out_shards.append(self._shards(spec) if spec is not None else 1)
            spec_to_proto(spec if spec is not None else (), reply.out_specs.add())
            reply.out_spec_known.append(spec is not None)
            reply.out_hlo_shardings.append(hlo)
        prog.out_device_bytes = sum(n // k for n, k in zip(prog.out_nbytes, prog.out_shards))
        if self.plans is not None:
            planned = self.plans.record(req.hlo)
            self.planned_bytes[req.name] = max(planned, self.planned_bytes.get(req.name, 0))
        self.programs[req.program_id] = prog
        self.compiles += 1
        reply.compile_s = time.perf_counter() - t0
        rec = self.rec
        if rec.on:
            end = rec.now()
            rec.add("compile", req.name, end - int(reply.compile_s * 1e9), end,
                    program=req.name)
        return reply

    def _cached_plan(self, prog: _Program, ph: list, outs: list):
        """How to launch ``prog``'s executable again without tracing it (before
        ``outs`` are synced): its graph hash and where each HLO parameter comes from.
        Tracing a call (``_xla_user_computation`` then a sync) costs ~35 µs here, a
        cached launch ~24 µs (docs/architecture.md, Decision 20); an optimizer update
        over 48 parameters, donating them and their state, 7-12 ms against a launch.
        Only for one-device slices: a sharded input whose layout differs from the
        placeholder's needs torch_xla's checks on each call. A donating program's
        executable aliases its donated inputs with outputs (the executor enables
        torch_xla's buffer-donor aliasing), so it is launched only when a call donates
        exactly those inputs (``_execute``)."""
        if self.spmd:
            return None
        return self._plan_of(outs, ph)

    def _plan_of(self, outs: list, inputs: list):
        """(graph hash, feed) of the traced ``outs`` whose graph parameters are
        ``inputs`` (device data) and constants; None when some input is not one."""
        if os.environ.get("PATHWAYS_CACHED_LAUNCH") == "0":
            return None
        X = self.torch_xla._XLAC
        try:
            graph_hash = X._get_graph_hash(outs)
            ids, values = X._get_tensors_xla_device_data_node(outs)
        except Exception:       # noqa: BLE001 (an API this torch_xla lacks: trace)
            return None
        position = {X._xla_get_tensor_id(t): k for k, t in enumerate(inputs)}
        feed = [(position.get(i, -1), v) for i, v in zip(ids, values)]
        # An input that is not a parameter of the graph is unused (XLA dropped it: a
        # stage backward that reads its forward's saved activations instead of the
        # recomputed ones), unless it is a scalar: a 0-dim 0 or 1 that reached the
        # device by ``.to(device)`` is a constant folded into the graph (store buffers
        # come from ``_device_data`` and are not; the guard stays for any that do not).
        fed = {k for k, _ in feed if k >= 0}
        if any(k not in fed and inputs[k].dim() == 0 for k in range(len(inputs))):
            return None
        return graph_hash, feed

    def _check_plan(self, plan, ph: list, n_outs: int):
        """``plan`` when one launch on the placeholders gives ``n_outs`` outputs."""
        got = self._launch_plan(plan, ph)
        return plan if got is not None and len(got) == n_outs else None

    def _launch_plan(self, plan, inputs):
        """The outputs of launching ``plan`` (graph hash, feed) on ``inputs``, or None
        when torch_xla no longer has its executable (its compilation cache is an LRU)."""
        try:
            return self.torch_xla._XLAC._run_cached_graph(
                plan[0], [inputs[k] if k >= 0 else v for k, v in plan[1]])
        except RuntimeError as e:
            log.warning("a cached launch failed (%s); tracing instead", e)
            return None

    def _run(self, prog: _Program, inputs):
        args = [inputs[k] if src == "i" else prog.constants[k] for src, k in prog.params]
        outs = self.torch_xla._XLAC._xla_user_computation(prog.xla_name, args, prog.comp)
        if prog.out_specs is not None and self.spmd:
            for o, spec in zip(outs, prog.out_specs):
                self.xs.mark_sharding(o, self.mesh, self._padded(spec, o.dim()))
        return outs

    def _mark_donated(self, tensors, positions) -> None:
        for k in positions:
            self.torch_xla._XLAC._set_buffer_donation(tensors[k], True)

    def _oom_text(self, prog, asked: int) -> str:
        return (f"program '{prog.name}' needs {gib(asked)} per device for its outputs, but "
                f"the buffer budget of {self.where} is {gib(self.budget)} per device "
                f"({gib(self._free())} free now); use a bigger slice, shard the outputs, or "
                "raise the budget (pw.init(memory_budget=...), pathways-run --worker "
                "--memory-budget)")
