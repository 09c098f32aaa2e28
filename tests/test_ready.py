"""Unit tests of what an executor's Waits and watermarks wait for (worker/ready.py and
the store's notes): buffers known computed wait for nothing, small one-device ones
wait each for itself, others wait for the devices once, and a watermark lists exactly
the buffers put since the last one."""

import types

from pathways_torch.worker import ready as ready_mod
from pathways_torch.worker import store as store_mod
from pathways_torch.worker.ready import wait_entries
from pathways_torch.worker.store import Entry, ObjectStore


class _Devices:
    """Stands in for torch_xla._XLAC: counts waits for all device work."""

    def __init__(self) -> None:
        self.waits = 0

    def _xla_wait_device_ops(self, devices) -> None:
        assert devices == []
        self.waits += 1


class _Tensor:
    """Stands in for a torch_xla tensor: counts the copies to the host."""

    def __init__(self, nbytes: int = 16) -> None:
        self.device = types.SimpleNamespace(type="xla")
        self.nbytes, self.copies = nbytes, 0

    def numel(self) -> int:
        return self.nbytes // 4

    def element_size(self) -> int:
        return 4

    def cpu(self):
        self.copies += 1
        return self


def _xla_tensor(nbytes: int = 16):
    return _Tensor(nbytes)


def _entry(done: bool, nbytes: int = 16) -> Entry:
    e = Entry(_xla_tensor(nbytes), None, nbytes)
    e.done = done
    return e


def test_computed_buffers_wait_for_nothing():
    dev = _Devices()
    host = Entry(types.SimpleNamespace(device=types.SimpleNamespace(type="cpu")))
    wait_entries(dev, [_entry(True), _entry(True), None, Entry(error=object()), host])
    assert dev.waits == 0


def test_launched_buffers_wait_once_and_are_then_known():
    dev = _Devices()
    launched = [_entry(False), _entry(False)]
    wait_entries(dev, launched + [_entry(True)])
    assert dev.waits == 1
    assert all(e.done for e in launched)
    wait_entries(dev, launched)
    assert dev.waits == 1


def test_small_one_device_buffers_wait_each_for_itself():
    dev, s = _Devices(), ObjectStore()
    small = [_entry(False), _entry(False, ready_mod.OWN_WAIT_MAX_BYTES)]
    wait_entries(dev, small, s, one_device=True)
    assert dev.waits == 0                   # no wait for all device work
    assert [e.tensor.copies for e in small] == [1, 1] and all(e.done for e in small)
    assert all(e.readers == 0 for e in small)   # held against donation while read
    big = _entry(False, ready_mod.OWN_WAIT_MAX_BYTES + 4)
    donated = _entry(False)
    donated.donated = True
    wait_entries(dev, [big, donated], s, one_device=True)
    assert dev.waits == 1 and big.tensor.copies == 0 and donated.tensor.copies == 0
    sharded = _entry(False)                 # an SPMD executor's buffers: no copies
    wait_entries(dev, [sharded], s, one_device=False)
    assert dev.waits == 2 and sharded.tensor.copies == 0


def test_watermark_notes_list_what_was_put_since_the_last():
    s = ObjectStore()
    s.put(1, _entry(False))                 # before noting: the first watermark waits
    s.start_noting()
    s.put(2, _entry(False))
    s.put(3, Entry(error=object()))
    noted, launched = s.take_noted()
    assert noted == [3] and launched is None
    s.put(4, _entry(False))
    s.put(5, _entry(True))
    s.put(6, Entry(error=object()))
    noted, launched = s.take_noted()
    assert noted == [6] and launched == [4, 5]
    assert s.take_noted() == ([], [])


def test_watermark_notes_overflow_to_waiting_for_everything(monkeypatch):
    monkeypatch.setattr(store_mod, "_MAX_LAUNCHED", 3)
    s = ObjectStore()
    s.start_noting()
    s.take_noted()
    for b in range(1, 5):
        s.put(b, _entry(False))
    assert s.take_noted() == ([], None)
    s.put(9, _entry(False))
    assert s.take_noted() == ([], [9])
    s.stop_noting()                         # not noting: nothing listed, wait for all
    s.put(10, _entry(False))
    assert s.take_noted() == ([], None)
