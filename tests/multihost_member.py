"""One member of a two-host slice for tests/test_multihost.py (a real process each).

argv: rendezvous address, process id, a directory holding ``module.pb`` and ``p<i>.npy``
(the program's parameters in HLO order) and ``specs.txt`` (their partition specs), and
what to do: ``run`` (three steps, then this member's
output shards to ``out<id>.npz``) or ``die`` (member 1 exits after the first step; member
0 tries a second and prints what it raised).
"""

import ast
import os
import sys
import time

import numpy as np

from pathways_torch.sharding import P
from pathways_torch.worker.multihost import MultiHostError, MultiHostRuntime

address, rank, where, what = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rt = MultiHostRuntime(address, num_processes=2, process_id=rank, local_devices=2,
                      heartbeat_timeout_s=5)
mesh = rt.mesh((2, 2), ("data", "model"))        # "data" spans the two hosts
with open(os.path.join(where, "specs.txt")) as f:
    specs = [P(*s) for s in ast.literal_eval(f.read())]     # one per HLO parameter
params = [np.load(os.path.join(where, f"p{i}.npy")) for i in range(len(specs))]
t0 = time.perf_counter()
prog = rt.compile(open(os.path.join(where, "module.pb"), "rb").read(), specs, mesh)
compile_s = time.perf_counter() - t0
args = [rt.put(v, s, mesh) for v, s in zip(params, specs)]
steps = []
for step in range(3):
    t0 = time.perf_counter()
    try:
        outs = rt.run(prog, args)
        rt.ready(outs)
    except MultiHostError as e:
        print("RAISED", e, flush=True)
        os._exit(0)
    steps.append(time.perf_counter() - t0)
    if what == "die" and rank == 1:
        print("DYING", flush=True)
        os._exit(0)
    if what == "die" and rank == 0:
        time.sleep(1.0)             # member 1 is gone by the next step
shards = {}
for i, o in enumerate(outs):
    for k, (index, value) in enumerate(rt.local_shards(o)):
        bounds = [(s.start or 0, s.stop if s.stop is not None else n)
                  for s, n in zip(index, o.shape)]
        shards[f"o{i}_{k}_value"] = value
        shards[f"o{i}_{k}_bounds"] = np.array(bounds, dtype=np.int64).reshape(-1, 2)
np.savez(os.path.join(where, f"out{rank}.npz"), **shards)
print("DONE", rank, f"compile {compile_s:.3f} s, steps", " ".join(f"{s:.4f}" for s in steps),
      flush=True)
rt.shutdown()
