"""Waiting for device buffers without waiting for everything queued behind them.

torch_xla's ``_xla_wait_device_ops`` returns once *all* work launched on the devices is
done. An executor keeps launching, so a Wait or a watermark that waits that way for one
buffer also waits for the programs queued after it. On shared devices that cost a
client with 32 programs in flight most of its throughput: each Wait returned only when
the program running after its buffer's had finished, so the client refilled the queue
more slowly than it drained (docs/architecture.md, Decision 21).

So an entry knows when its buffer is computed (``Entry.done``): it was made by an
execution run to completion (shared devices, a gang op, profiling), or an earlier
wait for all device work covered it. Only the others wait for the devices.

What this does not do: wait for one launched buffer by itself. torch_xla 2.9 offers no
call for that which is safe here. ``_on_ready_callback`` waits for all device work
first (holding the GIL, which deadlocks against an execution thread), and a DLPack view
aborts the process (a CHECK, not an exception) when the launch has not yet given the
output its buffer.

Example::

    wait_entries(torch_xla._XLAC, entries)
"""

from __future__ import annotations

from typing import Iterable


def wait_entries(XLAC, entries: Iterable) -> None:
    """Block until the device buffers of ``entries`` (store Entries) are computed;
    an asynchronous execution's failure raises here."""
    left = [e for e in entries
            if e is not None and not e.done and e.tensor is not None
            and e.tensor.device.type == "xla"]
    if not left:
        return
    XLAC._xla_wait_device_ops([])
    for e in left:
        e.done = True
