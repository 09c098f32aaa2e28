"""Do two benchmark runs agree? Compares the headlines of two results.json files.

    python bench/compare_runs.py A.json B.json [--tolerance 0.15] [--json]

For every headline of docs/evaluation.md (as bench/report.py builds it from each file):
the same verdict (met / not met / undecided) in both runs, and, for a ratio, medians
within --tolerance of each other (max(a/b, b/a) - 1 <= 0.15: issue 16's "each headline
ratio within 15 % of the other run"). A headline present in one run only is reported
and counts as a disagreement. Figures that are not ratios (seconds, ms, sizes) are
compared by verdict only. Prints a table (or --json) and exits 1 if anything disagrees,
0 if the runs agree.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from report import headlines  # noqa: E402


def compare(a: dict, b: dict, tolerance: float = 0.15) -> list:
    """One row per headline: what, both values, both verdicts, and what disagrees."""
    ha = {h["what"]: h for h in headlines(a)}
    hb = {h["what"]: h for h in headlines(b)}
    rows = []
    for what in list(ha) + [w for w in hb if w not in ha]:
        x, y = ha.get(what), hb.get(what)
        row = {"what": what, "a": x and x["shown"], "b": y and y["shown"],
               "verdict_a": x and x["verdict"], "verdict_b": y and y["verdict"],
               "problems": []}
        if x is None or y is None:
            row["problems"].append("only in " + ("B" if x is None else "A"))
            rows.append(row)
            continue
        if x["verdict"] != y["verdict"]:
            row["problems"].append("verdicts differ")
        if x["kind"] == "ratio" and y["kind"] == "ratio":
            ma, mb = x.get("median"), y.get("median")
            if ma and mb and ma > 0 and mb > 0:
                row["apart"] = round(max(ma / mb, mb / ma) - 1, 3)
                if row["apart"] > tolerance:
                    row["problems"].append(f"ratios {row['apart']:.0%} apart "
                                           f"(> {tolerance:.0%})")
            elif ma != mb:
                row["problems"].append("a ratio is missing or not positive")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = ap.parse_args()
    a, b = (json.loads(pathlib.Path(p).read_text()) for p in (args.a, args.b))
    rows = compare(a, b, args.tolerance)
    bad = [r for r in rows if r["problems"]]
    notes = []
    ma, mb = a.get("_meta", {}), b.get("_meta", {})
    if ma.get("mode") != mb.get("mode"):
        notes.append(f"the runs differ in mode: {ma.get('mode')} vs {mb.get('mode')}")
    differ = sorted(k for k, v in a.items() if isinstance(v, dict) and k != "_meta"
                    and isinstance(b.get(k), dict) and v.get("args") != b[k].get("args"))
    if differ:
        notes.append("benchmarks run with other arguments: " + ", ".join(differ))
    for name, res in (("A", a), ("B", b)):
        alone = sorted(k for k, v in res.items() if isinstance(v, dict) and "measured_at" in v)
        if alone:
            notes.append(f"{name} has benchmarks rerun alone (run_all.py --only): "
                         + ", ".join(alone))
    if args.json:
        print(json.dumps({"agree": not bad, "tolerance": args.tolerance, "notes": notes,
                          "headlines": rows}, indent=2))
    else:
        def cell(v):
            return "–" if v is None else str(v)
        print(f"A: {args.a}\nB: {args.b}\n")
        print("| what | A | B | verdict A | verdict B | apart | agree |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            apart = f"{r['apart']:.0%}" if "apart" in r else "–"
            print(f"| {r['what']} | {cell(r['a'])} | {cell(r['b'])} | "
                  f"{cell(r['verdict_a'])} | {cell(r['verdict_b'])} | {apart} | "
                  + ("yes" if not r["problems"] else "**no**: " + "; ".join(r["problems"]))
                  + " |")
        print(f"\n{len(rows) - len(bad)} of {len(rows)} headlines agree"
              + ("." if not bad else f"; {len(bad)} do not."))
        for n in notes:
            print(f"Note: {n}.")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
