"""Buffer-memory budgets: how many bytes of buffers a worker's devices may hold.

A worker's budget (``--memory-budget``, ``pw.init(memory_budget=...)`` or
``PATHWAYS_MEMORY_BUDGET``; default 80% of the memory available when it starts, split
over the workers that share the machine) is split evenly over its devices. Each
executor enforces the per-device share for the devices of its slice: outputs that do not
fit yet wait for releases (back-pressure), and a single buffer larger than the whole
share fails at once with ``OutOfMemoryError``.

Example::

    parse_bytes("6G")   # 6442450944
"""

from __future__ import annotations

import os
import re
from typing import Optional, Union

BUDGET_ENV = "PATHWAYS_MEMORY_BUDGET"
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
