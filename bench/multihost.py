"""Slices that span hosts (issue 14): which backend runs a step, and what the hosts cost.

One program, the loss and gradients of an MLP (``--batch`` x ``--width``, ``--layers``
Linear+Tanh), traced once by the client's capture (Decision 1), run on 4 CPU devices
with the batch sharded over them, three ways, each in fresh processes:

- ``torch_xla``: one process, torch_xla's SPMD over 4 devices, the executor's calls
  (``_xla_user_computation`` on a computation from the HLO proto, then a sync);
- ``jax_1x4``: one process, jaxlib's PJRT CPU client over 4 devices
  (``worker/multihost.py`` with one member);
- ``jax_2x2``: two processes of 2 devices each, gloo collectives between them (the
  2-host slice).

Rounds interleave the three (A, B, C, A, B, C, ...). Each process reports the median of
``--steps`` steps after a warm-up. The figures are the median of the per-round ratios
with their spread. Also a 1 MiB all-reduce across the two processes against raw TCP
moving the same bytes.

    python bench/multihost.py [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import emit, median

ROOT = pathlib.Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- program

def make_program(where: pathlib.Path, batch: int, width: int, layers: int) -> None:
    import torch

    from pathways_torch.client import capture
    torch.manual_seed(0)
    x = torch.randn(batch, width)
    ws = [torch.randn(width, width) / width ** 0.5 for _ in range(layers)]

    def step(x, *ws):
        ws = [w.requires_grad_() for w in ws]
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        loss = h.pow(2).mean()
        return (loss, *torch.autograd.grad(loss, ws))

    inputs = [x] + ws
    traced = capture.trace(step, "mlp", [(tuple(t.shape), t.dtype) for t in inputs],
                           lambda ts: (tuple(ts), {}))
    (where / "module.pb").write_bytes(traced.hlo)
    specs = []
    for i, (kind, k) in enumerate(traced.params):
        value = inputs[k] if kind == "i" else traced.constants[k]
        np.save(where / f"p{i}.npy", value.numpy())
        specs.append(["data"] if kind == "i" and k == 0 else [])
    (where / "specs.json").write_text(json.dumps(specs))


def load(where: pathlib.Path):
    specs = json.loads((where / "specs.json").read_text())
    return ((where / "module.pb").read_bytes(),
            [np.load(where / f"p{i}.npy") for i in range(len(specs))], specs)


# ---------------------------------------------------------------------------- members

def run_torch_xla(where: pathlib.Path, steps: int) -> dict:
    import torch
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    xr.use_spmd()
    hlo, params, specs = load(where)
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("data",))
    dev = torch_xla.device()
    args = []
    for v, spec in zip(params, specs):
        t = torch.from_numpy(v).to(dev)
        if t.dim():
            xs.mark_sharding(t, mesh, tuple("data" if i == 0 and spec else None
                                            for i in range(t.dim())))
        args.append(t)
    t0 = time.perf_counter()
    comp = xb.computation_from_module_proto("mlp", hlo)

    def one():
        outs = torch_xla._XLAC._xla_user_computation("xla::mlp", args, comp)
        torch_xla._XLAC._xla_sync_multi(outs, [], wait=True)
        torch_xla._XLAC._xla_wait_device_ops([])
        outs[0].cpu()                   # the step's work is done, not only queued
        return outs

    one()
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one()
        ts.append(time.perf_counter() - t0)
    return {"step_ms": median(ts) * 1e3, "compile_s": compile_s, "devices": n}


def run_jax(where: pathlib.Path, steps: int, address: str, members: int, rank: int,
            local: int) -> dict:
    from pathways_torch.sharding import P
    from pathways_torch.worker.multihost import MultiHostRuntime
    rt = MultiHostRuntime(address, num_processes=members, process_id=rank,
                          local_devices=local)
    hlo, params, specs = load(where)
    mesh = rt.mesh((members * local,), ("data",))
    t0 = time.perf_counter()
    specs = [P(*s) for s in specs]
    prog = rt.compile(hlo, specs, mesh)
    args = [rt.put(v, s, mesh) for v, s in zip(params, specs)]
    rt.ready(rt.run(prog, args))
    compile_s = time.perf_counter() - t0
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        rt.ready(rt.run(prog, args))
        ts.append(time.perf_counter() - t0)
    out = {"step_ms": median(ts) * 1e3, "compile_s": compile_s,
           "devices": len(rt.devices)}
    if members == 2:
        out["allreduce_1mib_ms"] = allreduce(rt, local)
    rt.shutdown()
    return out


def allreduce(rt, local: int, nbytes: int = 1 << 20, reps: int = 20) -> float:
    """A 1 MiB float32 all-reduce over every device of the slice (ms, median)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS
    n = len(rt.devices)
    mesh = rt.mesh((n,), ("d",))
    x = rt.put(np.ones((n, nbytes // 4), np.float32), ("d",), mesh)
    f = jax.jit(lambda a: jnp.sum(a, axis=0),
                out_shardings=NamedSharding(mesh, PS()))
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return median(ts) * 1e3


def tcp_ms(nbytes: int = 1 << 20, reps: int = 20) -> float:
    """Raw TCP on loopback, two processes' worth: 1 MiB each way (an all-reduce of two
    members moves about that), median ms."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    peer = subprocess.Popen([sys.executable, "-c", (
        "import socket,sys\n"
        f"s=socket.create_connection(('127.0.0.1',{srv.getsockname()[1]}))\n"
        f"b=bytearray({nbytes})\n"
        f"for _ in range({reps + 1}):\n"
        "    v=memoryview(b);n=0\n"
        f"    while n<{nbytes}: n+=s.recv_into(v[n:])\n"
        "    s.sendall(b)\n")])
    conn, _ = srv.accept()
    data = bytearray(nbytes)
    ts = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        conn.sendall(data)
        view, got = memoryview(data), 0
        while got < nbytes:
            got += conn.recv_into(view[got:])
        if i:
            ts.append(time.perf_counter() - t0)
    peer.wait()
    conn.close()
    srv.close()
    return median(ts) * 1e3


# ---------------------------------------------------------------------------- driver

def child(kind: str, where: str, steps: int, extra: list) -> list:
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    base = [sys.executable, os.path.abspath(__file__), "--member", kind, "--where", where,
            "--steps", str(steps)]
    if kind == "torch_xla":
        env["CPU_NUM_DEVICES"] = "4"
        cmds = [base]
    elif kind == "jax_1x4":
        cmds = [base + ["--address", f"127.0.0.1:{free_port()}", "--members", "1",
                        "--rank", "0", "--local", "4"]]
    else:
        address = f"127.0.0.1:{free_port()}"
        cmds = [base + ["--address", address, "--members", "2", "--rank", str(r),
                        "--local", "2"] for r in (0, 1)]
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in cmds]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if p.returncode != 0 or not lines:
            raise RuntimeError(f"{kind} failed: {err[-2000:]}")
        outs.append(json.loads(lines[-1]))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--member", default="", help=argparse.SUPPRESS)
    ap.add_argument("--where", default="", help=argparse.SUPPRESS)
    ap.add_argument("--address", default="", help=argparse.SUPPRESS)
    ap.add_argument("--members", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--local", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.member:
        where = pathlib.Path(args.where)
        if args.member == "torch_xla":
            print(json.dumps(run_torch_xla(where, args.steps)), flush=True)
        else:
            print(json.dumps(run_jax(where, args.steps, args.address, args.members,
                                     args.rank, args.local)), flush=True)
        return
    with tempfile.TemporaryDirectory() as d:
        where = pathlib.Path(d)
        make_program(where, args.batch, args.width, args.layers)
        rows = []
        for r in range(args.rounds):
            row = {}
            for kind in ("torch_xla", "jax_1x4", "jax_2x2"):
                outs = child(kind, d, args.steps, [])
                row[kind] = outs[0]
                if kind == "jax_2x2":
                    row[kind]["step_ms"] = max(o["step_ms"] for o in outs)
            row["tcp_1mib_ms"] = tcp_ms()
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

    def ratios(num, den, key="step_ms"):
        rs = [row[num][key] / row[den][key] for row in rows]
        return {"median": median(rs), "min": min(rs), "max": max(rs)}

    emit({"benchmark": "multihost", "batch": args.batch, "width": args.width,
          "layers": args.layers, "rounds": rows,
          "jax_1x4_over_torch_xla": ratios("jax_1x4", "torch_xla"),
          "jax_2x2_over_jax_1x4": ratios("jax_2x2", "jax_1x4"),
          "allreduce_over_tcp": {
              "median": median([row["jax_2x2"]["allreduce_1mib_ms"] / row["tcp_1mib_ms"]
                                for row in rows])}})


if __name__ == "__main__":
    main()
