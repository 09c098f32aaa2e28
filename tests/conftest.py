"""Shared fixtures: one real embedded cluster per test module, always shut down."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
# The suite compiles with LLVM at optimization level 1, not XLA's default 3: its checks
# are of numbers, not speed. Measured here: resnet's training step compiles in 8.7 s,
# not 21 s; the suite's test time fell from 5,313 to 4,590 s. Level 0 (5.0 s) moved
# float results by an ulp: three tests that hold torch's values that closely failed.
# Every process the suite starts inherits this (workers, executors, the recipes'
# clients). XLA_FLAGS that name the level win: --xla_backend_optimization_level=3
# runs the suite as users' programs compile.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_backend_optimization_level=1").strip()

import pathways_torch as pw  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report carries the tails of the running cluster's logs (the
    coordinator's and each worker's, executors included): they are removed at shutdown,
    and a CI run shows only its report."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    from pathways_torch.client import runtime   # not yet imported by a unit test
    cluster = runtime._state.cluster
    logdir = getattr(cluster, "logdir", None)
    if not logdir or not os.path.isdir(logdir):
        return
    for name in sorted(os.listdir(logdir)):
        try:
            with open(os.path.join(logdir, name), "rb") as f:
                tail = f.read()[-4000:].decode(errors="replace")
        except OSError:
            continue
        report.sections.append((f"cluster log {name} (tail)", tail or "(empty)"))


_controller: list = []   # the config of the process that prints (not an xdist worker)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        _controller.append(config)


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """Print a failure the moment it happens, not in the summary at the end: a CI run
    that is killed at its time limit shows only what it printed, and only its tail."""
    if not report.failed or not _controller:
        return
    tr = _controller[0].pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    tr.write_line("")
    tr.write_sep("!", f"FAILED {report.nodeid} ({report.when})")
    tr.write_line(report.longreprtext[-4000:])
    for title, text in report.sections:
        if title.startswith("cluster log"):
            tr.write_line(f"--- {title} ---\n{text[-1500:]}")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """A process that hangs on its way out (a thread that will not join, an atexit
    handler) is outside every test's timeout: dump every thread's stack and exit."""
    import faulthandler
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)


@pytest.fixture(scope="module")
def cluster8():
    """A coordinator and one worker process with 8 CPU XLA devices, for the module."""
    pw.init(devices_per_host=8, timeout=120)
    try:
        yield
    finally:
        pw.shutdown()


@pytest.fixture(scope="module")
def s2(cluster8):
    """A 2-device "data" slice on the module's cluster (the Trainer tests' SPMD slice)."""
    s = pw.slice((2,), axis_names=("data",))
    yield s
    s.release()


@pytest.fixture(scope="module")
def pipe_slices(cluster8):
    """Two 1-device slices on the module's cluster (a 2-stage pipeline's)."""
    slices = [pw.slice((1,)) for _ in range(2)]
    yield slices
    for s in slices:
        s.release()


@pytest.fixture(scope="module")
def mesh42(cluster8):
    """A (4, 2) slice with axes ("data", "model") on the module's cluster."""
    s = pw.slice((4, 2), axis_names=("data", "model"))
    try:
        yield s
    finally:
        s.release()
