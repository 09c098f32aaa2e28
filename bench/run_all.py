"""Run every benchmark under bench/, collect their JSON lines into bench/results.json,
and regenerate docs/evaluation.md (bench/report.py).

    python bench/run_all.py [--quick] [--only fig6_computation_size.py,...] [--no-report]

Each benchmark runs in its own process (one cluster each); its last JSON line is kept,
with its wall time. A benchmark that fails or runs past --timeout is recorded with its
error and the others still run. --quick passes smaller sizes, for a smoke run. The full
run takes about 15-18 minutes on the 2-core development machine (more while other work
shares its cores); its headline ratios come from interleaved rounds (bench/common.py),
and bench/compare_runs.py tells whether two full runs agree.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import signal
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results.json"

# (script, full-run args, --quick args). The full-run args are sized so that the whole
# run stays under 20 minutes on 2 cores (about 17 with the rounds below).
BENCHES = [
    ("dispatch.py", ["--runs", "5", "--steps", "1000"], ["--runs", "2", "--steps", "200"]),
    ("runtime.py", ["--runs", "7", "--mib", "64"], ["--runs", "2", "--mib", "16"]),
    # Feeding a trainer: client puts against pw.DataLoader on 1 and 2 hosts (~40 s).
    ("input.py", ["--rounds", "7", "--steps", "60", "--image", "128"],
     ["--rounds", "1", "--steps", "10", "--image", "32"]),
    # Headline ratios come from interleaved rounds (median of per-round ratios, its
    # spread: min-max below 7 rounds, the interquartile range from 7 up; common.py).
    # fig5: 8,192 calls a round (~0.4 s a variant): with 2,048 (~0.1 s) single rounds
    # of the same commit ranged 0.78-1.11 of in-process, the IQR crossing its bar.
    ("fig5_dispatch_overhead.py", ["--runs", "21", "--steps", "8192"],
     ["--runs", "3", "--steps", "256", "--no-ray"]),
    ("fig6_computation_size.py", ["--runs", "5"],
     ["--runs", "1", "--sizes", "16,128,512", "--target-s", "0.1"]),
    ("fig7_parallel_dispatch.py", ["--hosts", "16", "--chains", "20", "--runs", "5"],
     ["--hosts", "4", "--stages", "1,2,4", "--chains", "5", "--runs", "1",
      "--no-ray"]),
    ("dcn.py", ["--runs", "9", "--mib", "64"], ["--runs", "2", "--mib", "16"]),
    # Every configuration built once per batch size, then 7 rounds of one 4-step block
    # each (~5 min).
    ("train.py", ["--runs", "7", "--steps", "4", "--batches", "64,16"],
     ["--runs", "2", "--steps", "2", "--batches", "64,16"]),
    # 20,000 small programs with random releases and cross-island transfers: the
    # workers' memory, buffers, threads and fds against their baseline (~1 min).
    ("soak.py", ["--programs", "20000", "--sample-every", "500"],
     ["--programs", "2000", "--sample-every", "100"]),
    # Real SIGKILLs: worker, transfer sender, client; back-pressure resume (~1.5 min).
    ("faults.py", [], []),
    # The control plane at scale: the real coordinator and 16 to 2,048 fake hosts, a real
    # client against fake executors (~2-3 min).
    ("scale.py", ["--hosts", "16,256,1024,2048"], ["--fast"]),
    # Slices that span hosts: torch_xla against jaxlib on one module, gloo against raw
    # TCP (~1.5 min), and a training step on 2 hosts x 2 against 1 x 4 (~1 min).
    ("multihost.py", ["--rounds", "3"], ["--rounds", "1", "--steps", "5"]),
    ("spanning.py", ["--rounds", "5"], ["--rounds", "2", "--steps", "5"]),
    # An optimizer from outside torch.optim (its Python numbers as inputs) against
    # torch.optim's own path, per step (~1 min).
    ("optimizers.py", ["--rounds", "7"], ["--rounds", "2", "--steps", "10"]),
    # An AveragedModel updated on the workers (ema=) against the script's own
    # update_parameters call after each step, and against no EMA (~30 s).
    ("ema.py", ["--rounds", "7"], ["--rounds", "2", "--steps", "5"]),
    # Pipeline stages on 2-device slices, their micro-batches split (axis=) or not,
    # beside DataParallel on the same 4 devices (~2 min).
    ("pipeline_axis.py", ["--rounds", "5", "--steps", "6"],
     ["--rounds", "1", "--steps", "2"]),
]

# Run only where the script exists (benchmarks other work adds): paper Figures 8 and 9.
OPTIONAL = [
    ("fig9_shares.py", ["--rounds", "7"],
     ["--rounds", "2", "--seconds", "1.5", "--share-seconds", "2"]),
]


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*argv):
        try:
            return subprocess.run(["git", *argv], cwd=HERE.parent, capture_output=True,
                                  text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "torch": version("torch"), "torch_xla": version("torch_xla"),
            "ray": version("ray"), "commit": git("rev-parse", "--short", "HEAD") or None,
            # the runtime measured had uncommitted changes (bench/ and docs/ not counted)
            "dirty": bool(git("status", "--porcelain", "--", "pathways_torch", "recipes"))}


def run_one(script: str, argv: list, timeout: float) -> dict:
    t0 = time.perf_counter()
    # Its own session, so that a timeout (or Ctrl-C) also ends what it started.
    proc = subprocess.Popen([sys.executable, str(HERE / script)] + argv, cwd=HERE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        res = {"error": f"timed out after {timeout:.0f} s\n" + (err or "")[-2000:],
               "returncode": None}
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    else:
        lines = [l for l in out.splitlines() if l.startswith("{")]
        if proc.returncode != 0 or not lines:
            res = {"error": err[-2000:], "returncode": proc.returncode}
        else:
            res = json.loads(lines[-1])
    res["args"] = argv
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated scripts to run")
    ap.add_argument("--timeout", type=float, default=720,
                    help="seconds one benchmark may run before it is recorded as failed")
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    todo = [b for b in BENCHES + [o for o in OPTIONAL if (HERE / o[0]).exists()]
            if not only or b[0] in only]
    t_start = time.perf_counter()
    meta = dict(machine(), date=datetime.datetime.now().astimezone().isoformat(
        timespec="seconds"), mode="quick" if args.quick else "full")
    results = {"_meta": meta}
    if only and RESULTS.exists():                  # a partial run updates the last results
        results = json.loads(RESULTS.read_text())
        meta = results.setdefault("_meta", meta)
    for script, full, quick in todo:
        results[script] = run_one(script, quick if args.quick else full, args.timeout)
        if only:        # measured apart from the run that _meta describes: say when
            now = machine()
            results[script]["measured_at"] = {
                "commit": now["commit"], "dirty": now["dirty"],
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        print(script, json.dumps(results[script]), flush=True)
        if not only:
            meta["total_wall_s"] = round(time.perf_counter() - t_start, 1)
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_report:
        subprocess.run([sys.executable, str(HERE / "report.py"), str(RESULTS)], check=True)


if __name__ == "__main__":
    main()
