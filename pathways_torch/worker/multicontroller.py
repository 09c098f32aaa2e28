"""A host's part of a slice that spans hosts on TPU and GPU: torch_xla multi-controller SPMD.

On TPU and GPU, torch_xla already runs one SPMD program over several hosts: one process
per host, ``xr.use_spmd()``, a mesh over ``xr.global_runtime_device_count()`` devices,
and collectives over ICI/NVLink and the data-centre network, found through environment
variables the PJRT client reads at start. ``TorchXlaRuntime`` sets those for one member
of a slice and answers what a member executor (``worker/member.py``) asks, as
``MultiHostRuntime`` (jaxlib + gloo) does on CPU:

- GPU (``PJRT_DEVICE=CUDA``): ``RANK``/``WORLD_SIZE`` (this host among the slice's),
  ``LOCAL_RANK``/``PJRT_LOCAL_PROCESS_RANK`` = 0 and ``LOCAL_WORLD_SIZE`` = 1 (one
  process drives every local GPU, as torch_xla's GPU SPMD wants), ``MASTER_ADDR`` and
  ``XLA_COORDINATOR_PORT`` (member 0's rendezvous), ``CUDA_VISIBLE_DEVICES`` (the
  slice's devices on this host).
- TPU (``PJRT_DEVICE=TPU``): ``TPU_WORKER_ID`` (this host), ``TPU_WORKER_HOSTNAMES``
  (every member's host, in order), ``TPU_PROCESS_BOUNDS`` ("1,1,N": the hosts in a
  line), ``TPU_CHIPS_PER_PROCESS_BOUNDS`` (the local chips), ``TPU_VISIBLE_CHIPS``,
  ``TPU_PROCESS_PORT``/``TPU_PROCESS_ADDRESSES`` (member 0's rendezvous first).

Global device ids are host-major (host ``k`` holds ids ``k*L .. k*L+L-1``), which is how
both PJRT plugins number a multi-process client; ``check_device_order`` verifies it at
start, because the slice's mesh relies on it.

The same code runs on CPU with one host (``num_processes=1``), which is how
``tests/test_multicontroller.py`` checks the parts that do not need a second host: the
compile, the puts from blocks, the runs, the shard reads. The two-host check needs an
accelerator machine: ``docs/architecture.md`` (Decision 18) gives the script.

Example::

    rt = TorchXlaRuntime("10.0.0.1:8547", num_processes=2, process_id=rank,
                         local_devices=4, member_hosts=["10.0.0.1", "10.0.0.2"])
    mesh = rt.mesh((2, 4), ("data", "model"))
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..sharding import P, member_blocks, spec_candidates
from ..rpc.validate import hlo_shapes
from .multihost import MultiHostError


def multicontroller_env(kind: str, rendezvous: str, num_processes: int, process_id: int,
                        devices: Sequence[int], member_hosts: Sequence[str]
                        ) -> Dict[str, str]:
    """The environment torch_xla's PJRT client reads to join a multi-host SPMD program
    as host ``process_id`` of ``num_processes``, using local ``devices``."""
    host, _, port = rendezvous.rpartition(":")
    kind = kind.upper()
    local = ",".join(str(d) for d in devices)
    if kind in ("CUDA", "GPU"):
        return {"PJRT_DEVICE": "CUDA", "RANK": str(process_id),
                "WORLD_SIZE": str(num_processes), "LOCAL_RANK": "0",
                "PJRT_LOCAL_PROCESS_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": host, "XLA_COORDINATOR_PORT": port,
                "CUDA_VISIBLE_DEVICES": local}
    if kind == "TPU":
        hosts = list(member_hosts) or [host] * num_processes
        return {"PJRT_DEVICE": "TPU", "TPU_WORKER_ID": str(process_id),
                "TPU_WORKER_HOSTNAMES": ",".join(h.rpartition(":")[0] or h for h in hosts),
                "TPU_PROCESS_BOUNDS": f"1,1,{num_processes}",
                "TPU_CHIPS_PER_PROCESS_BOUNDS": f"1,1,{len(devices)}",
                "TPU_VISIBLE_CHIPS": local, "TPU_PROCESS_PORT": port,
                "TPU_PROCESS_ADDRESSES": ",".join(
                    f"{h.rpartition(':')[0] or h}:{port}" for h in hosts)}
    if kind == "CPU":
        if num_processes != 1:
            raise MultiHostError("torch_xla's CPU client has no collectives between "
                                 "processes: slices that span hosts run on jaxlib there "
                                 "(worker/multihost.py)")
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(len(devices))}
    raise MultiHostError(f"PJRT_DEVICE={kind}: no multi-host backend for it")


class TorchXlaProgram:
    def __init__(self, name: str, comp, out_shapes, out_specs, out_hlo, given) -> None:
        self.name, self.comp = name, comp
        self.out_shapes = out_shapes
        self.out_specs: List[Optional[P]] = out_specs
        self.out_hlo: List[str] = out_hlo
        self.given = given          # out specs to mark on results, or None


class TorchXlaRuntime:
    """This host's member of a slice that spans ``num_processes`` hosts, on torch_xla."""

    def __init__(self, rendezvous: str, num_processes: int, process_id: int,
                 local_devices: int, *, devices: Optional[Sequence[int]] = None,
                 member_hosts: Sequence[str] = (), kind: Optional[str] = None) -> None:
        kind = (kind or os.environ.get("PJRT_DEVICE", "CPU")).upper()
        devices = list(devices) if devices is not None else list(range(local_devices))
        os.environ.update(multicontroller_env(kind, rendezvous, num_processes, process_id,
                                              devices, member_hosts))
        import torch
        from .._xla import import_torch_xla
        torch_xla = import_torch_xla()
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr
        xr.use_spmd()
        self.torch, self.torch_xla, self.xs, self.xr = torch, torch_xla, xs, xr
        self.device = torch_xla.device()
        self.num_processes, self.process_id = num_processes, process_id
        self.local_devices = local_devices
        n = xr.global_runtime_device_count()
        if n != local_devices * num_processes:
            raise MultiHostError(f"torch_xla shows {n} devices; the slice has "
                                 f"{local_devices} on each of {num_processes} hosts")
        self.check_device_order()
        self._names = 0

    def check_device_order(self) -> None:
        """Global device ids must be host-major (see the module docstring)."""
        mine = sorted(int(d.split(":")[1]) for d in
                      self.torch_xla._XLAC._xla_get_runtime_devices())
        want = list(range(self.process_id * self.local_devices,
                          (self.process_id + 1) * self.local_devices))
        if mine != want:
            raise MultiHostError(f"host {self.process_id} holds devices {mine}, not "
                                 f"{want}: the PJRT plugin does not number devices "
                                 "host-major, and the slice's mesh assumes it")

    # ---------------------------------------------------------------- layout
    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]):
        return self.xs.Mesh(np.arange(int(np.prod(shape))), tuple(shape), tuple(axis_names))

    def _padded(self, spec: P, rank: int) -> tuple:
        entries = list(spec) + [None] * (rank - len(spec))
        return tuple(entries[:rank])

    def _spec_of(self, t, mesh) -> Tuple[Optional[P], str]:
        s = self.torch_xla._XLAC._get_xla_sharding_spec(t) or "{replicated}"
        if s == "{replicated}":
            return P(), s
        n = int(np.prod(mesh.mesh_shape))
        for cand in spec_candidates(t.dim(), mesh.axis_names):
            d = self.torch.zeros((n,) * t.dim()).to(self.device)
            self.xs.mark_sharding(d, mesh, self._padded(cand, t.dim()))
            if (self.torch_xla._XLAC._get_xla_sharding_spec(d) or "{replicated}") == s:
                return cand, s
        return None, s

    # ---------------------------------------------------------------- programs
    def compile(self, hlo_proto: bytes, in_specs: Sequence[P], mesh,
                out_specs: Optional[Sequence[Optional[P]]] = None) -> TorchXlaProgram:
        """Compile by running once on zeros (as a one-host executor does): that also
        says which shardings the partitioner chose for the results."""
        import torch_xla.core.xla_builder as xb
        self._names += 1
        name = f"xla::member_program_{self._names}"
        comp = xb.computation_from_module_proto(name, hlo_proto)
        shapes = hlo_shapes(hlo_proto)
        args = []
        for (dtype, shape), spec in zip(shapes[0], in_specs):
            t = self.torch.zeros(shape, dtype=_torch_dtype(self.torch, dtype)).to(self.device)
            self.xs.mark_sharding(t, mesh, self._padded(spec, len(shape)))
            args.append(t)
        prog = TorchXlaProgram(name, comp, [s for _, s in shapes[1]], [], [],
                               list(out_specs) if out_specs is not None else None)
        outs = self.run(prog, args)
        self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
        for k, o in enumerate(outs):
            spec, hlo = self._spec_of(o, mesh)
            if prog.given is not None and prog.given[k] is not None:
                spec = prog.given[k]
            prog.out_specs.append(spec)
            prog.out_hlo.append(hlo)
        prog.mesh = mesh
        return prog

    def run(self, prog: TorchXlaProgram, args: Sequence) -> List:
        outs = self.torch_xla._XLAC._xla_user_computation(prog.name, list(args), prog.comp)
        if prog.given is not None:
            for o, spec in zip(outs, prog.given):
                if spec is not None:
                    self.xs.mark_sharding(o, prog.mesh, self._padded(spec, o.dim()))
        self.torch_xla._XLAC._xla_sync_multi(outs, [], wait=False)
        return outs

    # ---------------------------------------------------------------- data
    def put(self, value: np.ndarray, spec: P, mesh):
        """A whole value every host gives in full (constants, small status values)."""
        t = self.torch.from_numpy(np.array(value, copy=True)).to(self.device)
        self.xs.mark_sharding(t, mesh, self._padded(spec, t.dim()))
        return t

    def from_blocks(self, shape: Sequence[int], spec: P, mesh, values: list,
                    where: List[int]):
        shards = [self.torch.from_numpy(np.array(values[k], copy=True)) for k in where]
        op = mesh.get_op_sharding(self._padded(spec, len(shape)))
        return self.torch_xla._XLAC._global_tensor_from_cpu_shards(shards, op,
                                                                   list(shape))

    def wait(self, t) -> None:
        self.torch_xla._XLAC._xla_sync_multi([t], [], wait=True)
        self.torch_xla._XLAC._xla_wait_device_ops([])

    def aval(self, t) -> Tuple[np.dtype, Tuple[int, ...]]:
        return _np_dtype(t.dtype), tuple(t.shape)

    def local_blocks(self, t) -> List[Tuple[Tuple[int, ...], np.ndarray]]:
        """(start, value) of each distinct shard on this host, by device."""
        X = self.torch_xla._XLAC
        shards = X._get_local_shards([t])[0]
        where = X._get_local_shard_replica_and_indices([t])[0]
        out: list = []
        for (data, _dev), (_replica, indices) in zip(shards, where):
            if indices is Ellipsis or not isinstance(indices, (list, tuple)):
                start, value = (0,) * t.dim(), data
            else:
                start = tuple(sl.start or 0 for sl in indices)
                value = data[tuple(slice(0, (sl.stop if sl.stop is not None else n) -
                                         (sl.start or 0))
                                   for sl, n in zip(indices, t.shape))]     # no padding
            if all(start != s for s, _ in out):
                out.append((start, _to_numpy(self.torch, value.cpu())))
        return out

    def blocks_by_host(self, t, mesh) -> List[list]:
        """The distinct blocks ((start, stop) per dimension) each host holds."""
        spec, _ = self._spec_of(t, mesh)
        if spec is None:
            # Not a partition spec: each host writes what it holds (duplicates are
            # harmless chunks of the same values).
            mine = [tuple((s, s + n) for s, n in zip(start, v.shape))
                    for start, v in self.local_blocks(t)]
            return [mine if k == self.process_id else [] for k in range(self.num_processes)]
        return [member_blocks(tuple(t.shape), spec, mesh.axis_names, mesh.mesh_shape, k,
                              self.num_processes)[0] for k in range(self.num_processes)]


def _torch_dtype(torch, name: str):
    from ..rpc import codec
    return codec.dtype_from_name(name)


def _np_dtype(dtype) -> np.dtype:
    from ..rpc import codec
    from .member import np_dtype
    return np_dtype(codec.dtype_name(dtype))


def _to_numpy(torch, t) -> np.ndarray:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
