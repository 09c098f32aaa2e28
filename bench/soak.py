"""Soak: many small programs with random releases and cross-island transfers over two
islands; the worker processes' resources must come back to where they started.

    python bench/soak.py [--programs 20000] [--seed 0] [--sample-every 500]

An embedded cluster with two islands (one host of 2 CPU devices each), one (2,) slice
per island. After a warm-up (every program compiled on both slices, the data plane's
connections and sender threads started) the pool of live Arrays is dropped and the
*baseline* is taken. Then ``--programs`` program calls run, a seeded RNG deciding at
each step what else happens: puts of fresh tensors, moves of an Array to the other
island's slice (``Array.to``, worker to worker), program inputs taken from the other
island (moved implicitly), releases of random Arrays (and now and then of the whole
pool), and fetches compared with the same functions run by plain torch on the CPU.
Every ``--sample-every`` programs both slices are synchronised and the resources are
sampled (the curve). At the end everything is dropped, both slices synchronised, and
the resources are measured again.

Measured per executor (one per slice), per worker agent (the executor's grandparent:
agent -> zygote -> executor) and for the coordinator: RSS (VmRSS), threads, open file
descriptors; per slice: buffers and buffer bytes (``Slice.stats()``). The criteria
(``failures()``): buffers, buffer bytes, threads and fds equal to the baseline, RSS
within 10 % of it. One JSON line on stdout (what ``bench/run_all.py`` collects).

``tests/test_soak.py`` runs the same ``run_soak`` with fewer programs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch

import pathways_torch as pw
from pathways_torch import P

SHAPE = (32, 64)                 # 8 KiB of float32: small programs
SPEC = P("data", None)           # rows split over the slice's 2 devices
POOL_MAX = 24                    # live Arrays per slice at most
# Fetched values against plain torch on the CPU (same functions, same inputs). XLA's CPU
# tanh and matmul differ from torch's by a few ulp; chains are contractive (tanh), so
# errors stay at ~1e-6.
RTOL, ATOL = 1e-5, 1e-5
RSS_TOLERANCE = 0.10             # the bound for memory
# gRPC core's timer manager ("grpc_global_timer", cut to 15 characters in /proc) starts
# a thread whenever timers fire while none of its threads waits, and never ends one: a
# process has one until its first timer fires, then two (the idle coordinator too),
# whatever the workload. Its threads may grow by this many; all others must be equal.
GRPC_TIMER, GRPC_TIMER_SLACK = "grpc_global_tim", 1


def _mix(x, y):
    return torch.tanh(0.5 * x - y)


def _mm(x, w):
    return torch.tanh(x @ w)


def _scale(x):
    return x * 0.9 + 0.05


mix, mm, scale = pw.program(_mix), pw.program(_mm), pw.program(_scale)


# ---------------------------------------------------------------------------- /proc

def _status(pid: int) -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "Threads"):
                out[k] = int(v.split()[0])
    return out


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def thread_names(pid: int) -> dict:
    """How many threads of each name (/proc/<pid>/task/*/comm) a process has."""
    out: dict = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def proc_sample(pid: int) -> dict:
    """RSS (KiB), threads (of them, gRPC's timer-manager threads) and open file
    descriptors of a live process."""
    st = _status(pid)
    return {"rss_kib": st["VmRSS"], "threads": st["Threads"],
            "grpc_timer_threads": thread_names(pid).get(GRPC_TIMER, 0),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


# ---------------------------------------------------------------------------- workload

class Workload:
    """Random steps over the slices; every live Array has its CPU reference value."""

    def __init__(self, slices, weights, seed: int) -> None:
        self.slices = slices
        self.weights = weights           # slice id -> (Array, reference)
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.pools = {s.id: [] for s in slices}
        self.counts = {"programs": 0, "puts": 0, "transfers": 0, "implicit_transfers": 0,
                       "releases": 0, "pool_drops": 0, "checks": 0}
        self.max_err = 0.0

    def _put(self, s):
        t = torch.randn(SHAPE, generator=self.gen)
        self.pools[s.id].append((pw.put(t, s, SPEC), t))
        self.counts["puts"] += 1

    def _other(self, s):
        return self.slices[1] if s is self.slices[0] else self.slices[0]

    def step(self) -> None:
        rng = self.rng
        s = rng.choice(self.slices)
        pool = self.pools[s.id]
        while len(pool) < 2 or rng.random() < 0.05:
            self._put(s)
        if rng.random() < 0.2:                          # move one to the other island
            o = self._other(s)
            a, ref = rng.choice(pool)
            self.pools[o.id].append((a.to(o, SPEC), ref))
            self.counts["transfers"] += 1
        r = rng.random()
        x, xr = rng.choice(pool)
        if r < 0.4:
            other = self.pools[self._other(s).id]
            if other and rng.random() < 0.15:           # input on the other island
                y, yr = rng.choice(other)
                self.counts["implicit_transfers"] += 1
            else:
                y, yr = rng.choice(pool)
            out, ref = mix(x, y), _mix(xr, yr)
        elif r < 0.7:
            w, wr = self.weights[s.id]
            out, ref = mm(x, w), _mm(xr, wr)
        else:
            out, ref = scale(x), _scale(xr)
        pool.append((out, ref))
        self.counts["programs"] += 1
        if rng.random() < 0.02:                         # fetch and compare
            self.check(rng.choice(pool))
        if rng.random() < 0.01:                         # drop the whole pool
            self.counts["releases"] += len(pool)
            self.counts["pool_drops"] += 1
            pool.clear()
        for p in self.pools.values():
            while len(p) > POOL_MAX or (p and rng.random() < 0.25):
                p.pop(rng.randrange(len(p)))            # the last reference: released
                self.counts["releases"] += 1

    def check(self, item) -> None:
        a, ref = item
        got = a.torch(timeout=60)
        err = (got - ref).abs().max().item()
        self.max_err = max(self.max_err, err)
        if not torch.allclose(got, ref, rtol=RTOL, atol=ATOL):
            raise AssertionError(f"soak: a fetched value differs from plain torch by {err:g} "
                                 f"(rtol {RTOL}, atol {ATOL})")
        self.counts["checks"] += 1

    def drop_all(self) -> None:
        for p in self.pools.values():
            self.counts["releases"] += len(p)
            p.clear()
        gc.collect()


# ---------------------------------------------------------------------------- measuring

class Probe:
    """The processes to watch and how to sample them."""

    def __init__(self, slices) -> None:
        cluster = pw.client.runtime._state.cluster
        self.slices = slices
        self.procs = {}                                  # name -> pid
        agents = set(cluster.pids()[1:])
        for i, s in enumerate(slices):
            ex = s.stats(sync=False).pid
            agent = ppid(ppid(ex))                      # agent -> zygote -> executor
            if agent not in agents:
                raise RuntimeError(f"executor {ex}'s grandparent {agent} is not a worker "
                                   f"agent of the cluster ({sorted(agents)})")
            self.procs[f"executor{i}"] = ex
            self.procs[f"agent{i}"] = agent
        self.procs["coordinator"] = cluster.pids()[0]

    def threads(self) -> dict:
        return {name: thread_names(pid) for name, pid in self.procs.items()}

    def sample(self, settle: float = 0.0) -> dict:
        """Synchronise every slice (each has processed every op sent), then sample."""
        stats = [s.stats(sync=True) for s in self.slices]
        if settle:
            time.sleep(settle)                          # sends finishing on the pools
            stats = [s.stats(sync=True) for s in self.slices]
        out = {name: proc_sample(pid) for name, pid in self.procs.items()}
        for i, st in enumerate(stats):
            out[f"executor{i}"].update(buffers=st.num_buffers, buffer_bytes=st.buffer_bytes,
                                       compiles=st.compiles, executed=st.executed)
        return out


def failures(baseline: dict, final: dict, rss_tolerance: float = RSS_TOLERANCE) -> list:
    """What did not come back: exact for buffers, bytes, threads (but gRPC's timer
    manager, GRPC_TIMER_SLACK) and fds; RSS within 10 %."""
    bad = []
    for name, base in baseline.items():
        end = final[name]
        for key in ("buffers", "buffer_bytes", "fds", "compiles"):
            if key in base and end[key] != base[key]:
                bad.append(f"{name} {key}: {base[key]} at the baseline, {end[key]} at the end")
        timers = end["grpc_timer_threads"] - base["grpc_timer_threads"]
        if end["threads"] - timers != base["threads"] or timers > GRPC_TIMER_SLACK:
            bad.append(f"{name} threads: {base['threads']} at the baseline, {end['threads']} "
                       f"at the end ({timers:+d} of gRPC's timer manager, which may grow by "
                       f"{GRPC_TIMER_SLACK})")
        lim = rss_tolerance * base["rss_kib"]
        if abs(end["rss_kib"] - base["rss_kib"]) > lim:
            bad.append(f"{name} RSS: {base['rss_kib']} KiB at the baseline, "
                       f"{end['rss_kib']} KiB at the end (more than {rss_tolerance:.0%} off)")
    return bad


def _warm(slices, weights, seed: int, programs: int) -> None:
    """Compile every program on both slices; open the data connections both ways and
    start the sender pools' threads with bursts of moves."""
    wl = Workload(slices, weights, seed)
    for _ in range(programs):
        wl.step()
    for s in slices:
        o = wl._other(s)
        x = pw.put(torch.randn(SHAPE), s, SPEC)
        for _ in range(3):
            x = mm(x, weights[s.id][0])                 # the moves wait for this chain
        moved = [x.to(o, SPEC) for _ in range(16)]
        pw.wait(moved)
        for m in moved[:4]:
            m.torch()
        del moved, x
    # Each executor's gRPC server pool (it never shrinks) grows by a thread whenever
    # calls overlap; the soak's one client thread overlaps at most two or three now
    # and then. Grow it past that here, so that the baseline has what the soak needs.
    items = [it for p in wl.pools.values() for it in p[:4]]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            list(pool.map(wl.check, items * 2))
            list(pool.map(lambda s: s.stats(sync=False), slices * 4))
    wl.drop_all()


def start_cluster() -> list:
    """An embedded cluster of two islands (one host, 2 CPU devices each); a (2,) slice
    on each island."""
    pw.init(islands=2, hosts_per_island=1, devices_per_host=2, timeout=120)
    try:
        return [pw.slice((2,), axis_names=("data",), island=i) for i in range(2)]
    except BaseException:
        pw.shutdown()
        raise


def run_soak(n_programs: int = 20000, seed: int = 0, sample_every: int = 500,
             warmup: int = 400, settle: float = 1.0, log=None, slices=None) -> dict:
    """Run the soak; return the measurements (``failures`` lists what did not return).

    Without ``slices`` it starts a cluster (``start_cluster``) and shuts it down before
    returning, also on failure; with them (two slices on different islands of an
    embedded cluster) it uses them and leaves them as they were.
    """
    if slices is None:
        slices = start_cluster()
        try:
            return run_soak(n_programs, seed, sample_every, warmup, settle, log, slices)
        finally:
            pw.shutdown()
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(seed + 1000)
    weights = {}
    for s in slices:
        w = torch.randn(SHAPE[1], SHAPE[1], generator=g) / SHAPE[1] ** 0.5
        weights[s.id] = (pw.put(w, s, P()), w)
    probe = Probe(slices)
    t0 = time.perf_counter()
    _warm(slices, weights, seed + 1, warmup)
    warm_s = time.perf_counter() - t0
    baseline = probe.sample(settle)
    threads_base = probe.threads()
    curve = [{"programs": 0, "t": 0.0, **_flat(baseline)}]
    wl = Workload(slices, weights, seed)
    t0 = time.perf_counter()
    for i in range(1, n_programs + 1):
        wl.step()
        if i % sample_every == 0 or i == n_programs:
            curve.append({"programs": i, "t": round(time.perf_counter() - t0, 2),
                          **_flat(probe.sample())})
            if log:
                log(f"soak: {i}/{n_programs} programs, "
                    f"{time.perf_counter() - t0:.0f} s, " + _short(curve[-1]))
    run_s = time.perf_counter() - t0
    wl.drop_all()
    final = probe.sample(settle)
    threads_final = probe.threads()
    curve.append({"programs": n_programs, "t": round(time.perf_counter() - t0, 2),
                  "dropped": True, **_flat(final)})
    bad = failures(baseline, final)
    for name in threads_base:                       # which threads differ (as /proc names)
        if any(b.startswith(f"{name} threads:") for b in bad):
            bad.append(f"{name} threads by name: "
                       f"{_diff(threads_base[name], threads_final[name])}")
    return {"benchmark": "soak", "programs": n_programs, "seed": seed,
            "sample_every": sample_every, "warmup_programs": warmup,
            "shape": list(SHAPE), "pool_max": POOL_MAX, "counts": wl.counts,
            "max_abs_err": wl.max_err, "rtol": RTOL, "atol": ATOL,
            "rss_tolerance": RSS_TOLERANCE, "grpc_timer_slack": GRPC_TIMER_SLACK,
            "pids": probe.procs,
            "baseline": baseline, "final": final, "curve": curve,
            "threads_baseline": threads_base, "threads_final": threads_final,
            "failures": bad, "ok": not bad, "warmup_s": round(warm_s, 1),
            "run_s": round(run_s, 1),
            "programs_per_s": round(n_programs / run_s, 1),
            "wall_s": round(time.perf_counter() - t_start, 1)}


def _diff(before: dict, after: dict) -> str:
    keys = sorted(set(before) | set(after))
    return ", ".join(f"{k!r} {before.get(k, 0)} -> {after.get(k, 0)}" for k in keys
                     if before.get(k, 0) != after.get(k, 0))


def _flat(sample: dict) -> dict:
    """{"executor0": {"rss_kib": ..}} -> {"executor0.rss_kib": ..} (one curve point)."""
    return {f"{name}.{k}": v for name, d in sample.items() for k, v in d.items()}


def _short(point: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in point.items()
                     if k.startswith("executor") and k.split(".")[1] in
                     ("rss_kib", "buffers", "threads", "fds"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--programs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--strict", action="store_true",
                    help="exit with status 1 when a resource did not come back")
    args = ap.parse_args()
    res = run_soak(args.programs, args.seed, args.sample_every, args.warmup,
                   log=lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(res), flush=True)
    if not res["ok"]:
        print("soak: " + "; ".join(res["failures"]), file=sys.stderr)
        if args.strict:
            sys.exit(1)


if __name__ == "__main__":
    main()
