"""A program defined once keeps working across pw.shutdown() and a new pw.init(); a
Trainer's module holds its trained values after pw.shutdown()."""

import copy

import pytest
import torch

import pathways_torch as pw


@pw.program
def double(x):
    return x * 2


def test_a_program_is_compiled_again_for_a_new_cluster():
    for _ in range(2):          # the second cluster hands out the same slice ids
        pw.init(devices_per_host=2, timeout=60)
        try:
            s = pw.slice((2,))
            assert double(pw.put(torch.arange(4.), s)).torch().tolist() == [0, 2, 4, 6]
        finally:
            pw.shutdown()


def _data_and_model(seed: int, steps: int):
    """Batches of 8 rows, a small MLP and its copy for plain torch."""
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(steps)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    return data, model, copy.deepcopy(model)


def test_shutdown_copies_the_trained_values_into_the_module():
    """A script that trains, calls pw.shutdown() and then saves the model saves the
    trained weights (the workers that held them are gone after shutdown)."""
    pw.init(devices_per_host=2, timeout=120)
    try:
        s = pw.slice((2,), axis_names=("data",))
        data, model, ref = _data_and_model(seed=1, steps=2)
        tr = pw.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                        torch.nn.functional.cross_entropy, slice=s)
        for x, y in data:
            tr.step(x, y)
    finally:
        pw.shutdown()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    saved = model.state_dict()          # after shutdown: no cluster to read from
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(saved[k], v, rtol=1e-5, atol=1e-5)
    assert tr._closed


def test_releasing_a_trainers_slice_copies_its_values_and_a_new_trainer_goes_on():
    """A notebook re-runs its training cell: ``s.release()`` (as the ResourceExhausted
    error says), a new slice, a new Trainer on the same model and optimizer (stop 43:
    every read of the module raised ClusterShutdownError until the old Trainer was
    garbage collected, and its steps were lost)."""
    pw.init(devices_per_host=2, timeout=120)
    try:
        data, model, ref = _data_and_model(seed=2, steps=3)
        opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        s = pw.slice((2,), axis_names=("data",))
        tr = pw.Trainer(model, opt, torch.nn.functional.cross_entropy, slice=s)
        for x, y in data[:2]:
            tr.step(x, y)
        s.release()
        with pytest.raises(pw.ClusterShutdownError, match="new pw.Trainer"):
            tr.step(*data[2])
        s = pw.slice((2,), axis_names=("data",))
        tr = pw.Trainer(model, opt, torch.nn.functional.cross_entropy, slice=s)
        tr.step(*data[2])
        tr.sync_to()
    finally:
        pw.shutdown()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for x, y in data:
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-5)
