"""torch_xla, imported without changing torch for the user's own code.

Importing torch_xla replaces, for the whole process, ``torch.nn.GRU`` with its
scan-based GRU (which refuses ``proj_size`` and PackedSequence and warns on
``bidirectional``) and ``torch.nn.utils.clip_grad_norm_`` with its XLA version (which
refuses ``foreach=True``). The client imports torch_xla on its first trace, and hosts run
user code (datasets, colocated functions), so without this a GRU or a clipping call
would behave differently depending on whether it came before or after the first
``@pw.program``. torch's own are put back, unless the user imported torch_xla first and
so asked for its patches.

Example::

    from pathways_torch._xla import import_torch_xla
    torch_xla = import_torch_xla()      # torch.nn.GRU is still torch's
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_torch_xla() -> ModuleType:
    """``import torch_xla``, with torch.nn's GRU and clip_grad_norm_ left as they were."""
    if "torch_xla" in sys.modules:
        return sys.modules["torch_xla"]
    import torch.nn as nn
    gru, clip = nn.GRU, nn.utils.clip_grad_norm_
    import torch_xla
    nn.GRU = gru
    nn.utils.clip_grad_norm_ = clip
    return torch_xla
