"""Unit tests of what an executor's Waits and watermarks wait for (worker/ready.py and
the store's notes): buffers known computed wait for nothing, others wait for the
devices once, and a watermark lists exactly the buffers put since the last one."""

import types

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


def _xla_tensor():
    return types.SimpleNamespace(device=types.SimpleNamespace(type="xla"))


def _entry(done: bool) -> Entry:
    e = Entry(_xla_tensor(), None, 16)
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
