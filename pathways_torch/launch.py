"""``pathways-run``: run a client script against a cluster, torchrun-style.

Local mode (this version): start an embedded cluster (a coordinator and one worker
process per host), run the script as the client with ``PATHWAYS_ADDRESS`` set, so its
``pw.init()`` connects instead of starting its own, and stop everything when the script
ends, fails, or the launcher gets Ctrl-C / SIGTERM. The exit code is the script's.

Example::

    pathways-run --islands 1 --hosts-per-island 1 --devices-per-host 8 recipes/quickstart.py
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from typing import List, Optional

from .client.cluster import LocalCluster
from .client.runtime import ADDRESS_ENV


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="pathways-run",
        description="Start a local Pathways cluster and run SCRIPT as its client.")
    ap.add_argument("--islands", type=int, default=_env_int("PATHWAYS_ISLANDS", 1))
    ap.add_argument("--hosts-per-island", "--hosts_per_island", type=int,
                    default=_env_int("PATHWAYS_HOSTS_PER_ISLAND", 1))
    ap.add_argument("--devices-per-host", "--devices_per_host", type=int,
                    default=_env_int("PATHWAYS_DEVICES_PER_HOST",
                                     _env_int("CPU_NUM_DEVICES", 8)))
    ap.add_argument("-m", "--module", action="store_true",
                    help="run SCRIPT as a module (python -m), as torchrun's -m")
    ap.add_argument("script", help="the client script (or module with -m)")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    cluster = LocalCluster(args.islands, args.hosts_per_island, args.devices_per_host)
    env = dict(os.environ)
    env[ADDRESS_ENV] = cluster.address
    cmd = [sys.executable] + (["-m"] if args.module else []) + [args.script] + args.script_args
    child = None

    def forward(signum, frame):
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = subprocess.Popen(cmd, env=env)
        code = child.wait()
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
    if code < 0:
        code = 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
