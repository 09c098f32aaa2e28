"""One host of a slice on torch_xla's multi-controller runtime (worker/multicontroller.py),
for tests/test_multicontroller.py (CPU, one host) and bench/device_multihost.py (TPU or
GPU, one or more hosts): the program in ``argv[1]`` (``module.pb``, ``p<i>.npy``,
``specs.txt``) put from this host's blocks, run twice, this host's shards written to
``out<rank>.npz``; the device order and a checkpoint's host blocks are checked on the
way. argv: directory [rendezvous rank hosts devices-per-host kind]. Prints DONE."""

import ast
import os
import sys

import numpy as np

from pathways_torch.sharding import P, member_blocks
from pathways_torch.worker.multicontroller import TorchXlaRuntime

where = sys.argv[1]
rendezvous, rank, hosts, local, kind = (sys.argv[2:] + ["127.0.0.1:1", "0", "1", "4",
                                                        "CPU"][len(sys.argv) - 2:])
rank, hosts, local = int(rank), int(hosts), int(local)
rt = TorchXlaRuntime(rendezvous, num_processes=hosts, process_id=rank, local_devices=local,
                     devices=range(rank * local, (rank + 1) * local)
                     if kind.upper() in ("CUDA", "GPU") else range(local), kind=kind)
shape = (hosts * local // 2, 2) if hosts * local >= 2 else (1, 1)
mesh = rt.mesh(shape, ("data", "model"))
with open(os.path.join(where, "specs.txt")) as f:
    specs = [P(*s) for s in ast.literal_eval(f.read())]
params = [np.load(os.path.join(where, f"p{i}.npy")) for i in range(len(specs))]
prog = rt.compile(open(os.path.join(where, "module.pb"), "rb").read(), specs, mesh)
args = []
for v, s in zip(params, specs):
    blocks, at = member_blocks(v.shape, s, ("data", "model"), shape, rank, hosts)
    values = [v[tuple(slice(a, b) for a, b in blk)] for blk in blocks]
    args.append(rt.from_blocks(v.shape, s, mesh, values, at))
outs = rt.run(prog, args)
outs = rt.run(prog, args)
out = {}
for i, o in enumerate(outs):
    rt.wait(o)
    dtype, oshape = rt.aval(o)
    full = np.full(oshape, np.nan, dtype) if dtype.kind == "f" else np.zeros(oshape, dtype)
    for start, value in rt.local_blocks(o):
        full[tuple(slice(a, a + n) for a, n in zip(start, value.shape))] = value
    out[f"o{i}"] = full              # NaN where another host holds the values
    held = rt.blocks_by_host(o, mesh)
    assert len(held) == hosts and held[rank], held
out["specs"] = np.array([repr(s) for s in prog.out_specs])
np.savez(os.path.join(where, f"out{rank}.npz"), **out)
print("DONE", [repr(s) for s in prog.out_specs], flush=True)
