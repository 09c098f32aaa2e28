"""Forks beside busy gRPC threads: count the runs that stall.

A torch DataLoader with worker processes forks the process it runs in. Two places do
that while gRPC threads are busy, and both stalled before gRPC's at-fork handlers were
turned off and the hosts' workers moved to a fork server (docs/architecture.md, "Where
the host's DataLoader workers come from"):

- ``host``: ``pw.DataLoader(..., num_workers=1)`` opened ``--loaders`` times, 5 steps
  each, alternately from the start and from a saved ``state_dict()``: every open starts
  a worker on the host. Before: 1 hang in 3,000 opens.
- ``client``: the script's own ``torch.utils.data.DataLoader(num_workers=2)`` feeding
  ``trainer.step`` for ``--epochs`` epochs of 3 batches: 2 forks of the client an epoch.
  Before: 2 stalled runs in 12 of 400 epochs.

A stall shows as a ``pw.TimeoutError`` (``--timeout`` seconds) or a DataLoader timeout;
the run stops there and is counted. This is a robustness probe, not a speed bar: it is
not in ``run_all.py``. Each run is a fresh cluster:

    python bench/fork_stress.py [--runs 4] [--loaders 1500] [--epochs 400]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common import emit

import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)   # the hosts import it too

import loader_data  # noqa: E402


def trainer() -> pw.Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    return pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                      torch.nn.functional.mse_loss, slice=pw.slice((2,)),
                      parallelism=pw.DataParallel("data"))


def host_run(loaders: int) -> int:
    """Open ``loaders`` host loaders; how many did (fewer: a stall stopped the run)."""
    tr = trainer()
    saved = None
    for r in range(loaders):
        loader = pw.DataLoader("loader_data:rows", dataset_kwargs={"n": 48}, batch_size=8,
                               slice=tr, shuffle=True, seed=3, num_workers=1)
        if r % 2 and saved is not None:
            loader.load_state_dict(saved)
        try:
            for k, (x, y) in enumerate(loader):
                float(tr.step(x, y))
                if k == 2:
                    saved = loader.state_dict()
                if k == 4:
                    break
        except (pw.TimeoutError, pw.DataLoaderError) as e:
            print(f"host: loader {r} stalled: {type(e).__name__}: {e}", file=sys.stderr)
            return r
        loader.close()
    return loaders


def client_run(epochs: int, timeout: float) -> int:
    """Train ``epochs`` epochs fed by a client-side DataLoader with 2 workers; how many
    finished."""
    tr = trainer()
    dl = torch.utils.data.DataLoader(loader_data.Rows(n=24), batch_size=8, num_workers=2,
                                     timeout=timeout)
    last = None
    for e in range(epochs):
        try:
            for x, y in dl:
                last = tr.step(x, y)
        except RuntimeError as ex:               # the DataLoader's own timeout
            print(f"client: epoch {e} stalled: {ex}", file=sys.stderr)
            return e
    try:
        float(last)
    except pw.TimeoutError as ex:
        print(f"client: the last step never ran: {ex}", file=sys.stderr)
        return epochs - 1
    return epochs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--loaders", type=int, default=1500)
    ap.add_argument("--epochs", type=int, default=400)
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args()
    out = {"benchmark": "fork_stress", "runs": args.runs,
           "grpc_fork_support": os.environ.get("GRPC_ENABLE_FORK_SUPPORT")}
    for kind, n in (("host", args.loaders), ("client", args.epochs)):
        done, stalled, seconds = [], 0, []
        for _ in range(args.runs):
            pw.init(islands=1, devices_per_host=2, timeout=args.timeout)
            t0 = time.perf_counter()
            try:
                got = host_run(n) if kind == "host" else client_run(n, args.timeout)
            finally:
                seconds.append(round(time.perf_counter() - t0, 1))
                pw.shutdown()
            done.append(got)
            stalled += got < n
        out[kind] = {"per_run": n, "done": done, "stalled_runs": stalled,
                     "seconds": seconds}
    emit(out)


if __name__ == "__main__":
    main()
