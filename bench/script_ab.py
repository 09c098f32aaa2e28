"""Any benchmark script of this tree against another revision, interleaved.

Runs ``bench/SCRIPT ARGS`` from a ``git worktree`` of the baseline revision and from this
tree in turn (A, B, A, B, ...), each a fresh process with its own embedded cluster and
its own ``pathways_torch`` (PYTHONPATH points at the tree), and compares one number of
their JSON output: the median of the per-round ratios (this tree / baseline) with their
spread. Scripts that measure themselves against an in-process baseline (dispatch.py's
``ratio_pathways_over_in_process``) give the steadiest figure.

    python bench/script_ab.py --baseline dca0dc9 --script dispatch.py \\
        --args "--steps 1000 --runs 3" --key pathways_us_per_step --rounds 5

``--key`` may be repeated: each number is compared over the same runs. A script that
the baseline lacks runs from this tree against both trees' packages
(``--script-from-here``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tempfile
import time

from common import emit, median

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(tree: pathlib.Path, script: str, argv: list, here: bool = False) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    bench = (ROOT if here else tree) / "bench"
    out = subprocess.run([sys.executable, str(bench / script)] + argv,
                         cwd=bench, env=env, capture_output=True, text=True,
                         timeout=1800)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{script} in {tree} failed:\n{out.stderr[-2000:]}")
    return json.loads(lines[-1])


def pick(result: dict, key: str) -> float:
    value = result
    for part in key.split("."):
        value = value[part]
    return float(value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="a git revision of this repository")
    ap.add_argument("--script", required=True, help="a script under bench/")
    ap.add_argument("--args", default="", help="its arguments, one string")
    ap.add_argument("--key", required=True, action="append",
                    help="the number to compare (dotted path into its JSON); repeat the "
                         "flag to compare several numbers of the same runs")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--script-from-here", action="store_true",
                    help="run this tree's copy of the script for the baseline too")
    args = ap.parse_args()
    argv = shlex.split(args.args)
    base = pathlib.Path(tempfile.mkdtemp(prefix="pw-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base),
                    args.baseline], check=True, capture_output=True)
    rows: dict = {key: [] for key in args.key}
    try:
        for r in range(args.rounds):
            a_out = run(base, args.script, argv, args.script_from_here)
            b_out = run(ROOT, args.script, argv)
            for key in args.key:
                a, b = pick(a_out, key), pick(b_out, key)
                rows[key].append((a, b, b / a))
                print(f"round {r}: {key}: baseline {a:.4g}, this {b:.4g}, ratio {b / a:.3f}",
                      file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)],
                       capture_output=True)

    def summary(key: str) -> dict:
        ratios = sorted(x[2] for x in rows[key])
        return {"key": key, "baseline_median": round(median([x[0] for x in rows[key]]), 4),
                "this_median": round(median([x[1] for x in rows[key]]), 4),
                "ratio_median": round(median(ratios), 3), "ratio_min": round(ratios[0], 3),
                "ratio_max": round(ratios[-1], 3)}

    out = {"benchmark": "script_ab", "script": args.script, "args": argv,
           "baseline": args.baseline, "rounds": args.rounds}
    if len(args.key) == 1:
        out.update(summary(args.key[0]))
    else:
        out["keys"] = [summary(key) for key in args.key]
    emit(dict(out, time=time.strftime("%Y-%m-%d %H:%M")))


if __name__ == "__main__":
    main()
