"""The control plane at scale (issue 12, part 5): the real coordinator, N fake hosts.

For each N (``--hosts 16,256,1024,2048``; each against a fresh coordinator process), N
fake hosts with 4 devices each (islands of 64 hosts: island i // 64, host i % 64) speak
the real protocol from one asyncio process (bench/fakehosts.py), and this process
measures, with sync stubs as a client would:

- register_s: from the first registration sent until ListDevices counts all N;
- idle: the coordinator's CPU (fraction of one core, /proc utime+stime) over a window
  with every host beating, its RSS and threads; the fake hosts' own CPU, and the beats'
  round trips (so a saturated harness would show);
- ListDevices p50 (whole cluster, and one island) from a sync stub;
- allocation: AllocateSlice of a 1-device slice through an open session, then
  ReleaseSlice, p50/p90;
- Schedule calls/s for graphs touching 1, 8 and 64 hosts (1-device slices on distinct
  hosts: the least-loaded placement spreads them);
- the time until a closed host and a silent host (connection open, no beats) show
  "lost" in ListDevices;
- the client (a real pathways_torch client in its own process, against fake executors):
  pw.devices() latency; over k = 1, 8, 64 slices (k <= N) pw.wait on one Array per
  slice, a barrier over all k (``Slice.stats()`` on each), its threads, and its CPU per
  ``pw.graph()`` submission of one put per slice.

A part that fails is recorded as {"error": ...}; the others still run. Prints one JSON
line with every figure and the issue's bars (``bars``: registered within 3 s at 2,048
hosts, idle CPU <= 0.10 core, allocation p50 <= 3 ms, a silent host lost within 5 s,
pw.wait over 64 slices <= 3x over 1, on Arrays waited before and on fresh ones). ``--fast``: N = 256 only, k up to 8, shorter loops.

    python bench/scale.py [--hosts 16,256,1024,2048] [--fast]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback

from common import emit, ratio_summary

import fakehosts as fh
from fakehosts import pb

from pathways_torch.coordinator.service import HEARTBEAT_S, LOST_AFTER_S  # noqa: E402

DEVICES_PER_HOST = 4

# The bars (issue 12, part 5). Not measurements.
BARS = {
    "register_s_at_2048": 3.0,
    "idle_cpu_core": 0.10,
    "alloc_p50_ms": 3.0,
    "silent_lost_s": 5.0,
    "wait_k64_over_k1": 3.0,
}


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]


def ms(xs, p=0.5):
    v = pct(xs, p)
    return None if v is None else v * 1e3


def part(out: dict, name: str, fn) -> None:
    """Run one measurement; its failure is recorded under ``name`` and the rest goes on."""
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception as e:      # noqa: BLE001
        log(f"  {name} failed: {e}")
        out[name] = {"error": f"{type(e).__name__}: {e}",
                     "where": traceback.format_exc().strip().splitlines()[-3:]}
    log(f"  {name}: {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------- parts

def idle(coord, fleet, seconds: float) -> dict:
    """The coordinator's CPU with every host beating and nothing else going on.

    Hosts beat in one burst per heartbeat period (on wall-clock multiples), so the
    window is a whole number of periods: 5 s would hold two bursts or three."""
    import math
    seconds = HEARTBEAT_S * math.ceil(seconds / HEARTBEAT_S)
    # Let registration's aftermath settle: hosts beat on their streams until their
    # first datagram beat is answered (by their second beat).
    time.sleep(1.0 + 2 * HEARTBEAT_S)
    fleet.stats(reset=True)
    c0, f0, s0, t0 = coord.cpu_s(), fleet.cpu_s(), time.process_time(), time.monotonic()
    time.sleep(seconds)
    c1, f1, s1, t1 = coord.cpu_s(), fleet.cpu_s(), time.process_time(), time.monotonic()
    beats = fleet.stats(reset=True)
    st = coord.status()
    wall = t1 - t0
    return {"window_s": wall, "cpu_core": (c1 - c0) / wall,
            "rss_mib": st.get("rss_mib"), "threads": st.get("threads"), "fds": st.get("fds"),
            "fakehosts_cpu_core": (f1 - f0) / wall, "bench_cpu_core": (s1 - s0) / wall,
            "beats_sent": beats["beats_sent"], "beats_answered": beats["beats_answered"],
            "beat_rtt_ms_p50": beats["beat_rtt_ms_p50"],
            "beat_rtt_ms_p99": beats["beat_rtt_ms_p99"]}


def list_devices(stub, n_hosts: int, calls: int) -> dict:
    def timed(req):
        ts, size = [], 0
        for _ in range(calls):
            t0 = time.perf_counter()
            rep = stub.ListDevices(req, timeout=30)
            ts.append(time.perf_counter() - t0)
            size = rep.ByteSize()
        return ts, size, rep
    stub.ListDevices(pb.ListDevicesRequest(), timeout=30)      # warm
    ts, size, rep = timed(pb.ListDevicesRequest())
    its, isize, _ = timed(pb.ListDevicesRequest(island=0, has_island=True))
    return {"calls": calls, "p50_ms": ms(ts), "p90_ms": ms(ts, 0.9),
            "reply_bytes": size, "devices": len(rep.devices),
            "registered_workers": rep.registered_workers,
            "island_p50_ms": ms(its), "island_reply_bytes": isize}


def allocation(session, n_allocs: int) -> dict:
    stub = session.stub
    req = pb.AllocateSliceRequest(client_id=session.client_id, mesh_shape=[1],
                                  axis_names=["data"], any_island=True)
    alloc, rel, places = [], [], set()
    for i in range(n_allocs + 5):
        t0 = time.perf_counter()
        rep = stub.AllocateSlice(req, timeout=30)
        t1 = time.perf_counter()
        stub.ReleaseSlice(pb.ReleaseSliceRequest(client_id=session.client_id,
                                                 slice_id=rep.slice_id), timeout=30)
        t2 = time.perf_counter()
        if i >= 5:                          # the first ones warm the channels
            alloc.append(t1 - t0)
            rel.append(t2 - t1)
        places.add((rep.island, rep.host))
    return {"n": n_allocs, "p50_ms": ms(alloc), "p90_ms": ms(alloc, 0.9),
            "max_ms": ms(alloc, 1.0), "release_p50_ms": ms(rel),
            "release_p90_ms": ms(rel, 0.9), "hosts_used": len(places)}


def schedule(session, n_hosts: int, spans, seconds: float) -> dict:
    stub, cid = session.stub, session.client_id
    out = {}
    for m in spans:
        if m > n_hosts:
            continue
        r: dict = {}
        ids = []
        try:
            places = set()
            for _ in range(m):
                rep = stub.AllocateSlice(pb.AllocateSliceRequest(
                    client_id=cid, mesh_shape=[1], axis_names=["data"], any_island=True),
                    timeout=30)
                ids.append(rep.slice_id)
                places.add((rep.island, rep.host))
            req = pb.ScheduleRequest(client_id=cid, slice_ids=ids)
            for _ in range(5):
                stub.Schedule(req, timeout=30)
            lat = []
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                stub.Schedule(req, timeout=30)
                lat.append(time.perf_counter() - t0)
            r = {"slices": m, "distinct_hosts": len(places),
                 "islands": len({p[0] for p in places}), "calls": len(lat),
                 "calls_per_s": len(lat) / sum(lat), "p50_ms": ms(lat)}
        except Exception as e:      # noqa: BLE001
            r = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for sid in ids:
                try:
                    stub.ReleaseSlice(pb.ReleaseSliceRequest(client_id=cid, slice_id=sid),
                                      timeout=30)
                except Exception:   # noqa: BLE001
                    pass
        out[str(m)] = r
    return out


def notice(fleet, n_hosts: int, closed: int, silent: int) -> dict:
    """Close ``closed`` hosts, then silence ``silent`` others (all at once), from the end
    of the list (they hold no slices); seconds until each shows "lost"."""
    out = {}
    idx = list(range(n_hosts - 1, -1, -1))
    c_idx, s_idx = idx[:closed], idx[closed:closed + silent]
    if c_idx:
        r = fleet.notice(c_idx, "close", timeout=15)
        xs = [x for x in r["seconds"] if x is not None]
        out["closed"] = {"hosts": c_idx, "seconds": r["seconds"],
                         "median_s": statistics.median(xs) if xs else None,
                         "max_s": max(xs) if xs and len(xs) == len(c_idx) else None,
                         "not_noticed": r["not_noticed"]}
    if s_idx:
        r = fleet.notice(s_idx, "silent", timeout=LOST_AFTER_S + 11)
        xs = [x for x in r["seconds"] if x is not None]
        out["silent"] = {"hosts": s_idx, "seconds": r["seconds"],
                         "since_last_beat_s": r["since_last_beat_s"],
                         "median_s": statistics.median(xs) if xs else None,
                         "max_s": max(xs) if xs and len(xs) == len(s_idx) else None,
                         "not_noticed": r["not_noticed"]}
    return out


def client(address: str, ks, repeats: int, graphs: int, timeout: float) -> dict:
    """A real client in its own process (see client_main)."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("PATHWAYS_ADDRESS", None)
    argv = [sys.executable, os.path.abspath(__file__), "--client", address,
            "--ks", ",".join(map(str, ks)), "--repeats", str(repeats),
            "--graphs", str(graphs)]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
    except subprocess.TimeoutExpired as e:
        return {"error": f"the client process ran past {timeout:.0f} s: "
                f"{(e.stderr or b'')[-1500:]!r}"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"the client process exited {p.returncode}: {p.stderr[-1500:]}"}
    return json.loads(lines[-1])


def client_main(address: str, ks, repeats: int, graphs: int) -> None:
    """Run inside the client process: prints one JSON line."""
    import torch

    import pathways_torch as pw

    def threads():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return {"python": threading.active_count(), "os": int(line.split()[1])}

    out: dict = {}
    t0 = time.perf_counter()
    pw.init(address=address, timeout=60)
    out["init_s"] = time.perf_counter() - t0
    out["threads_before"] = threads()
    try:
        ts = []
        pw.devices()
        for _ in range(max(5, repeats // 2)):
            t0 = time.perf_counter()
            devs = pw.devices()
            ts.append(time.perf_counter() - t0)
        out["devices"] = {"p50_ms": ms(ts), "p90_ms": ms(ts, 0.9), "devices": len(devs)}
    except Exception as e:      # noqa: BLE001
        out["devices"] = {"error": f"{type(e).__name__}: {e}"}
    for k in ks:
        r: dict = {}
        slices = []
        try:
            t0 = time.perf_counter()
            slices = [pw.slice(1) for _ in range(k)]
            r["slice_s"] = time.perf_counter() - t0
            r["distinct_hosts"] = len({(s.island, s.host) for s in slices})
            arrays = [pw.put(torch.zeros(4), s) for s in slices]
            pw.wait(arrays)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                pw.wait(arrays)
                ts.append(time.perf_counter() - t0)
            r["wait_ms_p50"], r["wait_ms_p90"] = ms(ts), ms(ts, 0.9)
            ts, cpu = [], []
            for _ in range(repeats):              # fresh Arrays: put, then wait at once
                fresh = [pw.put(torch.zeros(4), s) for s in slices]
                c0, t0 = time.process_time(), time.perf_counter()
                pw.wait(fresh)
                ts.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            r["wait_fresh_ms_p50"], r["wait_fresh_ms_p90"] = ms(ts), ms(ts, 0.9)
            r["wait_fresh_client_cpu_ms_p50"] = ms(cpu)     # every thread of the client
            r["threads_before_barrier"] = threads()
            ts = []
            for _ in range(max(5, repeats // 3)):
                t0 = time.perf_counter()
                evs = [(s._conn, s._conn.barrier_start()) for s in slices]
                for conn, ev in evs:
                    conn.barrier_finish(ev)
                ts.append(time.perf_counter() - t0)
            r["barrier_all_ms_p50"], r["barrier_all_ms_p90"] = ms(ts), ms(ts, 0.9)
            ts = []
            for _ in range(max(5, repeats // 3)):
                t0 = time.perf_counter()
                for s in slices:
                    s.stats()
                ts.append(time.perf_counter() - t0)
            r["barrier_ms_p50"], r["barrier_ms_p90"] = ms(ts), ms(ts, 0.9)
            r["threads"] = threads()
            for _ in range(2):                          # warm
                with pw.graph():
                    for s in slices:
                        pw.put(torch.zeros(4), s)
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(graphs):
                with pw.graph():
                    for s in slices:
                        pw.put(torch.zeros(4), s)
            c1, w1 = time.process_time(), time.perf_counter()
            r["graph_cpu_ms"] = (c1 - c0) / graphs * 1e3
            r["graph_wall_ms"] = (w1 - w0) / graphs * 1e3
            r["graphs"] = graphs
            del arrays
        except Exception as e:      # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {e}"
        finally:
            for s in slices:
                try:
                    s.release()
                except Exception:   # noqa: BLE001
                    pass
        out[f"k{k}"] = r
    if 1 in ks and 64 in ks:
        try:
            out["interleaved"] = interleaved_waits(pw, torch, rounds=7, per=5)
        except Exception as e:      # noqa: BLE001
            out["interleaved"] = {"error": f"{type(e).__name__}: {e}"}
    out["threads_after"] = threads()
    pw.shutdown()
    print(json.dumps(out), flush=True)


def interleaved_waits(pw, torch, rounds: int, per: int) -> dict:
    """The bars' ratios, pw.wait over 64 slices / over 1, measured interleaved: in each
    round the median of ``per`` waits over 1 slice and over 64 (the order alternating
    from round to round), on Arrays waited before and on fresh ones; the median of the
    per-round ratios with their spread (``common.ratio_summary``)."""
    one, many = [pw.slice(1)], [pw.slice(1) for _ in range(64)]
    try:
        waited = {k: [pw.put(torch.zeros(4), s) for s in ss] for k, ss in
                  ((1, one), (64, many))}
        for a in waited.values():
            pw.wait(a)

        def time_wait(k: int, fresh: bool) -> float:
            ts = []
            for _ in range(per):
                arrays = [pw.put(torch.zeros(4), s) for s in (one if k == 1 else many)] \
                    if fresh else waited[k]
                t0 = time.perf_counter()
                pw.wait(arrays)
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts)

        ratios: dict = {"wait": [], "fresh": []}
        for r in range(rounds):
            for key, fresh in (("wait", False), ("fresh", True)):
                ks = (1, 64) if r % 2 == 0 else (64, 1)
                t = {k: time_wait(k, fresh) for k in ks}
                ratios[key].append(t[64] / t[1])
        return {key: ratio_summary(v) for key, v in ratios.items()}
    finally:
        for s in one + many:
            try:
                s.release()
            except Exception:       # noqa: BLE001
                pass


# ---------------------------------------------------------------------------- one N

def run_n(n: int, args) -> dict:
    fast = args.fast
    out: dict = {"hosts": n, "devices": n * DEVICES_PER_HOST,
                 "islands": -(-n // fh.ISLAND_SIZE)}
    log(f"N = {n}")
    coord = fh.Coordinator({"heartbeat_s": HEARTBEAT_S, "lost_after_s": LOST_AFTER_S,
                            "max_hosts": max(16384, 2 * n)}, drop_unknown=True)
    fleet = None
    try:
        out["coordinator_flags"] = coord.flags
        if coord.dropped:
            out["coordinator_flags_missing"] = coord.dropped
        out["coordinator_start"] = coord.status()
        fleet = fh.FleetProcess(coord.address, concurrency=args.concurrency,
                                conn_per_host=not args.shared_connection)
        c0, f0 = coord.cpu_s(), fleet.cpu_s()
        reg = fleet.register(n, DEVICES_PER_HOST, fh.ISLAND_SIZE, timeout=120)
        # CPU seconds each side spent on it (both share this machine's cores)
        reg["coordinator_cpu_s"] = coord.cpu_s() - c0
        reg["fakehosts_cpu_s"] = fleet.cpu_s() - f0
        out["register"] = reg
        out["register_s"] = reg.get("register_s")
        if reg["registered"] < n or "confirm_error" in reg:
            out["error"] = (f"{reg['registered']} of {n} hosts registered: {reg['errors']}; "
                            f"{reg.get('confirm_error', '')}")
        log(f"  registered {reg['registered']}/{n} in {reg.get('register_s')} s")
        part(out, "idle", lambda: idle(coord, fleet, 3.0 if fast else 5.0))
        channel = fh.grpc_util.channel(coord.address)
        stub = fh.pbg.CoordinatorStub(channel)
        part(out, "list_devices", lambda: list_devices(stub, n, 10 if fast else 20))
        channel.close()
        session = None
        try:
            session = fh.Session(coord.address, name="scale")
            part(out, "alloc", lambda: allocation(session, 100 if fast else 200))
            part(out, "schedule", lambda: schedule(session, n, (1, 8, 64),
                                                   0.5 if fast else 1.0))
        except Exception as e:      # noqa: BLE001
            out.setdefault("alloc", {"error": f"session: {e}"})
            out.setdefault("schedule", {"error": f"session: {e}"})
        finally:
            if session is not None:
                session.close()
        ks = [k for k in ((1, 8) if fast else (1, 8, 64)) if k <= n]
        part(out, "client", lambda: client(coord.address, ks, 15 if fast else 30,
                                           10 if fast else 20, 300))
        part(out, "notice", lambda: notice(fleet, n, 1 if fast else 3,
                                           1 if fast else 3))
        out["fakehosts"] = fleet.stats()
        out["coordinator_end"] = coord.status()
    except Exception as e:      # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"  N = {n} failed: {e}")
    finally:
        if fleet is not None:
            fleet.stop()
        if not coord.alive():
            out["coordinator_exit"] = coord.proc.returncode
            out["coordinator_log"] = coord.log_tail(1500)
        coord.stop()
    return out


def get(d, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def bars(per_n: dict) -> dict:
    ns = sorted(int(n) for n in per_n)
    top = str(ns[-1]) if ns else None
    at = per_n.get(top, {}) if top else {}

    def verdict(value, bar):
        return None if value is None else value <= bar

    def interleaved_bar(summary: dict, at: int) -> dict:
        """A bar from an interleaved ratio: met / not met only when its whole spread
        lies on one side (None: undecided)."""
        lo, hi = summary["lo"], summary["hi"]
        return {"bar": BARS["wait_k64_over_k1"], "measured": summary["median"], "lo": lo,
                "hi": hi, "rounds": summary["rounds"], "spread": summary["spread"],
                "at_hosts": at, "interleaved": True,
                "met": True if hi <= BARS["wait_k64_over_k1"] else
                False if lo > BARS["wait_k64_over_k1"] else None}

    reg = get(per_n, "2048", "register_s")
    silent = [x for n in ns for x in (get(per_n, str(n), "notice", "silent", "seconds") or [])]
    silent_max = None if not silent or None in silent else max(silent)
    # the largest N whose client measured both k=1 and k=64
    wait_ratio, wait_at, fresh_ratio = None, None, None
    for n in reversed(ns):
        w1 = get(per_n, str(n), "client", "k1", "wait_ms_p50")
        w64 = get(per_n, str(n), "client", "k64", "wait_ms_p50")
        if w1 and w64:
            wait_ratio, wait_at = w64 / w1, n
            f1 = get(per_n, str(n), "client", "k1", "wait_fresh_ms_p50")
            f64 = get(per_n, str(n), "client", "k64", "wait_fresh_ms_p50")
            fresh_ratio = f64 / f1 if f1 and f64 else None
            break
    out = {
        "register_s_at_2048": {"bar": BARS["register_s_at_2048"], "measured": reg,
                               "at_hosts": 2048 if reg is not None else None},
        "idle_cpu_core": {"bar": BARS["idle_cpu_core"],
                          "measured": get(at, "idle", "cpu_core"), "at_hosts": top and int(top)},
        "alloc_p50_ms": {"bar": BARS["alloc_p50_ms"], "measured": get(at, "alloc", "p50_ms"),
                         "at_hosts": top and int(top)},
        "silent_lost_s": {"bar": BARS["silent_lost_s"], "measured": silent_max,
                          "at_hosts": "the slowest at any N"},
        "wait_k64_over_k1": {"bar": BARS["wait_k64_over_k1"], "measured": wait_ratio,
                             "at_hosts": wait_at},
        # the same over Arrays put just before the wait (the executors' pushes awaited)
        "wait_fresh_k64_over_k1": {"bar": BARS["wait_k64_over_k1"], "measured": fresh_ratio,
                                   "at_hosts": wait_at},
    }
    for b in out.values():
        b["met"] = verdict(b["measured"], b["bar"])
    # Where the client measured them interleaved, those replace the ratios of two p50s.
    for n in reversed(ns):
        inter = get(per_n, str(n), "client", "interleaved") or {}
        if "wait" in inter and "fresh" in inter:
            out["wait_k64_over_k1"] = interleaved_bar(inter["wait"], n)
            out["wait_fresh_k64_over_k1"] = interleaved_bar(inter["fresh"], n)
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hosts", default="16,256,1024,2048")
    ap.add_argument("--fast", action="store_true",
                    help="N = 256 only, k up to 8, shorter loops")
    ap.add_argument("--concurrency", type=int, default=128,
                    help="registrations in flight at once")
    ap.add_argument("--shared-connection", action="store_true",
                    help="every fake host on one TCP connection (default: one each, as "
                    "separate machines have)")
    ap.add_argument("--client", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ks", default="1,8,64", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=30, help=argparse.SUPPRESS)
    ap.add_argument("--graphs", type=int, default=20, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client_main(args.client, [int(k) for k in args.ks.split(",") if k],
                    args.repeats, args.graphs)
        return
    hosts = [256] if args.fast else [int(n) for n in args.hosts.split(",") if n]
    t0 = time.perf_counter()
    per_n = {}
    for n in hosts:
        per_n[str(n)] = run_n(n, args)
    emit({"hosts": hosts, "fast": args.fast, "devices_per_host": DEVICES_PER_HOST,
          "connections": "shared" if args.shared_connection else "one per host",
          "island_size": fh.ISLAND_SIZE, "heartbeat_s": HEARTBEAT_S,
          "lost_after_s": LOST_AFTER_S, "per_n": per_n, "bars": bars(per_n),
          "total_s": time.perf_counter() - t0})


if __name__ == "__main__":
    main()
