"""Soak (issue 6, part 7): many small programs with random releases and cross-island
transfers over two islands; the workers' resources come back to where they started.

The driver is ``bench/soak.py`` (``run_soak``); ``make bench`` runs it with 20,000
programs and records the curve. Here it runs shortened: PATHWAYS_SOAK_PROGRAMS programs
(default 5,000, ~15 s of programs). Criteria (``soak.failures``): per executor, worker
agent and the coordinator, threads and open fds equal to the baseline and RSS within
10 %; per slice, buffers and buffer bytes equal to the baseline. Fetched values equal
plain torch within rtol = atol = 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

import pathways_torch as pw

_path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "soak.py"
_spec = importlib.util.spec_from_file_location("pathways_bench_soak", _path)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

PROGRAMS = int(os.environ.get("PATHWAYS_SOAK_PROGRAMS", "5000"))


@pytest.fixture(scope="module")
def two_islands():
    """Two islands of one host with 2 CPU devices; a (2,) slice on each."""
    slices = soak.start_cluster()
    try:
        yield slices
    finally:
        pw.shutdown()


def test_relay_of_a_released_array(two_islands):
    """An Array moved on from the slice it was moved to, then dropped at once: the
    release reaches that slice while its send still waits for the bytes (it used to
    discard them, and the move back never arrived)."""
    s0, s1 = two_islands
    w_cpu = torch.randn(soak.SHAPE[1], soak.SHAPE[1]) / soak.SHAPE[1] ** 0.5
    w = pw.put(w_cpu, s0, pw.P())
    for _ in range(10):
        x_cpu = torch.randn(soak.SHAPE)
        y = soak.mm(soak.mm(pw.put(x_cpu, s0, soak.SPEC), w), w)
        mid = y.to(s1, soak.SPEC)
        back = mid.to(s0, soak.SPEC)
        del mid, y
        want = soak._mm(soak._mm(x_cpu, w_cpu), w_cpu)
        torch.testing.assert_close(back.torch(timeout=60), want, rtol=soak.RTOL,
                                   atol=soak.ATOL)
    del back, w
    for s in two_islands:
        assert s.stats(sync=True).num_buffers == 0


@pytest.mark.slow
def test_soak_resources_return(two_islands):
    res = soak.run_soak(PROGRAMS, seed=0, sample_every=max(1, PROGRAMS // 20),
                        slices=two_islands)
    c = res["counts"]
    assert c["programs"] == PROGRAMS
    assert c["transfers"] > 0 and c["implicit_transfers"] > 0 and c["checks"] > 0
    assert c["releases"] > 0 and c["puts"] > 0
    assert res["failures"] == [], (
        "resources did not come back after the soak:\n" + "\n".join(res["failures"]) +
        f"\nbaseline {res['baseline']}\nfinal {res['final']}")
