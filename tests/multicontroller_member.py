"""One host of a slice on torch_xla's multi-controller runtime (worker/multicontroller.py),
on CPU with one process, for tests/test_multicontroller.py: the program in ``argv[1]``
(``module.pb``, ``p<i>.npy``, ``specs.txt``) put from per-host blocks, run twice, read
back from the local shards into ``out.npz``; the device order and a checkpoint's host
blocks are checked on the way. Prints DONE."""

import ast
import os
import sys

import numpy as np

from pathways_torch.sharding import P, member_blocks
from pathways_torch.worker.multicontroller import TorchXlaRuntime

where = sys.argv[1]
rt = TorchXlaRuntime("127.0.0.1:1", num_processes=1, process_id=0, local_devices=4,
                     kind="CPU")
mesh = rt.mesh((2, 2), ("data", "model"))
with open(os.path.join(where, "specs.txt")) as f:
    specs = [P(*s) for s in ast.literal_eval(f.read())]
params = [np.load(os.path.join(where, f"p{i}.npy")) for i in range(len(specs))]
prog = rt.compile(open(os.path.join(where, "module.pb"), "rb").read(), specs, mesh)
args = []
for v, s in zip(params, specs):
    blocks, at = member_blocks(v.shape, s, ("data", "model"), (2, 2), 0, 1)
    values = [v[tuple(slice(a, b) for a, b in blk)] for blk in blocks]
    args.append(rt.from_blocks(v.shape, s, mesh, values, at))
outs = rt.run(prog, args)
outs = rt.run(prog, args)
out = {}
for i, o in enumerate(outs):
    rt.wait(o)
    dtype, shape = rt.aval(o)
    full = np.zeros(shape, dtype)
    for start, value in rt.local_blocks(o):
        full[tuple(slice(a, a + n) for a, n in zip(start, value.shape))] = value
    out[f"o{i}"] = full
    held = rt.blocks_by_host(o, mesh)
    assert len(held) == 1 and held[0], held
out["specs"] = np.array([repr(s) for s in prog.out_specs])
np.savez(os.path.join(where, "out.npz"), **out)
print("DONE", [repr(s) for s in prog.out_specs], flush=True)
