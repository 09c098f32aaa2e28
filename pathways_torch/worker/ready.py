"""Waiting for device buffers without waiting for everything queued behind them.

torch_xla's ``_xla_wait_device_ops`` returns once *all* work launched on the devices is
done. An executor keeps launching, so a Wait or a watermark that waits that way for one
buffer also waits for the programs queued after it: on shared devices each Wait
returned one program late, on exclusive ones when the device drained, and a pipeline
stage sent an activation only once the work queued behind it was done
(docs/architecture.md, Decision 21).

So an entry knows when its buffer is computed (``Entry.done``): it was made by an
execution run to completion (shared devices, a gang op, profiling), or an earlier
wait covered it. A small one-device buffer still being computed is waited for by
itself, by copying it to the host: ``.cpu()`` waits for its own buffer and no more.
Only the others wait for all device work.

What torch_xla 2.9 does not offer: a safe wait for one launched buffer without a copy.
``_on_ready_callback`` waits for all device work first (holding the GIL, which
deadlocks against an execution thread), and a DLPack view aborts the process (a CHECK,
not an exception) when the launch has not yet given the output its buffer.

Example::

    wait_entries(torch_xla._XLAC, entries, store, one_device=not spmd)
"""

from __future__ import annotations

from typing import Iterable


# A one-device buffer up to this size still being computed is waited for by copying
# it to the host (``.cpu()`` waits for it alone); a bigger one waits for all device work.
OWN_WAIT_MAX_BYTES = 1 << 20


def waits_alone(t) -> bool:
    """Whether a one-device buffer still being computed is waited for by itself (a copy
    to the host) rather than by a wait for all device work."""
    n = t.numel()
    return 0 < n * t.element_size() <= OWN_WAIT_MAX_BYTES


def wait_entries(XLAC, entries: Iterable, store=None, one_device: bool = False) -> None:
    """Block until the device buffers of ``entries`` (store Entries) are computed; an
    asynchronous execution's failure raises here. ``one_device``: the executor's
    buffers are one-device ones, so small ones are waited for one by one (held against
    donation in ``store`` while they are read)."""
    left = [e for e in entries
            if e is not None and not e.done and e.tensor is not None
            and e.tensor.device.type == "xla"]
    if one_device and store is not None:
        rest = []
        for e in left:
            if not waits_alone(e.tensor):
                rest.append(e)
            elif store.begin_read(e):       # (a donated one has nothing left to wait for)
                try:
                    e.tensor.cpu()
                finally:
                    store.end_read(e)
                e.done = True
        left = rest
    if not left:
        return
    XLAC._xla_wait_device_ops([])
    for e in left:
        e.done = True
