"""One SPMD program over the devices of several hosts (issue 14, the backend).

torch_xla 2.9's CPU runtime has in-process collectives only, so a slice that spans hosts
runs on jaxlib's PJRT CPU client instead. Its collectives go over gloo and its processes
meet through ``jax.distributed`` (Decision 18 in docs/architecture.md). Each host of a
slice runs one ``MultiHostRuntime``, and all of them:

1. ``compile`` the same HLO module proto, the one the client captured with torch_xla
   (Decision 1). It is converted to StableHLO, and its parameters and results are marked
   with the slice's shardings. It is compiled for one global device assignment, with
   GSPMD as the partitioner: Shardy ignores ``mhlo.sharding`` attributes;
2. ``put`` only the shards their own devices hold;
3. ``run`` it in the same order as every other member. Collectives between hosts block
   until every member has joined, and that is why the gang order matters;
4. read back only their own shards (``local_shards``).

The device kind comes from ``PJRT_DEVICE``. On TPU and GPU, torch_xla is already
multi-controller (one process per host, ``xr.use_spmd()``), and that backend is not this
module: ``MultiHostRuntime`` refuses those kinds with a clear error.

Example (each of two processes, ``rank`` 0 and 1)::

    rt = MultiHostRuntime("10.0.0.1:7070", num_processes=2, process_id=rank,
                          local_devices=2)
    mesh = rt.mesh((2, 2), ("data", "model"))      # the host-spanning axis is outer
    prog = rt.compile(hlo_proto, [P("data"), P()], mesh)
    x = rt.put(x_np, P("data"), mesh)              # this host's shards only
    (loss,) = rt.run(prog, [x, w])
"""

from __future__ import annotations

import os
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import PathwaysError
from ..sharding import P


class MultiHostError(PathwaysError):
    """A slice that spans hosts cannot be set up or has lost a member."""


class MultiHostProgram:
    """A compiled program of a multi-host slice: the executable, its shardings and its
    results' global shapes; ``out_specs`` (a ``P``, or None where GSPMD chose a
    sharding that is no partition spec) and ``out_hlo`` (the HLO sharding text) say
    what the results are, as a one-host executor's CompileReply does."""

    def __init__(self, exe, in_shardings: list, out_shardings: list,
                 out_shapes: List[tuple]) -> None:
        self.exe = exe
        self.in_shardings = in_shardings
        self.out_shardings = out_shardings
        self.out_shapes = out_shapes
        self.out_specs: List[Optional[P]] = []
        self.out_hlo: List[str] = []


class MultiHostRuntime:
    """This host's member of a slice that spans ``num_processes`` hosts.

    ``coordinator``: ``host:port`` of the rendezvous that member 0 serves (every member
    gives the same). ``local_devices``: the devices of this host in the slice; every
    member has the same number. Global devices are ordered host-major, so the first axis
    of a mesh spans hosts.
    """

    def __init__(self, coordinator: str, num_processes: int, process_id: int,
                 local_devices: int, *, heartbeat_timeout_s: int = 10,
                 init_timeout_s: int = 60) -> None:
        kind = os.environ.get("PJRT_DEVICE", "CPU").upper()
        if kind != "CPU":
            raise MultiHostError(
                f"PJRT_DEVICE={kind}: slices that span hosts run on jaxlib's CPU client "
                "here; on TPU and GPU they run as torch_xla multi-controller "
                "(docs/architecture.md, Decision 18)")
        if not 0 <= process_id < num_processes:
            raise MultiHostError(f"process_id {process_id} is not in [0, {num_processes})")
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={local_devices}".strip())
        import jax
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_enable_x64", True)      # int64 and float64 stay 64-bit
        try:
            jax.distributed.initialize(
                coordinator, num_processes=num_processes, process_id=process_id,
                initialization_timeout=init_timeout_s,
                heartbeat_timeout_seconds=heartbeat_timeout_s)
        except Exception as e:      # noqa: BLE001 (jaxlib's errors are untyped)
            raise MultiHostError(
                f"member {process_id} of {num_processes} could not meet the others at "
                f"{coordinator} within {init_timeout_s} s: {e}") from None
        from jax._src import xla_bridge
        self.jax = jax
        self.backend = xla_bridge.get_backend("cpu")
        self.process_id, self.num_processes = process_id, num_processes
        self.devices = sorted(self.backend.devices(),
                              key=lambda d: (d.process_index, d.id))
        self.local = [d for d in self.devices if d.process_index == process_id]
        if len(self.local) != local_devices or len(self.devices) != (
                local_devices * num_processes):
            raise MultiHostError(
                f"expected {local_devices} devices on each of {num_processes} hosts, "
                f"found {len(self.local)} here and {len(self.devices)} in all")

    # ---------------------------------------------------------------- layout
    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]):
        """A mesh over every device of the slice, host-major."""
        from jax.sharding import Mesh
        if int(np.prod(shape)) != len(self.devices):
            raise MultiHostError(f"a mesh of shape {tuple(shape)} needs "
                                 f"{int(np.prod(shape))} devices; the slice has "
                                 f"{len(self.devices)}")
        return Mesh(np.array(self.devices, dtype=object).reshape(tuple(shape)),
                    tuple(axis_names))

    def sharding(self, spec: P, mesh):
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec
        return NamedSharding(mesh, PartitionSpec(*tuple(spec)))

    # ---------------------------------------------------------------- programs
    def compile(self, hlo_proto: bytes, in_specs: Sequence[P], mesh,
                out_specs: Optional[Sequence[Optional[P]]] = None) -> MultiHostProgram:
        """Compile torch_xla's HLO module proto for the slice.

        ``in_specs``: one spec per HLO parameter, in the module's parameter order.
        ``out_specs``: one per result, None to let GSPMD propagate (the default)."""
        from jax._src.interpreters import mlir
        from jax._src.lib import xla_client as xc
        from jax._src.lib.mlir import ir
        from jaxlib import _jax
        in_sh = [self.sharding(s, mesh) for s in in_specs]
        out_sh = None if out_specs is None else [
            None if s is None else self.sharding(s, mesh) for s in out_specs]
        text, ranks, out_shapes = _annotated(_jax.mlir.hlo_to_stablehlo(hlo_proto),
                                             in_sh, out_sh, mlir, ir)
        n = len(self.devices)
        opts = xc.CompileOptions()
        opts.num_replicas, opts.num_partitions = 1, n
        assignment = xc.DeviceAssignment.create(np.array([[d.id for d in self.devices]]))
        opts.device_assignment = assignment
        build = opts.executable_build_options
        build.num_replicas, build.num_partitions = 1, n
        build.use_spmd_partitioning = True
        build.use_shardy_partitioner = False
        build.device_assignment = assignment
        exe = self.backend.compile_and_load(text, xc.DeviceList(tuple(self.devices)), opts)
        from jax._src.sharding_impls import GSPMDSharding
        chosen = exe.get_output_shardings()     # GSPMD's, where no spec was given
        given = out_specs
        out_sh = [GSPMDSharding(tuple(self.devices), chosen[i])
                  if out_sh is None or out_sh[i] is None else out_sh[i]
                  for i in range(len(out_shapes))]
        prog = MultiHostProgram(exe, in_sh, out_sh, out_shapes)
        for k, (shape, sh) in enumerate(zip(out_shapes, out_sh)):
            spec = given[k] if given is not None and given[k] is not None else \
                self._spec_of(sh, len(shape), mesh)
            prog.out_specs.append(spec)
            prog.out_hlo.append(str(sh._to_xla_hlo_sharding(len(shape))))
        return prog

    def _spec_of(self, sharding, rank: int, mesh) -> Optional[P]:
        """The partition spec a sharding GSPMD chose is, or None."""
        from ..sharding import spec_candidates
        want = sharding._to_xla_hlo_sharding(rank)
        if want.is_replicated():
            return P()
        for cand in spec_candidates(rank, mesh.axis_names):
            if self.sharding(cand, mesh)._to_xla_hlo_sharding(rank) == want:
                return cand
        return None

    def put(self, value_or_shard: "np.ndarray | Callable[[tuple], np.ndarray]",
            spec: P, mesh, shape: Optional[Tuple[int, ...]] = None):
        """A global array from this host's shards only.

        ``value_or_shard``: the whole value (its shards are cut here), or a function
        from a shard's index (a tuple of slices) to that shard, with ``shape``: the
        global shape. Either way only this host's devices receive bytes."""
        sh = self.sharding(spec, mesh)
        if callable(value_or_shard):
            if shape is None:
                raise MultiHostError("put(fn, ...) needs the global shape=")
            shard_of = value_or_shard
        else:
            shape = value_or_shard.shape
            shard_of = value_or_shard.__getitem__
        index = sh.addressable_devices_indices_map(tuple(shape))
        shards = [self.jax.device_put(_contiguous(shard_of(index[d])), d)
                  for d in self.local if d in index]
        return self.jax.make_array_from_single_device_arrays(tuple(shape), sh, shards)

    def run(self, prog: MultiHostProgram, args: Sequence) -> List:
        """Start ``prog`` on global arrays and return its results without waiting
        (``ready`` waits). Every member must run the same programs in the same order."""
        try:
            res = prog.exe.execute_sharded(list(args))
            per_output = res.disassemble_into_single_device_arrays()
        except Exception as e:      # noqa: BLE001 (jaxlib's errors are untyped)
            raise MultiHostError(f"the program failed on member {self.process_id} of "
                                 f"{self.num_processes}: {e}") from None
        return [self.jax.make_array_from_single_device_arrays(shape, sh, shards)
                for shape, sh, shards in zip(prog.out_shapes, prog.out_shardings,
                                              per_output)]

    def ready(self, arrays: Sequence) -> None:
        """Block until ``arrays`` are computed. Execution is asynchronous, so this is
        where a collective whose peer died raises: as ``MultiHostError``, at once
        (gloo sees the closed connection). The coordination service then ends this
        process within its heartbeat timeout, because a slice that spans hosts is one
        failure domain, so report the error first."""
        try:
            for a in arrays:
                a.block_until_ready()
        except Exception as e:      # noqa: BLE001 (jaxlib's errors are untyped)
            raise MultiHostError(f"member {self.process_id} of {self.num_processes}: a "
                                 f"program of the slice failed: {e}") from None

    @staticmethod
    def local_shards(arr) -> List[Tuple[tuple, np.ndarray]]:
        """(index, value) of every shard of ``arr`` on this host's devices."""
        return [(s.index, np.asarray(s.data)) for s in arr.addressable_shards]

    # ------------------------------------------------ what a member executor asks
    # (worker/member.py; worker/multicontroller.py answers the same on TPU and GPU)
    def from_blocks(self, shape: Sequence[int], spec: P, mesh, values: list,
                    where: List[int]):
        """The global array whose local device ``i`` holds ``values[where[i]]``."""
        local = [self.jax.device_put(_contiguous(values[k]), d)
                 for k, d in zip(where, self.local)]
        return self.jax.make_array_from_single_device_arrays(
            tuple(shape), self.sharding(spec, mesh), local)

    @staticmethod
    def wait(arr) -> None:
        """Block until ``arr`` is computed; raises what its computation raised."""
        arr.block_until_ready()

    @staticmethod
    def aval(arr) -> Tuple[np.dtype, Tuple[int, ...]]:
        return np.dtype(arr.dtype), tuple(arr.shape)

    @staticmethod
    def local_blocks(arr) -> List[Tuple[Tuple[int, ...], np.ndarray]]:
        """(start, value) of each distinct shard on this host, by device."""
        out: list = []
        for s in sorted(arr.addressable_shards, key=lambda s: s.device.id):
            start = tuple(sl.start or 0 for sl in s.index)
            if all(start != t for t, _ in out):
                out.append((start, _contiguous(np.asarray(s.data))))
        return out

    def blocks_by_host(self, arr, mesh=None) -> List[list]:
        """The distinct blocks ((start, stop) per dimension) each host holds."""
        held: List[list] = [[] for _ in range(self.num_processes)]
        for d, index in sorted(arr.sharding.devices_indices_map(arr.shape).items(),
                               key=lambda t: (t[0].process_index, t[0].id)):
            blk = tuple((sl.start or 0, n if sl.stop is None else sl.stop)
                        for sl, n in zip(index, arr.shape))
            if blk not in held[d.process_index]:
                held[d.process_index].append(blk)
        return held

    def shutdown(self) -> None:
        self.jax.distributed.shutdown()


def _contiguous(value) -> np.ndarray:
    value = np.asarray(value)
    return np.ascontiguousarray(value).reshape(value.shape)     # keeps a 0-d shape


def _annotated(bytecode: bytes, in_sh, out_sh, mlir, ir):
    """The StableHLO text of ``bytecode`` with ``mhlo.sharding`` on main's parameters
    (and on the results whose sharding is given); returns (text, parameter ranks,
    results' global shapes)."""
    with mlir.make_ir_context():
        mod = ir.Module.parse(bytecode)
        main = next(op for op in mod.body.operations
                    if ir.StringAttr(op.attributes["sym_name"]).value == "main")
        ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
        ins = [ir.RankedTensorType(t) for t in ftype.inputs]
        outs = [ir.RankedTensorType(t) for t in ftype.results]
        if len(ins) != len(in_sh):
            raise MultiHostError(f"the program has {len(ins)} parameters; "
                                 f"{len(in_sh)} specs were given")
        if out_sh is not None and len(out_sh) != len(outs):
            raise MultiHostError(f"the program has {len(outs)} results; "
                                 f"{len(out_sh)} out_specs were given")

        def attrs(sharding, t):
            if sharding is None:
                return ir.DictAttr.get({})
            hlo = str(sharding._to_xla_hlo_sharding(t.rank))
            return ir.DictAttr.get({"mhlo.sharding": ir.StringAttr.get(hlo)})

        main.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [attrs(s, t) for s, t in zip(in_sh, ins)])
        if out_sh is not None:
            main.attributes["res_attrs"] = ir.ArrayAttr.get(
                [attrs(s, t) for s, t in zip(out_sh, outs)])
        return str(mod), [t.rank for t in ins], [tuple(t.shape) for t in outs]
