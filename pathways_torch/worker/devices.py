"""The environment of a process that runs programs: exactly a given set of the host's
devices, and XLA rounding as torch does.

The device kind comes from ``PJRT_DEVICE``; nothing here is wired to the CPU.
"""

from __future__ import annotations

import os
from typing import Dict, Sequence


#: XLA may keep a half-precision op's result in float32 where the next op widens it
#: again (its ``simplify-fp-conversions`` pass, on by default). torch rounds every op's
#: result to its dtype, so ``loss.float()`` of a bfloat16 loss must be a bfloat16 value.
EXACT_ROUNDING = "--xla_allow_excess_precision=false"


def with_torch_rounding(xla_flags: str) -> str:
    """``XLA_FLAGS`` for a process that runs programs: ``xla_flags`` with XLA told to
    round as torch does, unless they already say ``--xla_allow_excess_precision`` (the
    user's choice wins). Must be set before the process initializes XLA.

    Example::

        os.environ["XLA_FLAGS"] = with_torch_rounding(os.environ.get("XLA_FLAGS", ""))
    """
    if "xla_allow_excess_precision" in xla_flags:
        return xla_flags
    return f"{xla_flags} {EXACT_ROUNDING}".strip()


def device_kind() -> str:
    return os.environ.get("PJRT_DEVICE", "CPU").upper()


def slice_env(kind: str, device_indices: Sequence[int]) -> Dict[str, str]:
    """Environment for an executor that must see exactly ``device_indices`` of its host."""
    n = len(device_indices)
    ids = ",".join(str(d) for d in device_indices)
    kind = kind.upper()
    if kind == "CPU":
        # CPU "devices" are virtual: any k of them are k fresh ones.
        return {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(n)}
    if kind == "TPU":
        return {"PJRT_DEVICE": "TPU", "TPU_VISIBLE_CHIPS": ids,
                "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": f"1,{n},1"
                if n > 1 else "1,1,1"}
    if kind in ("CUDA", "GPU"):
        return {"PJRT_DEVICE": "CUDA", "CUDA_VISIBLE_DEVICES": ids, "GPU_NUM_DEVICES": str(n)}
    raise ValueError(f"unsupported PJRT_DEVICE {kind!r}: use CPU, TPU or CUDA")
