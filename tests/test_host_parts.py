"""How an executor reads a one-device buffer to the host (``Transfers._host_parts``): in
place where the device's memory is host memory, else by a copy; and that the copy a
checkpoint or a colocated function keeps (``_host_copy``) owns its memory. Real torch_xla in a
child process (the device kind comes from PJRT_DEVICE there, as in an executor)."""

import os
import subprocess
import sys

_CHILD = r"""
import sys, types
import torch, torch_xla
from pathways_torch.worker.store import Entry
from pathways_torch.worker.transfers import Transfers

other_kind = sys.argv[1] == "other"
if other_kind:
    # what DLPack gives for memory the host cannot read in place (a CUDA buffer): a
    # tensor on another device; "meta" stands in for one here
    torch.utils.dlpack.from_dlpack = lambda capsule: torch.empty(4096, device="meta")
expected = torch.arange(4096, dtype=torch.float32)
t = expected.to(torch_xla.device())
torch_xla.sync()
torch_xla._XLAC._xla_wait_device_ops([])
entry = Entry(t, None, t.numel() * 4, done=True)
me = types.SimpleNamespace(torch=torch, torch_xla=torch_xla, spmd=False)
if sys.argv[1] == "copy":
    me._host_parts = lambda e: Transfers._host_parts(me, e)
    me._host_whole = lambda e: Transfers._host_whole(me, e)
    c = Transfers._host_copy(me, entry)
    assert torch.equal(c, expected), "wrong bytes"
    shares = c.data_ptr() == torch_xla._XLAC._unsafe_buffer_pointer(t)
    print("SHARES" if shares else "OWNS")
    sys.exit(0)
parts = Transfers._host_parts(me, entry)
assert len(parts) == 1, parts
p = parts[0]
assert p.device.type == "cpu", p.device
assert torch.equal(p, expected), "wrong bytes"
in_place = p.data_ptr() == torch_xla._XLAC._unsafe_buffer_pointer(t)
print("IN_PLACE" if in_place else "COPIED")
"""


def _host_parts(kind: str) -> str:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    p = subprocess.run([sys.executable, "-c", _CHILD, kind], env=env, text=True,
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()[-1]


def test_a_host_resident_buffer_is_read_in_place():
    assert _host_parts("host") == "IN_PLACE"


def test_a_buffer_another_device_holds_is_copied_to_the_host():
    assert _host_parts("other") == "COPIED"


def test_the_copy_a_checkpoint_keeps_owns_its_memory():
    # a view would change under the next program that donates the buffer
    assert _host_parts("copy") == "OWNS"
