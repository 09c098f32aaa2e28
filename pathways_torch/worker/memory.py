"""Buffer-memory budgets: how many bytes of buffers a worker's devices may hold.

A worker's budget (``--memory-budget``, ``pw.init(memory_budget=...)`` or
``PATHWAYS_MEMORY_BUDGET``; default 80% of the memory available when it starts, split
over the workers that share the machine) is split evenly over its devices. Each
executor enforces the per-device share for the devices of its slice: outputs that do not
fit yet wait for releases (back-pressure), and a single buffer larger than the whole
share fails at once with ``OutOfMemoryError``.

With ``PATHWAYS_MEMORY_REPORT=1`` in a worker's environment, each executor also records
XLA's memory plan of every program it compiles (``MemoryPlans``): the bytes one
execution needs on one device (arguments, outputs and temporaries). That is the figure
activation checkpointing lowers; the buffer budget only sees what outlives a program.

Example::

    parse_bytes("6G")   # 6442450944
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import tempfile
from typing import Dict, Optional, Union

BUDGET_ENV = "PATHWAYS_MEMORY_BUDGET"
REPORT_ENV = "PATHWAYS_MEMORY_REPORT"
DEFAULT_FRACTION = 0.8

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value: Union[int, str]) -> int:
    """Bytes from an int or a string such as ``"512M"``, ``"6G"``, ``"1.5GiB"``."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(value))
        if not m:
            raise ValueError(f"memory budget {value!r} is not a size: give bytes or a "
                             "number with K, M, G or T (e.g. '6G')")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory budget must be positive, not {value!r}")
    return n


def available_bytes() -> Optional[int]:
    """MemAvailable of this machine, or None where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def default_budget(workers_on_machine: int = 1) -> int:
    """The default worker budget: PATHWAYS_MEMORY_BUDGET, or its share of 80% of the
    memory available now."""
    env = os.environ.get(BUDGET_ENV)
    if env:
        return parse_bytes(env)
    avail = available_bytes()
    if avail is None:
        return 1 << 40
    return int(avail * DEFAULT_FRACTION) // max(1, workers_on_machine)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class MemoryPlans:
    """XLA's memory plan per compiled program, read from its dump directory.

    ``enable()`` must run before the process initializes XLA: it adds ``--xla_dump_to``
    to ``XLA_FLAGS`` (every backend writes a ``*memory-usage-report.txt`` per module).
    ``record(key)`` after a compile reads the reports that compile wrote, keeps the
    largest total (the program; smaller modules are XLA's own helpers) and deletes the
    dump. A compile served from XLA's cache writes nothing: the figure of the earlier
    program with the same ``key`` (its HLO) is reused.

    Example::

        plans = MemoryPlans.enable()      # None unless PATHWAYS_MEMORY_REPORT=1
        ...compile...
        plans.record(hlo_bytes)           # 50450061
    """

    _TOTAL = re.compile(r"Total bytes used:\s*(\d+)")

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._by_key: Dict[bytes, int] = {}

    @classmethod
    def enable(cls) -> Optional["MemoryPlans"]:
        if os.environ.get(REPORT_ENV, "") in ("", "0"):
            return None
        d = tempfile.mkdtemp(prefix="pathways-xla-plan-")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={d}").strip()
        return cls(d)

    def record(self, key: bytes) -> int:
        """Bytes of the program just compiled (0 if XLA reported none)."""
        totals = []
        for path in glob.glob(os.path.join(self.directory, "*memory-usage-report.txt")):
            with open(path) as f:
                m = self._TOTAL.search(f.read(4096))
            if m:
                totals.append(int(m.group(1)))
        self.clear()
        digest = hashlib.sha256(key).digest()
        if totals:
            self._by_key[digest] = max(totals)
        return self._by_key.get(digest, 0)

    def clear(self) -> None:
        for entry in os.listdir(self.directory):
            path = os.path.join(self.directory, entry)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
