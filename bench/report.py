"""Write docs/evaluation.md and its plots (docs/img/*.png) from bench/results.json.

    python bench/report.py [bench/results.json] [--out DIR]

``--out DIR`` writes DIR/evaluation.md and DIR/img/*.png instead of docs/ (to look at a
report of other results without touching the generated one).

Every measured number in the report comes from results.json (`make bench` writes it,
then runs this). What is written here by hand is only what the paper reports and the
bars the issues set, each labelled as such. A benchmark that is missing or failed is
reported as not measured, with its error.
"""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "evaluation.md"
IMG = ROOT / "docs" / "img"

# Bars: what the paper reports, and the targets the issues set. Not measurements.
BAR = {
    "op_by_op_over_in_process": 1.0,      # issue 16 (dataflow issue: 1.5; core runtime: 3.0)
    "chained_over_in_process": 0.5,       # issue 16
    "chained_over_ray": 0.5,
    "fig7_ratio": 2.0,
    "clients_4_over_1": 1.0,              # issue 16 (paper Figure 8: at least JAX's)
    "wire_over_tcp": 0.5,
    "spmd_parity": 0.95,
    "pipeline": 0.9,                      # issue 16: S=4, 8 micro-batches of 2 sequences
    "two_islands": 0.9,
    "bulk_over_tcp": 0.7,                 # issue 15: puts and fetches
    "move_over_tcp": 0.6,                 # issue 15: island to island, end to end
    "host2_over_client": 2.0,             # issue 15: two hosts feeding vs client puts
}
# Issue 12, part 5 (bench/scale.py carries them too, with its verdicts).
BARS_SCALE = {"register_s": 3.0, "idle_cpu_core": 0.10, "alloc_p50_ms": 3.0,
              "silent_lost_s": 5.0, "wait_k64_over_k1": 3.0}


# ---------------------------------------------------------------------------- helpers

def num(x, digits=None) -> str:
    """A number for a table: thousands separators, sensible precision."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    if digits is None:
        ax = abs(x)
        digits = 0 if ax >= 100 else 1 if ax >= 10 else 2 if ax >= 0.1 else 3
    return f"{x:,.{digits}f}"


def ratio(x) -> str:
    return "–" if x is None else f"{x:.2f}"


def med(x):
    """The median of a ratio summary (``common.ratio_summary``: ``{"median", "lo", "hi",
    "rounds", ...}``; older results: ``{"median", "min", "max"}``) or a plain number."""
    return x.get("median") if isinstance(x, dict) else x


def lohi(x):
    """The spread of a ratio summary as (lo, hi), or None (a plain number)."""
    if not isinstance(x, dict):
        return None
    lo, hi = x.get("lo", x.get("min")), x.get("hi", x.get("max"))
    return None if lo is None or hi is None else (lo, hi)


def spread(x) -> str:
    """A ratio with its spread: ``0.48 (0.38–0.51, 9 rounds)``; a plain number as is."""
    span = lohi(x)
    if span is None:
        return ratio(med(x))
    n = x.get("rounds")
    return (f"{ratio(x.get('median'))} ({ratio(span[0])}–{ratio(span[1])}"
            + (f", {n} round{'' if n == 1 else 's'}" if n else "") + ")")


def met(value, bar, higher_is_better=True) -> str:
    """The verdict on a ratio against its bar: a plain number is met or not; a ratio
    summary is met / not met only when its whole spread lies on one side of the bar,
    else undecided."""
    m = med(value)
    if m is None:
        return "–"

    def ok(v):
        return v >= bar if higher_is_better else v <= bar
    lo, hi = lohi(value) or (m, m)
    if ok(lo) and ok(hi):
        return "met"
    if not ok(lo) and not ok(hi):
        return "**not met**"
    return "undecided (spread crosses the bar)"


def verdict_word(v: str):
    """``met`` / ``not met`` / ``undecided`` / None (no bar) from a verdict cell."""
    v = (v or "").replace("*", "").strip()
    for w in ("not met", "undecided", "met"):
        if v.startswith(w):
            return w
    return None


def table(header, rows) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


class Report:
    def __init__(self, results: dict):
        self.r = results
        self.parts: list[str] = []
        self.headlines: list[tuple] = []       # (what, value, bar, verdict): the table
        self.records: list[dict] = []         # the same, for bench/compare_runs.py
        self.images: list[str] = []
        self.img_dir = IMG                    # None: build no plots files

    def headline(self, what, value, bar=None, higher_is_better=True, note="",
                 verdict=None) -> None:
        """One headline row. ``value``: a ratio (a summary dict or a plain number) when
        ``bar`` is a number or None; otherwise a figure (text) with its own ``bar`` text
        and ``verdict``."""
        is_ratio = isinstance(value, (dict, int, float)) and not isinstance(value, bool)
        if is_ratio:
            cell = spread(value) + (f"; {note}" if note else "")
            bar_txt = "–" if bar is None else f"{'≥' if higher_is_better else '≤'} {bar}"
            verdict = "–" if bar is None else met(value, bar, higher_is_better)
        else:
            cell, bar_txt, verdict = value, bar or "–", verdict or "–"
        self.headlines.append((what, cell, bar_txt, verdict))
        rec = {"what": what, "kind": "ratio" if is_ratio else "figure",
               "verdict": verdict_word(verdict), "shown": cell, "bar": bar_txt}
        if is_ratio:
            span = lohi(value)
            rec.update(median=med(value), lo=span and span[0], hi=span and span[1],
                       rounds=value.get("rounds") if isinstance(value, dict) else None,
                       interleaved=isinstance(value, dict) and "rounds" in value)
        self.records.append(rec)

    def add(self, *text):
        self.parts.extend(text)

    def get(self, script):
        """The result of ``script``, or None (and a note in the report) if absent/failed."""
        res = self.r.get(script)
        if res is None:
            self.add(f"*Not measured in this run* (`bench/{script}` did not run).\n")
            return None
        if "error" in res:
            err = (res.get("error") or "").strip().splitlines()[-3:]
            self.add(f"*Not measured in this run*: `bench/{script}` failed "
                     f"(exit {res.get('returncode')}):\n\n```\n" + "\n".join(err)
                     + "\n```\n")
            return None
        return res

    def plot(self, name, fig) -> None:
        import matplotlib.pyplot as plt
        if self.img_dir is not None:
            self.img_dir.mkdir(parents=True, exist_ok=True)
            fig.tight_layout()
            fig.savefig(self.img_dir / name, dpi=90, metadata={"Software": None})
        plt.close(fig)
        self.images.append(name)
        self.add(f"![{name}](img/{name})\n")


def plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as p
    return p


def source(res, script) -> str:
    args = " ".join(res.get("args") or [])
    at = res.get("measured_at")         # rerun alone (run_all.py --only), not in the run
    when = (f"; rerun alone at commit {at.get('commit')}"
            f"{' with uncommitted runtime changes' if at.get('dirty') else ''}, "
            f"{at.get('date')}" if at else "")
    return (f"`bench/{script}{(' ' + args) if args else ''}`, "
            f"{num(res.get('wall_s'), 0)} s{when}")


# ---------------------------------------------------------------------------- sections

def fig5(rep: Report) -> None:
    rep.add("## Dispatch overhead (paper Figure 5)\n",
            "Paper: per-computation time of OpByOp (one client call per computation), "
            "Chained (128 computations as 128 dataflow nodes in one call) and Fused (one "
            "node containing all 128) against JAX; Fused matches JAX up to ~1000 cores, "
            "Chained beats JAX OpByOp up to 256 cores, Ray is ~10x slower per "
            "computation.\n")
    res = rep.get("fig5_dispatch_overhead.py")
    if res is None:
        return
    ip = res.get("in_process_us")
    ray = res.get("ray_actor_us")
    rows = [["in-process lazy torch_xla (`y = y + 1; torch_xla.sync()`), baseline",
             num(ip), "1.00", ratio(ip / ray) if ray and ip else "–"]]
    names = {"op_by_op": "OpByOp: one `@pw.program` call per computation",
             "chained": f"Chained: {res.get('block')} calls per `pw.graph()` submission",
             "fused": f"Fused: one program of {res.get('block')} additions"}
    for k, label in names.items():
        rows.append([label, num(res.get(f"{k}_us")), spread(res.get(f"{k}_over_in_process")),
                     spread(res.get(f"{k}_over_ray")) if ray and res.get(f"{k}_over_ray")
                     else "–"])
    if ray:
        rows.append(["Ray actor, one chained `.remote()` per computation (CPU torch add)",
                     num(ray), ratio(ray / ip) if ip else "–", "1.00"])
    rounds = res.get("rounds")
    how = (f"{rounds} interleaved rounds (every variant once a round, the order reversed "
           "every other round); µs: medians over rounds; ratios: the median of the "
           "per-round ratios with their spread" if rounds else
           f"medians of {res.get('runs')} runs")
    rep.add(f"A chain of {num(res.get('steps'))} computations `y + 1` on 8x8 float32, each "
            f"consuming the previous result, on one worker with one device; {how} "
            f"({source(res, 'fig5_dispatch_overhead.py')}).\n",
            table(["variant", "µs per computation", "vs in-process", "vs Ray"], rows) + "\n",
            f"Bars (issue 16): OpByOp at most {BAR['op_by_op_over_in_process']}x the "
            "in-process time: "
            f"{met(res.get('op_by_op_over_in_process'), BAR['op_by_op_over_in_process'], False)}"
            f"; Chained at most {BAR['chained_over_in_process']}x: "
            f"{met(res.get('chained_over_in_process'), BAR['chained_over_in_process'], False)}"
            f"; Chained at most {BAR['chained_over_ray']}x Ray's: "
            + (met(res.get("chained_over_ray"), BAR["chained_over_ray"], False) if ray
               else "Ray not measured in this run") + "."
            + (" Ray runs before the cluster starts, so the two never share the cores: "
               "its ratios divide each round's time by Ray's median (not interleaved)."
               if ray and rounds else "") + "\n")
    rep.headline("OpByOp dispatch vs in-process torch_xla (time, Fig. 5)",
                 res.get("op_by_op_over_in_process"), BAR["op_by_op_over_in_process"], False)
    rep.headline("Chained dispatch vs in-process torch_xla (time, Fig. 5)",
                 res.get("chained_over_in_process"), BAR["chained_over_in_process"], False)
    if ray:
        rep.headline("Chained dispatch vs Ray actor calls (time, Fig. 5)",
                     res.get("chained_over_ray"), BAR["chained_over_ray"], False,
                     note="Ray apart" if rounds else "")
    p = plt()
    labels, vals, colors = ["in-process"], [ip], ["#777777"]
    for k, lab in (("op_by_op", "OpByOp"), ("chained", "Chained"), ("fused", "Fused")):
        if res.get(f"{k}_us") is not None:
            labels.append(lab), vals.append(res[f"{k}_us"]), colors.append("#1f77b4")
    if ray:
        labels.append("Ray actor"), vals.append(ray), colors.append("#d62728")
    fig, ax = p.subplots(figsize=(6, 3.2))
    bars = ax.bar(labels, vals, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("µs per computation (log)")
    ax.set_title("Figure 5 analogue: dispatch overhead, 1 worker")
    for b, v in zip(bars, vals):
        ax.annotate(num(v), (b.get_x() + b.get_width() / 2, v), ha="center",
                    va="bottom", fontsize=8)
    rep.plot("fig5_dispatch.png", fig)

    d = rep.r.get("dispatch.py")
    if d and "error" not in d:
        rep.add(f"`bench/dispatch.py` (OpByOp alone, a chain of {num(d.get('steps'))}, "
                f"{d.get('runs')} runs, {num(d.get('wall_s'), 0)} s): in-process "
                f"{num(d.get('in_process_us_per_step'))} µs, pathways_torch "
                f"{num(d.get('pathways_us_per_step'))} µs per step, "
                f"**{spread(d.get('ratio_pathways_over_in_process'))}x**.\n")


def fig6(rep: Report) -> None:
    rep.add("## Computation size for in-process throughput (paper Figure 6)\n",
            "Paper: the smallest computation at which Pathways matches JAX's throughput: "
            "about 2.3 ms on 16 hosts, 35 ms on 512 hosts.\n")
    res = rep.get("fig6_computation_size.py")
    if res is None:
        return
    sizes = res.get("sizes", {})
    ns = sorted(sizes, key=int)
    thr = res.get("threshold")
    rows = []
    for n in ns:
        v = sizes[n]
        rows.append([f"{n}x{n}", num(v.get("in_process_us")), num(v.get("op_by_op_us")),
                     ratio(v.get("op_by_op_rel_throughput")), num(v.get("chained_us")),
                     ratio(v.get("chained_rel_throughput"))])
    rep.add(f"One computation is `{res.get('computation')}`, chained (each consumes the "
            "previous result) on a 1-device slice; the computation size is its in-process "
            "time. Relative throughput = in-process time / pathways_torch time (1.00 = "
            "parity), per run from measurements made next to each other, median over runs; "
            f"Chained records {res.get('block')} calls per graph; medians of "
            f"{res.get('runs')} runs ({source(res, 'fig6_computation_size.py')}).\n",
            table(["n", "in-process µs (size)", "OpByOp µs", "OpByOp rel. throughput",
                   "Chained µs", "Chained rel. throughput"], rows) + "\n")
    lines = []
    for k, lab in (("op_by_op", "OpByOp"), ("chained", "Chained")):
        par = (res.get("parity") or {}).get(k)
        first = (res.get("first_reach") or {}).get(k)
        if par:
            txt = (f"{lab} stays at >= {thr} of in-process throughput from n = {par['n']} "
                   f"(a {num(par['in_process_ms'])} ms computation) up")
        else:
            txt = f"{lab} does not stay at >= {thr} of in-process throughput up to the largest size"
        if first:
            txt += (f"; it first reaches it at n = {first['n']} "
                    f"({num(first['in_process_ms'])} ms)")
        lines.append("- " + txt + ".")
        if par or first:
            val = "; ".join(
                ([f"first at {num(first['in_process_ms'])} ms (n = {first['n']})"]
                 if first else [])
                + ([f"from {num(par['in_process_ms'])} ms (n = {par['n']}) up"] if par
                   else []))
            rep.headline(f"Computation size for ≥ {thr} of in-process throughput, "
                         f"{lab} (Fig. 6)", val, "paper: parity at 2.3 ms (16 hosts)")
    rep.add("\n".join(lines) + "\n")
    p = plt()
    fig, ax = p.subplots(figsize=(6.4, 3.6))
    xs = [int(n) for n in ns]
    for k, lab, m in (("op_by_op", "OpByOp", "o-"), ("chained", "Chained", "s-")):
        ax.plot(xs, [sizes[n][f"{k}_rel_throughput"] for n in ns], m, label=lab)
    ax.axhline(1.0, color="#777777", lw=0.8)
    if thr:
        ax.axhline(thr, color="#d62728", lw=0.8, ls="--", label=f"{thr} of in-process")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{n}\n{sizes[n]['in_process_us'] / 1e3:.2g} ms" for n in ns],
                  fontsize=8)
    ax.set_xlabel("n (matrix size) and in-process ms per computation")
    ax.set_ylabel("throughput / in-process")
    ax.set_title("Figure 6 analogue: relative throughput vs computation size")
    ax.legend(fontsize=8)
    rep.plot("fig6_computation_size.png", fig)


def fig7(rep: Report) -> None:
    rep.add("## Parallel vs sequential dispatch (paper Figure 7)\n",
            "Paper: a chain of 1 to 128 stages, each on a different host; parallel "
            "asynchronous dispatch gives clearly more computations per second than "
            "sequential dispatch.\n")
    res = rep.get("fig7_parallel_dispatch.py")
    if res is None:
        return
    st = res.get("stages", {})
    ks = sorted(st, key=int)
    has_ray = any(st[k].get("ray_per_s") for k in ks)
    rows = [[k, num(st[k].get("parallel_per_s")), num(st[k].get("sequential_per_s")),
             f"**{spread(st[k].get('ratio'))}**"]
            + ([num(st[k].get("ray_per_s")), spread(st[k].get("parallel_over_ray"))]
               if has_ray else []) for k in ks]
    how = (f"{res['rounds']} interleaved rounds of parallel and sequential per stage "
           "count; computations/s: medians over rounds, ratios: the median of the "
           "per-round ratios with their spread" if res.get("rounds") else
           f"medians of {res.get('runs')} runs")
    rep.add(f"{res.get('hosts')} hosts of one device, stage i on host i (`x + 1` on 8x8, "
            f"moved worker to worker), {res.get('chains')} chains per measurement, {how} "
            f"({source(res, 'fig7_parallel_dispatch.py')}).\n",
            table(["stages", "parallel, computations/s", "sequential, computations/s",
                   "parallel / sequential"]
                  + (["Ray actors, computations/s", "parallel / Ray"] if has_ray else []),
                  rows) + "\n")
    if has_ray:
        rep.add("Ray: the same chains over as many Ray actors (stage i on actor i, each "
                "`.remote()` taking the previous stage's ObjectRef, so Ray dispatches "
                "ahead too), numpy 8x8 instead of XLA, run before the cluster starts (not "
                "interleaved: the ratio divides each round's parallel rate by Ray's "
                "median).\n")
    # A chain of one stage has nothing to dispatch ahead of (one host, one program at a
    # time): parallel and sequential dispatch are the same there, and the bar is about
    # chains over several hosts.
    rr = {k: st[k]["ratio"] for k in ks if st[k].get("ratio") is not None and int(k) > 1}
    if rr:
        # The stage count with the lowest median is the headline; the verdict holds for
        # every stage count of 2 or more (met only if met at each, not met if not met at
        # any).
        low = min(rr, key=lambda k: med(rr[k]))
        verdicts = [met(v, BAR["fig7_ratio"]) for v in rr.values()]
        word = ("**not met**" if "**not met**" in verdicts else
                "met" if all(v == "met" for v in verdicts) else
                "undecided (spread crosses the bar)")
        rep.add(f"Bar (issue): parallel at least {BAR['fig7_ratio']}x sequential at every "
                f"stage count from 2 (one stage has nothing to overlap): {word} (lowest "
                f"{spread(rr[low])} at {low} stages).\n")
        at = f"{low} stage{'' if str(low) == '1' else 's'}"
        rep.headline("Parallel vs sequential dispatch (computations/s, Fig. 7)", rr[low],
                     BAR["fig7_ratio"], note=f"lowest, at {at}")
        if rep.headlines[-1][3] != word:      # another stage count decides the verdict
            rep.headlines[-1] = rep.headlines[-1][:3] + (word,)
            rep.records[-1]["verdict"] = verdict_word(word)
    ro = {k: st[k]["parallel_over_ray"] for k in ks if st[k].get("parallel_over_ray")}
    if ro:
        low = min(ro, key=lambda k: med(ro[k]))
        rep.headline("Parallel dispatch vs Ray actors across hosts (computations/s, Fig. 7)",
                     ro[low], note=f"lowest, at {low} stage{'' if str(low) == '1' else 's'}"
                     "; Ray apart")
    p = plt()
    fig, ax = p.subplots(figsize=(6, 3.2))
    x = [int(k) for k in ks]
    ax.plot(x, [st[k]["parallel_per_s"] for k in ks], "o-", label="parallel")
    ax.plot(x, [st[k]["sequential_per_s"] for k in ks], "s-", label="sequential")
    if has_ray:
        ax.plot(x, [st[k].get("ray_per_s") for k in ks], "^--", color="#d62728",
                label="Ray actors")
    for xi, k in zip(x, ks):
        ax.annotate(f"{ratio(med(st[k]['ratio']))}x", (xi, st[k]["parallel_per_s"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_yscale("log")
    top = max(st[k]["parallel_per_s"] for k in ks)
    ax.set_ylim(top=top * 1.8)
    ax.set_xlabel("stages (one host each)")
    ax.set_ylabel("computations / s (log)")
    ax.set_title("Figure 7 analogue: parallel vs sequential dispatch\n"
                 "(labels: parallel / sequential)", fontsize=10)
    ax.legend(fontsize=8)
    rep.plot("fig7_parallel_dispatch.png", fig)


def fig9(rep: Report) -> None:
    rep.add("## Multi-tenancy: clients and proportional shares (paper Figures 8 and 9)\n",
            "Paper: 1 to 256 clients submitting programs of 0.04 to 2.4 ms reach at least "
            "JAX's aggregate throughput; 4 clients with shares 1:1:1:1 and 1:2:4:8 receive "
            "device time in those proportions.\n")
    res = rep.get("fig9_shares.py")
    if res is None:
        return
    clients, thr = res.get("clients") or [], res.get("throughput") or []
    setup = []
    if res.get("devices"):
        setup.append(f"one host with {res['devices']} devices shared by every client")
    if res.get("seconds"):
        setup.append(f"each measured over the same {res['seconds']:g} s window")
    if res.get("rounds"):
        setup.append(f"{res['rounds']} interleaved rounds of 1, 2 and 4 clients (one pool "
                     "of 4 client processes, the others idle; the order reversed every "
                     "other round): programs/s are medians over rounds, ratios the median "
                     "of the per-round ratios with their spread")
    rep.add("Every client is its own process keeping its queue full; "
            + (", ".join(setup) + "; " if setup else "")
            + f"{source(res, 'fig9_shares.py')}.\n")
    if clients and thr:
        base = thr[0] if clients[0] == 1 and thr[0] else None

        def vs1(c, t):
            if c == 1:
                return "1.00"
            got = res.get(f"aggregate_{c}_over_1")
            return spread(got) if got else ratio(t / base) if base else "–"
        rep.add("Aggregate throughput by number of equal clients (the first row, one "
                "client, is the baseline):\n",
                table(["clients", "programs/s, all clients", "vs 1 client"],
                      [[c, num(t), vs1(c, t)] for c, t in zip(clients, thr)]) + "\n")
        last = res.get(f"aggregate_{clients[-1]}_over_1") or (
            thr[-1] / base if base else None)
        if last is not None and len(clients) > 1:
            rep.headline(f"Aggregate throughput, {clients[-1]} clients vs 1 (Fig. 8)", last,
                         BAR["clients_4_over_1"])
    shares = res.get("shares") or {}
    rows, errs = [], []
    for name, v in shares.items():
        w, m = v.get("weights") or [], v.get("measured") or []
        sw, sm = sum(w) or 1, sum(m) or 1
        for i, (a, b) in enumerate(zip(w, m)):
            rows.append([name, i, num(a / sw, 3), num(b / sm, 3),
                         ratio((b / sm) / (a / sw)) if a else "–"])
        err = v.get("max_relative_error")
        if err is None and w and m:
            err = max(abs(b / sm - a / sw) / (a / sw) for a, b in zip(w, m) if a)
        if err is not None:
            errs.append((name, err, v.get("busy_fraction_of_window")))
    if rows:
        rep.add("Device-time shares (each normalised to its total):\n",
                table(["shares", "client", "target share", "measured share",
                       "measured / target"], rows) + "\n")
    if errs:
        rep.add("\n".join(
            f"- {name}: largest relative error of a client's share {num(e * 100, 1)} %"
            + (f"; the devices were busy {num(b * 100, 0)} % of the window" if b else "")
            + "." for name, e, b in errs) + "\n")
        for name, e, _ in errs:
            rep.headline(f"Shares {name}: largest relative error (Fig. 9)",
                         f"{num(e * 100, 1)} %")
    p = plt()
    if clients and thr:
        fig, ax = p.subplots(figsize=(6, 3.0))
        ax.plot(clients, thr, "o-")
        ax.set_xticks(clients)
        ax.set_ylim(0, max(thr) * 1.2)
        ax.set_xlabel("clients")
        ax.set_ylabel("programs / s, all clients")
        ax.set_title("Figure 8 analogue: clients")
        rep.plot("fig8_clients.png", fig)
    if shares:
        fig, axes = p.subplots(1, len(shares), figsize=(3 * len(shares), 3.0),
                               squeeze=False)
        for ax, (name, v) in zip(axes[0], shares.items()):
            w, m = v.get("weights") or [], v.get("measured") or []
            sw, sm = sum(w) or 1, sum(m) or 1
            idx = list(range(len(w)))
            ax.bar([i - 0.2 for i in idx], [a / sw for a in w], 0.4, label="target")
            ax.bar([i + 0.2 for i in idx], [b / sm for b in m[:len(w)]], 0.4,
                   label="measured")
            ax.set_title(name)
            ax.set_xlabel("client")
            ax.set_ylim(0, max([a / sw for a in w] + [b / sm for b in m] + [0.1]) * 1.3)
        axes[0][0].set_ylabel("share of device time")
        axes[0][0].legend(fontsize=8, loc="upper left", ncol=2)
        rep.plot("fig9_shares.png", fig)


def training(rep: Report) -> None:
    rep.add("## Training: SPMD parity, pipelining, two islands (paper Tables 1 and 2)\n",
            "Paper: Table 1, T5 under Pathways reaches exactly JAX's tokens/s; Table 2, a 3B "
            "decoder with GPipe: SPMD 125.7k tokens/s, S=4/M=16 133.7k, S=8/M=32 132.7k, "
            "S=16/M=64 131.4k (pipelining matches or beats SPMD); data parallel over two "
            "islands reaches ~97% of one island with twice the devices.\n")
    res = rep.get("train.py")
    if res is None:
        return
    spec = [
        ("SPMD parity: DataParallel, 4 devices", "pw_dp4",
         "plain torch_xla SPMD, 4 devices (own process)", "torch_xla_spmd4", "spmd_parity",
         BAR["spmd_parity"], "1.00 (Table 1)"),
        ("Pipeline, 2 stages x 8 micro-batches", "pw_pipe2", "DataParallel, 2 devices",
         "pw_dp2", "pipeline2_over_spmd2", BAR["pipeline"], "1.06 (S=4, Table 2)"),
        ("Pipeline, 4 stages x 8 micro-batches", "pw_pipe4", "DataParallel, 4 devices",
         "pw_dp4", "pipeline4_over_spmd4", BAR["pipeline"], "1.06 (S=4, Table 2)"),
        ("... 4 micro-batches per stage program (`per_program=4`)", "pw_pipe4_x4",
         "DataParallel, 4 devices", "pw_dp4", "pipeline4_x4_over_spmd4", BAR["pipeline"],
         "1.06 (S=4, Table 2)"),
        ("Two islands x 2 devices (MultiIsland)", "pw_two_islands",
         "DataParallel, one island of 4 devices", "pw_dp4", "two_islands_over_one",
         BAR["two_islands"], "0.97"),
    ]
    def rows_of(r):
        sps, tps = r.get("steps_per_s", {}), r.get("tokens_per_s", {})
        return [[what, num(sps.get(k), 2), num(tps.get(k)), base, num(sps.get(bk), 2),
                 f"**{spread(r.get(rk))}**", f"{bar}", met(r.get(rk), bar), paper]
                for what, k, base, bk, rk, bar, paper in spec]

    head = ["pathways_torch", "steps/s", "tokens/s", "baseline (same run)",
            "baseline steps/s", "ratio", "bar (issue)", "", "paper"]
    how = (f"{res['rounds']} interleaved rounds, each timing a block of {res.get('steps')} "
           "steps of every configuration (the order reversed every other round, after a "
           "dropped warm-up round); steps/s: medians over rounds; ratios: the median of "
           "the per-round ratios with their spread" if res.get("rounds") else
           f"steps per second over {res.get('steps')} timed steps, medians of "
           f"{res.get('runs')} runs")
    rep.add(f"The recipes' GPT ({res.get('model')}), AdamW, {how} "
            f"({source(res, 'train.py')}).\n",
            table(head, rows_of(res)) + "\n")
    for b, r in sorted((res.get("by_batch") or {}).items(), key=lambda kv: -int(kv[0])):
        if r.get("batch") == res.get("batch"):
            continue
        rep.add(f"The same at global batch {b} ({r.get('model')}): 2 sequences per "
                "micro-batch, so each pipeline program is a few milliseconds and the "
                "runtime's per-program cost (a pipeline step is 27 programs and 16 "
                "transfers at S=2, 61 and 48 at S=4) weighs against one SPMD program "
                "per step.\n", table(head, rows_of(r)) + "\n")
    rep.add("On this machine every device is a share of the same 2 cores, so a pipeline "
            "cannot win by overlapping stages and two islands cannot add compute; the "
            "ratios measure the runtime's overhead against the work per program.\n")
    rep.headline(f"SPMD training vs plain torch_xla SPMD, batch {res.get('batch')} "
                 "(steps/s, Table 1)", res.get("spmd_parity"), BAR["spmd_parity"])
    # issue 16's pipeline: 4 stages x 8 micro-batches of 2 sequences (batch 16)
    pipe = next((r for r in (res.get("by_batch") or {}).values()
                 if r.get("micro_batch", (r.get("batch") or 0) // 8) == 2), res)
    rep.headline(f"Pipeline S=4 (8 micro-batches of {(pipe.get('batch') or 0) // 8}) vs "
                 "DataParallel on 4 (steps/s, Table 2)", pipe.get("pipeline4_over_spmd4"),
                 BAR["pipeline"])
    if pipe.get("pipeline4_x4_over_spmd4"):
        rep.headline(f"Pipeline S=4, 8 micro-batches of {(pipe.get('batch') or 0) // 8} "
                     "in programs of 4 (`per_program=4`) vs DataParallel on 4 (steps/s)",
                     pipe.get("pipeline4_x4_over_spmd4"), BAR["pipeline"])
    rep.headline(f"Two islands vs one island, batch {res.get('batch')} (steps/s)",
                 res.get("two_islands_over_one"), BAR["two_islands"])
    p = plt()
    fig, ax = p.subplots(figsize=(6, 3.2))
    labels = ["SPMD parity", "pipeline S=2", "pipeline S=4", "S=4, 4 per program",
              "two islands"]
    vals = [med(res.get(s[4])) for s in spec]
    bars = [s[5] for s in spec]
    idx = range(len(labels))
    b = ax.bar(idx, [v or 0 for v in vals], 0.6, color="#1f77b4", label="measured ratio")
    for i, bar in zip(idx, bars):
        ax.hlines(bar, i - 0.35, i + 0.35, color="#d62728", lw=1.5,
                  label="bar (issue)" if i == 0 else None)
    for rect, v in zip(b, vals):
        if v is not None:
            ax.annotate(ratio(v), (rect.get_x() + rect.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=8)
    ax.axhline(1.0, color="#777777", lw=0.8)
    ax.set_xticks(list(idx), labels)
    ax.set_ylim(0, max([v or 0 for v in vals] + bars + [1.0]) * 1.15)
    ax.set_ylabel("steps/s vs baseline")
    ax.set_title("Training: pathways_torch vs its baseline")
    ax.legend(fontsize=8)
    rep.plot("training.png", fig)


def dcn(rep: Report) -> None:
    rep.add("## DCN: island to island against raw TCP\n",
            "Paper: between islands data moves over the data-centre network; the "
            "16-stage pipeline keeps its throughput over four islands (transfers hidden "
            "behind compute).\n")
    res = rep.get("dcn.py")
    if res is None:
        return
    tcp = res.get("tcp_gbps")
    rows = [["raw TCP socket on loopback (`sendall` -> `recv_into`), baseline", num(tcp, 2),
             "1.00"],
            ["data plane, on the wire (receiver: first header byte to last payload byte)",
             num(res.get("wire_gbps"), 2), f"**{spread(res.get('wire_over_tcp'))}**"],
            ["`x.to(other_island)`, end to end (device buffer to device buffer), sharded",
             num(res.get("end_to_end_gbps"), 2), spread(res.get("end_to_end_over_tcp"))],
            ["... replicated at both ends", num(res.get("end_to_end_replicated_gbps"), 2),
             spread(res.get("end_to_end_replicated_over_tcp"))],
            ["... resharded on the way (split -> replicated)",
             num(res.get("end_to_end_resharded_gbps"), 2),
             spread(res.get("end_to_end_resharded_over_tcp"))]]
    rep.add(f"{res.get('payload_mib')} MiB of float32, sharded on 2 devices at both ends, "
            f"medians of {res.get('runs')} runs ({source(res, 'dcn.py')}).\n",
            table(["path", "GB/s", "vs raw TCP"], rows) + "\n",
            f"Bar (issue): on the wire at least {BAR['wire_over_tcp']}x raw TCP: "
            f"{met(res.get('wire_over_tcp'), BAR['wire_over_tcp'])}. End to end also "
            "counts reading the sharded source off the device and writing the destination, "
            "which on CPU XLA are copies of their own; bar (issue 15) "
            f"{BAR['move_over_tcp']}x raw TCP end to end: "
            f"{met(res.get('end_to_end_over_tcp'), BAR['move_over_tcp'])}.\n")
    rep.headline("DCN data plane vs raw TCP (GB/s on the wire)", res.get("wire_over_tcp"),
                 BAR["wire_over_tcp"])
    rt = rep.r.get("runtime.py")
    p = plt()
    fig, ax = p.subplots(figsize=(6, 3.0))
    labels = ["raw TCP", "DCN wire", "DCN end to end"]
    vals = [tcp, res.get("wire_gbps"), res.get("end_to_end_gbps")]
    colors = ["#777777", "#1f77b4", "#1f77b4"]
    if rt and "error" not in rt:
        labels += ["client put", "client fetch"]
        vals += [rt.get("put_gbps"), rt.get("fetch_gbps")]
        colors += ["#ff7f0e", "#ff7f0e"]
    bars = ax.barh(labels[::-1], [v or 0 for v in vals[::-1]], color=colors[::-1])
    for rect, v in zip(bars, vals[::-1]):
        ax.annotate(num(v, 2), (rect.get_width(), rect.get_y() + rect.get_height() / 2),
                    va="center", fontsize=8)
    ax.set_xlim(0, max(v or 0 for v in vals) * 1.15)
    ax.set_xlabel("GB/s")
    ax.set_title(f"Bandwidth, {res.get('payload_mib')} MiB")
    rep.plot("dcn_bandwidth.png", fig)


def runtime(rep: Report) -> None:
    rep.add("## Runtime costs behind the design\n",
            "Not a paper figure: what docs/architecture.md's decisions rest on.\n")
    res = rep.get("runtime.py")
    if res is None:
        return
    rows = [["new slice (executor forked from the host's zygote) + first round trip",
             f"{num(res.get('slice_alloc_ms'))} ms", "cold torch_xla process",
             f"{num(res.get('cold_process_s'), 2)} s",
             num(res["cold_process_s"] * 1e3 / res["slice_alloc_ms"], 0)
             + "x faster" if res.get("slice_alloc_ms") and res.get("cold_process_s")
             else "–"]]
    rep.add(f"Medians of {res.get('runs')} runs ({source(res, 'runtime.py')}).\n",
            table(["what", "pathways_torch", "baseline", "baseline value", "ratio"], rows)
            + "\n")


def bulk(rep: Report) -> None:
    rep.add("## Bulk data: puts, fetches and input pipelines\n",
            "Paper: a single controller must keep bulk data off the client; input "
            "pipelines run on the hosts that own the devices (docs/architecture.md, "
            "Decision 19).\n")
    res = rep.get("runtime.py")
    if res is not None:
        mib = res.get("payload_mib")
        rows = []
        for what, key in (("data plane via /dev/shm (client on the workers' machine)", ""),
                          ("data plane socket (`PATHWAYS_SHM=0`: a remote client)",
                           "_socket"),
                          ("control stream (before: 4 MiB protobuf chunks)", "_stream"),
                          ("data plane via /dev/shm, split over the 2 devices",
                           "_shm_sharded"),
                          ("control stream, split over the 2 devices", "_stream_sharded")):
            rows.append([what, num(res.get(f"put{key}_gbps"), 2),
                         spread(res.get(f"put{key}_over_tcp")),
                         num(res.get(f"fetch{key}_gbps"), 2),
                         spread(res.get(f"fetch{key}_over_tcp"))])
        tcp = res.get("tcp_gbps")
        rows.append(["torch_xla's own host<->device copies in an executor (the floor)",
                     num(res.get("device_put_gbps"), 2),
                     ratio((res.get("device_put_gbps") or 0) / tcp if tcp else None),
                     num(res.get("device_fetch_gbps"), 2),
                     ratio((res.get("device_fetch_gbps") or 0) / tcp if tcp else None)])
        rep.add(f"{mib} MiB of float32, client <-> a 2-device slice, each path in turn "
                f"in every round beside raw TCP on loopback ({num(tcp, 2)} GB/s); medians "
                f"of {res.get('runs')} rounds and of the per-round ratios, with their "
                f"range ({source(res, 'runtime.py')}).\n",
                table(["path", "put GB/s", "put / TCP", "fetch GB/s", "fetch / TCP"], rows)
                + "\n",
                f"Bar (issue 15): put and fetch at least {BAR['bulk_over_tcp']}x raw TCP: "
                f"put {met(res.get('put_over_tcp'), BAR['bulk_over_tcp'])}, fetch of "
                f"a replicated buffer {met(res.get('fetch_over_tcp'), BAR['bulk_over_tcp'])}"
                f" (torch_xla reads it off the 2 devices at "
                f"{num(res.get('device_fetch_gbps'), 2)} GB/s: the fetch is that copy plus "
                f"little), of a sharded one "
                f"{met(res.get('fetch_shm_sharded_over_tcp'), BAR['bulk_over_tcp'])}.\n")
        rep.headline("put through the client vs raw TCP", res.get("put_over_tcp"),
                     BAR["bulk_over_tcp"])
        rep.headline("fetch (replicated) through the client vs raw TCP",
                     res.get("fetch_over_tcp"), BAR["bulk_over_tcp"])
    res = rep.get("input.py")
    if res is None:
        return
    rows = [[what, num(res.get(f"{w}_samples_per_s")),
             spread(res.get(f"{w}_over_client")) if w != "client" else "1.00",
             num(res.get(f"{w}_client_cpu_ms_per_batch"), 2)]
            for what, w in (("client loads (torch DataLoader) and puts every batch",
                             "client"),
                            ("`pw.DataLoader` on 1 host (DataParallel)", "host1"),
                            ("`pw.DataLoader` on 2 hosts (MultiIsland, a half each)",
                             "host2"))]
    rep.add(f"Feeding a tiny model ({res.get('batch')} images of 3x{res.get('image')}x"
            f"{res.get('image')} float32 a step, {res.get('workers')} loader worker "
            f"process(es) each way; {res.get('rounds')} interleaved rounds of "
            f"{res.get('steps')} steps; {source(res, 'input.py')}). The two \"hosts\" "
            "are processes on this machine's 2 cores, shared with the client.\n",
            table(["who feeds", "samples/s", "vs client", "client CPU ms / batch"], rows)
            + "\n",
            f"Bar (issue 15): 2 hosts feeding at least {BAR['host2_over_client']}x the "
            f"client path: {met(res.get('host2_over_client'), BAR['host2_over_client'])}"
            " here, where the hosts and the client share two cores; the client's own CPU "
            "per batch, which is what limits one client feeding a pod, drops by "
            f"{num((res.get('client_client_cpu_ms_per_batch') or 0) / max(res.get('host1_client_cpu_ms_per_batch') or 1e-9, 1e-9), 0)}x"
            " with the host loader.\n")
    rep.headline("host input pipeline (2 hosts) vs client puts, samples/s",
                 res.get("host2_over_client"), BAR["host2_over_client"])


def ray_section(rep: Report) -> None:
    rep.add("## Ray, where it does the same job\n",
            "Paper: Ray is about 10x slower per computation than Pathways (Figure 5).\n")
    ray_v = rep.r.get("_meta", {}).get("ray")
    said = False
    res = rep.r.get("fig5_dispatch_overhead.py") or {}
    if "error" not in res and res.get("ray_actor_us"):
        said = True
        rep.add(f"Ray {ray_v or ''} on one worker (Figure 5 above): a chain of dependent "
                "calls on an actor holding the tensor, one `.remote()` per computation, "
                f"CPU torch, no XLA: {num(res['ray_actor_us'])} µs per computation; "
                f"pathways_torch OpByOp {num(res.get('op_by_op_us'))} µs "
                f"({spread(res.get('op_by_op_over_ray'))}x Ray's time), Chained "
                f"{num(res.get('chained_us'))} µs ({spread(res.get('chained_over_ray'))}x).\n")
    f7 = rep.r.get("fig7_parallel_dispatch.py") or {}
    st = f7.get("stages") or {} if "error" not in f7 else {}
    rr = {k: med(v["parallel_over_ray"]) for k, v in st.items() if v.get("parallel_over_ray")}
    if rr:
        said = True
        lo, hi = min(rr, key=rr.get), max(rr, key=rr.get)
        rep.add(f"Ray across hosts (Figure 7 above): the same chains over {f7.get('hosts')} "
                "Ray actors; pathways_torch's parallel dispatch does "
                f"{ratio(rr[lo])}x Ray's computations per second at {lo} stage(s) and "
                f"{ratio(rr[hi])}x at {hi} stage(s) (lowest and highest).\n")
    if not said:
        rep.add("*Not measured in this run* (Ray runs in `bench/fig5_dispatch_overhead.py` "
                "and `bench/fig7_parallel_dispatch.py` when installed; `make bench` "
                "installs it).\n")


def soak(rep: Report) -> None:
    rep.add("## Soak: resources come back\n",
            "Not a paper figure (issue 6, part 7): small programs with random releases and "
            "cross-island transfers over two islands; afterwards every worker process must "
            "be back where it started.\n")
    res = rep.get("soak.py")
    if res is None:
        return
    c = res.get("counts", {})
    base, final = res.get("baseline", {}), res.get("final", {})
    tol = res.get("rss_tolerance", 0.1)
    rep.add(f"{num(res.get('programs'))} programs (elementwise ops and {res['shape'][0]}x"
            f"{res['shape'][1]} @ {res['shape'][1]}x{res['shape'][1]} matmuls on 8 KiB "
            f"float32, split over a (2,) slice on each of 2 islands), seed {res.get('seed')}: "
            f"{num(c.get('transfers'))} moves to the other island, "
            f"{num(c.get('implicit_transfers'))} program inputs taken from it, "
            f"{num(c.get('puts'))} puts, {num(c.get('releases'))} releases (the whole pool "
            f"{num(c.get('pool_drops'))} times), {num(c.get('checks'))} fetches against "
            f"plain torch (largest difference {res.get('max_abs_err', 0):.1e}; rtol = atol = "
            f"{res.get('atol')}). {num(res.get('run_s'))} s of programs "
            f"({num(res.get('programs_per_s'), 0)} programs/s) after a warm-up of "
            f"{num(res.get('warmup_programs'))} ({source(res, 'soak.py')}). Baseline: after "
            "the warm-up, with the pool dropped; end: everything dropped, both slices "
            "synchronised.\n")
    rows = []
    slack = res.get("grpc_timer_slack", 1)
    for name in base:
        b, e = base[name], final.get(name, {})
        for key, label in (("rss_kib", "RSS (MiB)"), ("threads", "threads"),
                           ("fds", "open fds"), ("buffers", "buffers"),
                           ("buffer_bytes", "buffer bytes")):
            if key not in b:
                continue
            # the verdicts are bench/soak.py's (its "failures")
            failed = any(f.startswith(f"{name} {'RSS' if key == 'rss_kib' else key}:")
                         for f in res.get("failures", []))
            verdict = "**not met**" if failed else "met"
            if key == "rss_kib":
                rows.append([name, label, num(b[key] / 1024, 1), num(e.get(key, 0) / 1024, 1),
                             f"{(e.get(key, 0) - b[key]) / b[key] * 100:+.1f} %",
                             f"within {tol:.0%}", verdict])
            else:
                crit = "equal"
                if key == "threads":
                    crit = f"equal, but gRPC's timer manager +{slack}"
                    grew = e.get("grpc_timer_threads", 0) - b.get("grpc_timer_threads", 0)
                    if grew:
                        crit += f" (here {grew:+d})"
                rows.append([name, label, num(b[key], 0), num(e.get(key), 0),
                             f"{e.get(key, 0) - b[key]:+,}", crit, verdict])
    rep.add(table(["process", "resource", "baseline", "end", "change", "criterion",
                   "verdict"], rows) + "\n")
    if res.get("failures"):
        rep.add("What did not come back: " + "; ".join(res["failures"]) + ".\n")
    rep.add("gRPC core's timer manager starts a thread whenever timers fire while none of "
            "its threads waits and never ends one: every process has one until its first "
            "timer fires, then two, whatever it runs (the idle coordinator too); so its "
            f"threads may grow by {slack}, all others must be equal. Each executor's gRPC "
            "server pool and data-plane sender pool only grow up to their bounds, so the "
            "warm-up calls them concurrently first. RSS is what the kernel counts; glibc "
            "may keep freed memory, which the 10 % allows.\n")
    rep.headline((f"Soak, {num(res.get('programs'))} programs: buffers, threads, "
                  "fds, RSS of every worker process back at the baseline"),
                 "all" if res.get("ok") else f"{len(res.get('failures', []))} off",
                 f"equal; RSS ± {tol:.0%}", verdict="met" if res.get("ok") else
                 "**not met**")
    curve = res.get("curve") or []
    if not curve:
        return
    p = plt()
    fig, axes = p.subplots(2, 2, figsize=(9, 5.5), sharex=True)
    xs = [pt["programs"] for pt in curve]
    styles = {"executor0": "-", "executor1": "--", "agent0": "-", "agent1": "--",
              "coordinator": ":"}
    colors = {"executor": "#1f77b4", "agent": "#ff7f0e", "coordinator": "#2ca02c"}
    for ax, key, title in ((axes[0][0], "rss_kib", "RSS change from baseline (MiB)"),
                           (axes[0][1], "buffers", "buffers held (per executor)"),
                           (axes[1][0], "threads", "threads"),
                           (axes[1][1], "fds", "open file descriptors")):
        for name in base:
            k = f"{name}.{key}"
            if k not in curve[0]:
                continue
            ys = [pt.get(k) for pt in curve]
            if key == "rss_kib":
                ys = [(y - base[name][key]) / 1024 for y in ys]
            color = colors[name.rstrip("0123456789")]
            ax.plot(xs, ys, styles.get(name, "-"), color=color, label=name, lw=1.2)
            ax.plot(xs[-1:], ys[-1:], "o", color=color, ms=4)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    for ax in axes[1]:
        ax.set_xlabel("programs (dot: after dropping everything)")
    fig.suptitle(f"Soak: {num(res.get('programs'))} programs over two islands", fontsize=11)
    rep.plot("soak.png", fig)


# ---------------------------------------------------------------------------- main

def faults(rep: Report) -> None:
    res = rep.r.get("faults.py")
    if not res or "error" in res:
        return
    rep.add("## Faults: how fast they are noticed\n",
            f"`bench/faults.py`, medians of {res.get('runs')} runs with real processes and "
            "SIGKILL (issue 6 asks for 5 s for a worker, 10 s for a client).\n",
            table(["fault", "until", "measured"], [
                ["worker SIGKILLed", "its Array raises WorkerLostError",
                 f"{num(res.get('worker_lost_s'))} s"],
                ["sender SIGKILLed before its transfer", "the receiver's Array raises "
                 "WorkerLostError", f"{num(res.get('dead_sender_s'))} s"],
                ["client SIGKILLed", "its devices show free",
                 f"{num(res.get('client_lost_s'))} s"],
                ["output waiting for memory", "done after the release is sent",
                 f"{num(res.get('backpressure_resume_ms'))} ms"],
            ]) + "\n")


def scale(rep: Report) -> None:
    rep.add("## Control plane at scale\n",
            "Not a paper figure (issue 12): the paper drives 2,048 TPU cores over 512 hosts "
            "from one client. Here the real coordinator process serves N fake hosts with 4 "
            "devices each, in islands of 64, that speak the real protocol from one asyncio "
            "process (`bench/fakehosts.py`: a registration stream per host, heartbeats both ways "
            "as UDP datagrams from one socket after the first one is answered, "
            "a fake worker agent that starts executors at once, fake executors that answer "
            "barriers and waits at once), on loopback; a fresh coordinator for each N. "
            "The client figures come from a real pathways_torch client process against "
            "those fake executors, so they are the client's and coordinator's own costs.\n")
    res = rep.get("scale.py")
    if res is None:
        return
    per = res.get("per_n") or {}
    ns = sorted(per, key=int)

    def g(d, *keys):
        for k in keys:
            if not isinstance(d, dict):
                return None
            d = d.get(k)
        return None if isinstance(d, dict) and "error" in d else d

    def failed(n):
        errs = [f"{k}: {v['error'].splitlines()[0][:200]}" for k, v in per[n].items()
                if isinstance(v, dict) and "error" in v]
        if isinstance(per[n].get("error"), str):
            errs.insert(0, per[n]["error"].splitlines()[0][:200])
        return errs

    rows = []
    for n in ns:
        d = per[n]
        sched = [num(g(d, "schedule", m, "calls_per_s"), 0) for m in ("1", "8", "64")]
        rows.append([f"{int(n):,}", num(g(d, "register_s"), 2),
                     num(g(d, "idle", "cpu_core"), 3), num(g(d, "idle", "rss_mib"), 0),
                     num(g(d, "idle", "threads"), 0),
                     num(g(d, "list_devices", "p50_ms")),
                     num(g(d, "client", "devices", "p50_ms")),
                     f"{num(g(d, 'alloc', 'p50_ms'))} / {num(g(d, 'alloc', 'p90_ms'))}",
                     " / ".join(sched),
                     num(g(d, "notice", "closed", "max_s"), 3),
                     num(g(d, "notice", "silent", "max_s"), 2)])
    first = per[ns[0]] if ns else {}
    rep.add(f"{len(ns)} cluster sizes, heartbeat every {res.get('heartbeat_s')} s, a host "
            f"silent for {res.get('lost_after_s')} s is lost "
            f"({source(res, 'scale.py')}). Idle: the coordinator's CPU (fraction of one "
            f"core, from /proc) over {num(g(first, 'idle', 'window_s'), 0)} s with every host "
            "beating (from two heartbeats after registration, when every host beats as datagrams) "
            "and nothing else running, its RSS and threads. `ListDevices`: the whole "
            "cluster from a sync stub; `pw.devices()`: from the client process. Allocation: "
            "`AllocateSlice` of one device through an open session (the coordinator asks the "
            "host's agent to start an executor), then `ReleaseSlice`. `Schedule`: gang "
            "submissions touching 1 / 8 / 64 hosts (1-device slices on distinct hosts), calls "
            "per second from one caller. Noticed: the slowest of the hosts closed (stream "
            "cancelled) or silenced (no beats, connection open) at once until `ListDevices` "
            "shows them lost.\n",
            table(["hosts", "registered in (s)", "idle CPU (core)", "RSS (MiB)", "threads",
                   "ListDevices p50 (ms)", "pw.devices() p50 (ms)",
                   "allocation p50 / p90 (ms)", "Schedule calls/s, 1 / 8 / 64 hosts",
                   "closed host lost in (s)", "silent host lost in (s)"], rows) + "\n")
    big = per[ns[-1]] if ns else {}
    if g(big, "register", "fakehosts_cpu_s") is not None:
        rep.add(f"The harness shares the machine's cores with the coordinator: registering "
                f"{int(ns[-1]):,} hosts cost the coordinator "
                f"{num(g(big, 'register', 'coordinator_cpu_s'))} CPU-seconds and the fake "
                f"hosts {num(g(big, 'register', 'fakehosts_cpu_s'))} (one connection per "
                f"host), over {num(g(big, 'register_s'))} s; idle, the fake hosts took "
                f"{num(g(big, 'idle', 'fakehosts_cpu_core'), 3)} core beside the "
                f"coordinator's {num(g(big, 'idle', 'cpu_core'), 3)}, and heartbeats came "
                f"back in {num(g(big, 'idle', 'beat_rtt_ms_p50'))} ms (p50), "
                f"{num(g(big, 'idle', 'beat_rtt_ms_p99'))} ms (p99).\n")
    crow = []
    for n in ns:
        c = per[n].get("client")
        if not isinstance(c, dict) or "error" in c:
            continue
        for k in sorted((k for k in c if k.startswith("k") and k[1:].isdigit()),
                        key=lambda k: int(k[1:])):
            r = c[k]
            if "error" in r:
                crow.append([f"{int(n):,}", k[1:], "failed: " + r["error"][:120], "", "", "",
                             "", "", ""])
                continue
            th = r.get("threads_before_barrier") or r.get("threads") or {}
            crow.append([f"{int(n):,}", k[1:], num(r.get("wait_ms_p50")),
                         num(r.get("wait_fresh_ms_p50")), num(r.get("barrier_all_ms_p50")), num(r.get("barrier_ms_p50")),
                         f"{th.get('os', '–')} ({th.get('python', '–')} Python)",
                         num(r.get("graph_cpu_ms")), num(r.get("graph_wall_ms"))])
    if crow:
        before = g(first, "client", "threads_before") or {}
        rep.add("The client over k single-device slices on k hosts (k ≤ N): `pw.wait` on one "
                "Array per slice (p50), a barrier over all k sent at once "
                "(`barrier_start` on each, then `barrier_finish`; p50) and `Slice.stats()` "
                "on each in turn (a barrier and a Stats call; p50), the client process's "
                "threads while it holds the k slices (before any barrier; it has "
                f"{before.get('os', '–')} after `pw.init`), and its CPU "
                "(`time.process_time()`, every thread) per `pw.graph()` of one put per slice, "
                "averaged over the graphs. Every slice's executor is the one fake executor "
                "here, so the k calls are served one after another by one Python process "
                "(a real cluster has an executor process per slice): the k = 64 figures "
                "hold the server's cost as well as the client's.\n",
                table(["hosts", "k slices", "pw.wait p50 (ms)", "pw.wait fresh p50 (ms)",
                       "barrier, all at once (ms)",
                       "stats each in turn (ms)",
                       "client threads", "CPU per graph (ms)", "wall per graph (ms)"],
                      crow) + "\n")
    for n in ns:
        errs = failed(n)
        if errs:
            rep.add(f"At {int(n):,} hosts, parts that failed: " + "; ".join(
                f"`{e}`" for e in errs) + ".\n")
    bars = res.get("bars") or {}
    labels = {
        "register_s_at_2048": ("Control plane: 2,048 hosts registered within (s)", "≤ {}"),
        "idle_cpu_core": ("Control plane: idle coordinator CPU (core)", "≤ {}"),
        "alloc_p50_ms": ("Control plane: allocation p50 (ms)", "≤ {}"),
        "silent_lost_s": ("Control plane: silent host lost within (s)", "≤ {}"),
        "wait_k64_over_k1": ("Client: pw.wait over 64 slices / over 1", "≤ {}"),
        "wait_fresh_k64_over_k1": ("Client: pw.wait over 64 slices / over 1, fresh Arrays",
                                   "≤ {}"),
    }
    brow = []
    for key, (label, fmt) in labels.items():
        b = bars.get(key)
        if not b:
            continue
        at = b.get("at_hosts")
        where = (f" (at {at:,} hosts)" if isinstance(at, int) else f" ({at})" if at else "")
        inter = b.get("interleaved") and b.get("measured") is not None
        if inter:       # the median of interleaved per-round ratios, with its spread
            summary = {"median": b["measured"], "lo": b["lo"], "hi": b["hi"],
                       "rounds": b["rounds"], "spread": b.get("spread")}
            verdict = met(summary, b["bar"], higher_is_better=False)
            value = spread(summary)
        else:
            verdict = ("–" if b.get("met") is None else "met" if b["met"] else
                       "**not met**")
            value = ("not measured" if b.get("measured") is None else
                     num(b["measured"], 3 if key == "idle_cpu_core" else None))
        brow.append([label + where, value, fmt.format(b.get("bar")), verdict])
        rep.headline(label + where, value, fmt.format(b.get("bar")), verdict=verdict)
        if inter:
            rep.records[-1].update(kind="ratio", median=b["measured"], lo=b["lo"],
                                   hi=b["hi"], rounds=b["rounds"], interleaved=True)
        elif key.startswith("wait") and b.get("measured") is not None:
            # a ratio, though from one measurement of each side (an older result)
            rep.records[-1].update(kind="ratio", median=b["measured"], lo=None, hi=None,
                                   rounds=None, interleaved=False)
    if brow:
        rep.add("Bars (issue 12, part 5; not measurements), each at the largest N measured "
                "unless said:\n", table(["what", "measured", "bar", "verdict"], brow) + "\n")
    xs = [int(n) for n in ns]
    if not xs:
        return
    p = plt()
    fig, axes = p.subplots(2, 2, figsize=(9, 6))
    floor = {"s": 1e-3, "ms": 1e-2, "core": 1e-3}

    def series(ax, key_fn, label, style, unit):
        pts = [(x, key_fn(per[n])) for x, n in zip(xs, ns)]
        pts = [(x, max(v, floor[unit])) for x, v in pts if isinstance(v, (int, float))]
        if pts:
            ax.plot([a for a, _ in pts], [b for _, b in pts], style, label=label)

    def bar_line(ax, y, text, at=None):
        ax.axhline(y, color="#d62728", ls=":", lw=1)
        ax.annotate(text, (xs[0], y), textcoords="offset points", xytext=(2, 3),
                    fontsize=7, color="#d62728")
        if at:
            ax.plot([at], [y], "x", color="#d62728")

    a = axes[0][0]
    series(a, lambda d: g(d, "register_s"), "all registered", "o-", "s")
    bar_line(a, BARS_SCALE["register_s"], "bar: 3 s at 2,048 hosts", 2048)
    a.set_title("registration of N hosts (s)", fontsize=10)
    a = axes[0][1]
    series(a, lambda d: g(d, "alloc", "p50_ms"), "AllocateSlice p50", "o-", "ms")
    series(a, lambda d: g(d, "alloc", "p90_ms"), "AllocateSlice p90", "s--", "ms")
    series(a, lambda d: g(d, "list_devices", "p50_ms"), "ListDevices p50", "^-.", "ms")
    bar_line(a, BARS_SCALE["alloc_p50_ms"], "bar: allocation p50 3 ms")
    a.set_title("coordinator calls (ms)", fontsize=10)
    a = axes[1][0]
    series(a, lambda d: g(d, "idle", "cpu_core"), "coordinator", "o-", "core")
    series(a, lambda d: g(d, "idle", "fakehosts_cpu_core"), "fake hosts (harness)", "s--",
           "core")
    bar_line(a, BARS_SCALE["idle_cpu_core"], "bar: 0.10 core")
    a.set_title("idle CPU, every host beating (cores)", fontsize=10)
    a = axes[1][1]
    series(a, lambda d: g(d, "notice", "closed", "max_s"), "closed host", "o-", "s")
    series(a, lambda d: g(d, "notice", "silent", "max_s"), "silent host", "s-", "s")
    bar_line(a, BARS_SCALE["silent_lost_s"], "bar: silent host 5 s")
    a.set_title("time until a host shows lost (s)", fontsize=10)
    for row in axes:
        for a in row:
            a.set_xscale("log", base=2)
            a.set_yscale("log")
            a.set_xticks(xs, [f"{x:,}" for x in xs])
            a.grid(alpha=0.3, which="both")
            a.legend(fontsize=7, loc="lower right")
    for a in axes[1]:
        a.set_xlabel("hosts (4 devices each; log)")
    fig.suptitle("Control plane at scale: the real coordinator, N fake hosts (log-log; "
                 "values below the axis floor drawn at it)", fontsize=10)
    rep.plot("scale.png", fig)


def slurm(rep: Report) -> None:
    """From bench/slurm.json (`make test-slurm`), not results.json: it needs root."""
    rep.add("## Slurm (make test-slurm)\n")
    path = ROOT / "bench" / "slurm.json"
    if not path.exists():
        rep.add("*Not run on this machine*: `make test-slurm` (root; a Slurm cluster of 4 "
                "emulated nodes on this machine) writes `bench/slurm.json`.\n")
        return
    res = json.loads(path.read_text())
    checks = res.get("checks") or {}
    rep.add(f"`make test-slurm` last ran {res.get('date', '–')}: Slurm "
            f"{res.get('slurm_version') or '–'} (Debian's slurm-wlm) with 4 emulated nodes "
            f"on this one machine ({res.get('machine', '–')}), {res.get('layout', '–')}, "
            "a token file; recipes/two_islands.py --steps 3 --check (losses against plain "
            "torch) as the client. Times from submission (`sbatch`, `torchx run`) to the "
            "client's first step and to the job's end, one run each, on the machine's 2 "
            f"shared cores (the elastic client prints no progress line: its first result "
            f"is step 1 written to its progress file); the whole run took "
            f"{num(res.get('total_s'), 0)} s.\n")
    paths = [("sbatch", "`deploy/slurm/pathways.sbatch`, 3 nodes"),
             ("torchx", "TorchX slurm scheduler, heterogeneous job, 4 nodes"),
             ("elastic", "`pathways.sbatch`, island 1's agent SIGKILLed at step 3 "
                         "(tests/deploy_elastic_client.py, 12 steps)")]
    rows = []
    for key, what in paths:
        c = checks.get(key)
        if c is None:
            rows.append([what, "–", "–", "not run"])
            continue
        if "skipped" in c:
            verdict = f"skipped: {c['skipped']}"
        elif c.get("passed"):
            verdict = "passed"
            if key == "elastic":
                verdict += (f" ({c.get('restarts')} restart: fit resumed from the "
                            f"checkpoint of step {c.get('resumed_from_step')} "
                            f"{num(c.get('kill_to_resumed_s'), 1)} s after the kill; "
                            "losses match torch)")
            elif c.get("max_rel_diff") is not None:
                verdict += f" (losses within {c['max_rel_diff']:.0e} of torch)"
        else:
            err = (c.get("error") or "").strip().splitlines()
            verdict = "**failed**" + (f": {err[0][:120]}" if err else "")
        rows.append([what, f"{num(c.get('first_result_s'))} s"
                     if c.get("first_result_s") is not None else "–",
                     f"{num(c.get('total_s'))} s" if c.get("total_s") is not None else "–",
                     verdict])
    rep.add(table(["path", "submission to first result", "total", "result"], rows) + "\n")
    if (checks.get("torchx") or {}).get("squeue_shim"):
        rep.add("TorchX ran with a `squeue` shim: Slurm 22.05's `squeue --json` leaves "
                "`job_resources` out of a pending job and TorchX's slurm scheduler fails on "
                "it (`KeyError: 'job_resources'`); the shim adds `\"job_resources\": null`, "
                "as Slurm 24.11.5+ prints.\n")


def spanning(rep: Report) -> None:
    rep.add("## Slices that span hosts\n",
            "Paper: one SPMD program over 2048 cores of 512 hosts; the cross-host axis "
            "rides the data-centre network. Here a host's part of such a slice is a member "
            "executor on jaxlib with gloo (docs/architecture.md, Decision 18).\n")
    res = rep.get("spanning.py")
    if res is not None:
        ms = res.get("ms", {})
        rows = [[what, f"{num(ms.get('one_host' + k))} ms",
                 f"{num(ms.get('two_hosts' + k))} ms",
                 ratio((res.get(key) or {}).get("median"))
                 + f" ({ratio((res.get(key) or {}).get('min'))}-"
                   f"{ratio((res.get(key) or {}).get('max'))})"]
                for what, k, key in (
                    ("DataParallel training step", "", "two_hosts_over_one_host"),
                    ("tiny program (`x + 1`, no collective)", "_tiny",
                     "tiny_program_ratio"),
                    ("sum of a 1 MiB array sharded over the hosts", "_allreduce",
                     "allreduce_program_ratio"))]
        rep.add(f"One cluster of 3 hosts x 4 devices, interleaved rounds "
                f"({source(res, 'spanning.py')}); median of per-round ratios with "
                "their spread.\n",
                table(["what", "1 host x 4 devices", "2 hosts x 2 devices", "ratio"], rows)
                + "\n")
    res = rep.get("multihost.py")
    if res is not None:
        rows = [["jaxlib 1 x 4 over torch_xla 1 x 4 (one step)",
                 ratio(res["jax_1x4_over_torch_xla"]["median"]),
                 f"{ratio(res['jax_1x4_over_torch_xla']['min'])}-"
                 f"{ratio(res['jax_1x4_over_torch_xla']['max'])}"],
                ["jaxlib 2 processes x 2 over jaxlib 1 x 4",
                 ratio(res["jax_2x2_over_jax_1x4"]["median"]),
                 f"{ratio(res['jax_2x2_over_jax_1x4']['min'])}-"
                 f"{ratio(res['jax_2x2_over_jax_1x4']['max'])}"],
                ["1 MiB all-reduce across 2 processes over raw TCP moving 1 MiB",
                 ratio(res["allreduce_over_tcp"]["median"]), "–"]]
        rep.add(f"Backends on one module ({source(res, 'multihost.py')}).\n",
                table(["what", "ratio", "spread"], rows) + "\n")


def optimizers(rep: Report) -> None:
    res = rep.get("optimizers.py")
    if res is None:
        return
    r = res["generic_over_torch_optim"]
    rep.add("## Optimizers from outside torch.optim\n",
            "A hand-written Adam (a Python step count, `math.sqrt`), its numbers inputs of "
            "the step (docs/architecture.md, Decision 7), against `torch.optim.Adam` on "
            f"{res['params']} parameters ({source(res, 'optimizers.py')}); no bar.\n",
            table(["what", "value"], [
                ["time a step, generic over torch.optim (median of per-round ratios)",
                 spread(r)],
                ["the client's work on the numbers, a step",
                 f"{num(res['numbers_client_us_per_step'])} µs"],
                ["traces", f"{res['traces']['generic']} (torch.optim: "
                           f"{res['traces']['torch.optim']})"]]) + "\n")


def ema(rep: Report) -> None:
    res = rep.get("ema.py")
    if res is None:
        return

    ms = res["ms_per_step"]
    rep.add("## An average of the weights (ema=)\n",
            f"torch's AveragedModel (EMA) of {res['layers']} Linear({res['width']}) layers "
            f"({res['param_mib']} MiB of parameters, AdamW), updated after every step by "
            "the script's `ema.update_parameters(model)` (a fetch of the weights a step) "
            "or by `pw.Trainer(ema=)` on the workers (docs/architecture.md, \"An average "
            f"of the weights on the workers\"; {source(res, 'ema.py')}); no bar.\n",
            table(["what", "value"], [
                ["ms a step: no EMA / ema= / the script's call",
                 f"{num(ms['none'])} / {num(ms['ema='])} / {num(ms['script'])}"],
                ["the script's call over ema= (median of per-round ratios)",
                 spread(res["script_over_ema="])],
                ["ema= over no EMA", spread(res["ema=_over_none"])]]) + "\n")


def pipeline_axis(rep: Report) -> None:
    res = rep.get("pipeline_axis.py")
    if res is None:
        return

    sps = res["steps_per_s"]
    rep.add("## Pipeline x data parallelism (Pipeline(axis=))\n",
            f"The recipes' GPT at batch {res['batch']}, 2 stages on two 2-device slices, "
            f"{res['microbatches']} micro-batches: each stage's devices computing the whole "
            "micro-batch (replicated), or splitting it (`axis=\"data\"`), beside "
            "DataParallel on a 4-device slice (docs/architecture.md, \"Pipeline x data "
            f"parallelism\"; {source(res, 'pipeline_axis.py')}); no bar.\n",
            table(["what", "value"], [
                ["steps/s: replicated / axis= / DataParallel on 4",
                 f"{num(sps['replicated'])} / {num(sps['axis'])} / {num(sps['dp4'])}"],
                ["axis= over replicated (speed-up, median of per-round ratios)",
                 spread(res["axis_speedup_over_replicated"])],
                ["axis= over DataParallel on 4 (throughput)",
                 spread(res["axis_over_dp4_throughput"])]]) + "\n")


def build(results: dict, img_dir=IMG) -> Report:
    """Every section of the report; ``img_dir=None`` writes no plots."""
    rep = Report(results)
    rep.img_dir = img_dir
    for section in (fig5, fig6, fig7, fig9, training, dcn, bulk, ray_section, runtime, soak,
                    faults, scale, spanning, optimizers, ema, pipeline_axis, slurm):
        section(rep)
    return rep


def headlines(results: dict) -> list:
    """The headline table as records (what, kind, median, lo, hi, rounds, bar, verdict),
    without writing anything: what bench/compare_runs.py compares."""
    return build(results, img_dir=None).records


def render(results: dict, img_dir=IMG):
    """The report's markdown and the names of the plots written for it."""
    rep = build(results, img_dir)
    meta = results.get("_meta", {})
    wall = meta.get("total_wall_s")
    head = [
        "# Evaluation\n",
        "Generated by `bench/report.py` from `bench/results.json` (`make bench` runs every "
        "benchmark under `bench/`, then this); do not edit by hand. Every measured number "
        "below comes from that file; what the paper reports and the bars the issues set "
        "are labelled as such. Each result stands beside its baseline, measured in the "
        "same run on the same machine. The machine's 2 cores are shared and noisy (±30 % "
        "between runs is common): read the ratios.\n",
        "Every headline ratio is measured interleaved: baseline and subject alternate in "
        "the same run, round after round (the order reversed every other round), and the "
        "ratio is the median of the per-round ratios, shown as \"median (lo–hi, n "
        "rounds)\". The spread lo–hi is the range (min–max) of the per-round ratios below "
        "7 rounds and their interquartile range (25th–75th percentile) from 7 rounds up "
        "(`bench/common.py`, `ratio_summary`). A bar is *met* or *not met* only when the "
        "whole spread lies on one side of it, otherwise *undecided (spread crosses the "
        "bar)*. Ratios against Ray are the exception: Ray runs apart, before the cluster, "
        "and each round is divided by its median. A ratio without a spread is a single "
        "measurement (an older result or a figure measured once). "
        "`bench/compare_runs.py A.json B.json` checks that two runs agree.\n",
        f"Run: {meta.get('date', '–')}, {meta.get('mode', '–')} mode; machine: "
        f"{meta.get('nproc', '–')} x {meta.get('cpu', '–')}; Python "
        f"{meta.get('python', '–')}, torch {meta.get('torch', '–')}, torch_xla "
        f"{meta.get('torch_xla', '–')}, Ray {meta.get('ray') or 'not installed'}; "
        f"all benchmarks took {num(wall / 60, 1) + ' min' if wall else '–'}; commit "
        f"{meta.get('commit') or '–'}"
        f"{' with uncommitted runtime changes' if meta.get('dirty') else ''}.\n",
        "## Headlines\n",
        table(["what", "measured", "bar", "verdict"], rep.headlines) + "\n",
    ]
    return "\n".join(head + rep.parts), rep.images


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description="docs/evaluation.md from bench/results.json")
    ap.add_argument("results", nargs="?", default=str(ROOT / "bench" / "results.json"))
    ap.add_argument("--out", help="write DIR/evaluation.md and DIR/img/ instead of docs/")
    args = ap.parse_args()
    results = json.loads(pathlib.Path(args.results).read_text())
    doc, img = DOC, IMG
    if args.out:
        doc = pathlib.Path(args.out) / "evaluation.md"
        img = pathlib.Path(args.out) / "img"
        doc.parent.mkdir(parents=True, exist_ok=True)
    rep_text, images = render(results, img)
    doc.write_text(rep_text)
    for png in img.glob("*.png"):                  # no stale plot outlives its section
        if png.name not in images:
            png.unlink()
    print(f"wrote {doc} and {img}/*.png")


if __name__ == "__main__":
    main()
