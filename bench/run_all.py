"""Run every benchmark under bench/ and collect their JSON lines into bench/results.json.

    python bench/run_all.py [--quick]

Each benchmark runs in its own process (one cluster each); its last JSON line is kept.
--quick passes smaller sizes, for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent

BENCHES = [
    ("dispatch.py", [], ["--runs", "2", "--steps", "200"]),
    ("runtime.py", [], ["--runs", "1", "--mib", "16"]),
    ("fig5_dispatch_overhead.py", [], ["--runs", "2", "--steps", "256", "--no-ray"]),
    ("fig7_parallel_dispatch.py", [], ["--hosts", "4", "--stages", "1,2,4",
                                       "--chains", "5", "--runs", "1"]),
    ("dcn.py", [], ["--runs", "2", "--mib", "16"]),
    ("train.py", [], ["--runs", "1", "--steps", "5"]),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    results = {}
    for script, full, quick in BENCHES:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(HERE / script)] + (quick if args.quick
                                                                        else full),
                              capture_output=True, text=True, cwd=HERE)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode != 0 or not lines:
            results[script] = {"error": proc.stderr[-2000:], "returncode": proc.returncode}
        else:
            results[script] = json.loads(lines[-1])
        results[script]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(script, json.dumps(results[script]), flush=True)
    (HERE / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
