"""What a script waits for before its first result: importing pathways_torch,
``pw.init`` of an embedded cluster (a worker agent that imports torch and torch_xla
before its zygote forks), a slice, a put, and a first ``@pw.program`` call (the client's
own torch_xla import, a trace, a compile). One fresh process; prints JSON (seconds).

    python bench/startup.py
    python bench/script_ab.py --baseline c9a6485 --script startup.py --script-from-here \\
        --key init_s --key first_program_s --rounds 3
"""

from __future__ import annotations

import time

t0 = time.perf_counter()
import torch  # noqa: E402

import pathways_torch as pw  # noqa: E402

from common import emit  # noqa: E402


def main() -> None:
    t1 = time.perf_counter()
    pw.init(devices_per_host=8, timeout=120)
    t2 = time.perf_counter()
    s = pw.slice((2,))
    t3 = time.perf_counter()
    a = pw.put(torch.ones(4), s)
    pw.wait([a])
    t4 = time.perf_counter()
    y = pw.program(lambda x: x * 2)(a).torch()
    t5 = time.perf_counter()
    assert torch.equal(y, torch.full((4,), 2.0))
    pw.shutdown()
    t6 = time.perf_counter()
    emit({"benchmark": "startup", "import_s": round(t1 - t0, 3), "init_s": round(t2 - t1, 3),
          "slice_s": round(t3 - t2, 3), "put_s": round(t4 - t3, 3),
          "first_program_s": round(t5 - t4, 3), "shutdown_s": round(t6 - t5, 3),
          "total_s": round(t6 - t0, 3)})


if __name__ == "__main__":
    main()
