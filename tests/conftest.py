"""Shared fixtures: one real embedded cluster per test module, always shut down."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pathways_torch as pw  # noqa: E402


@pytest.fixture(scope="module")
def cluster8():
    """A coordinator and one worker process with 8 CPU XLA devices, for the module."""
    pw.init(devices_per_host=8, timeout=120)
    try:
        yield
    finally:
        pw.shutdown()


@pytest.fixture(scope="module")
def mesh42(cluster8):
    """A (4, 2) slice with axes ("data", "model") on the module's cluster."""
    s = pw.slice((4, 2), axis_names=("data", "model"))
    try:
        yield s
    finally:
        s.release()
