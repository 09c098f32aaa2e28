"""The recipes run as a user runs them: under plain python and under pathways-run.

Short runs (a few steps); each must end with its JSON summary line and a finite loss.
"""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(args, launcher=()):
    env = dict(os.environ)
    env.pop("PATHWAYS_ADDRESS", None)
    cmd = [sys.executable] + (["-m", "pathways_torch", *launcher] if launcher else []) + args
    r = subprocess.run(cmd, cwd=ROOT / "recipes", env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert math.isfinite(summary.get("final_loss", summary.get("max_abs_err", 0.0)))
    return summary


def test_quickstart_under_pathways_run():
    s = run(["quickstart.py"], launcher=["--devices-per-host", "8"])
    # float32 XLA against plain torch on relu(x @ w), values of order 10: the numerics
    # tests' matmul tolerance (tests/test_numerics.py MATMUL_TOL: rtol 1e-5, atol 1e-4
    # on values of order 10), not bit equality, which no rounding contract promises.
    # The recipe itself also checks allclose(rtol=1e-5, atol=1e-5) element by element
    # and exits non-zero if that fails (run() asserts the exit code).
    assert 0.0 <= s["max_abs_err"] <= 1e-4, s


def test_train_mlp_under_pathways_run_matches_torch():
    s = run(["train_mlp.py", "--steps", "30"], launcher=["--devices-per-host", "4"])
    assert abs(s["final_loss"] - s["torch_final_loss"]) <= 1e-4 * abs(s["torch_final_loss"])
    assert s["final_loss"] < s["first_loss"]


def test_train_gpt_plain_python(tmp_path):
    s = run(["train_gpt.py", "--steps", "12", "--devices", "2", "--fsdp",
             "--checkpoint", str(tmp_path / "ckpt")])
    assert s["final_loss"] < s["first_loss"]
    assert (tmp_path / "ckpt" / ".metadata").exists()


def test_train_gpt_over_two_hosts():
    s = run(["train_gpt.py", "--steps", "8", "--devices", "4", "--hosts", "2"])
    assert s["hosts"] == 2 and s["final_loss"] < s["first_loss"]


@pytest.mark.slow
def test_pipeline_gpt_plain_python():
    s = run(["pipeline_gpt.py", "--steps", "3", "--stages", "2", "--microbatches", "2"])
    assert s["stages"] == 2


@pytest.mark.slow
def test_two_islands_under_pathways_run():
    s = run(["two_islands.py", "--steps", "3"],
            launcher=["--islands", "2", "--devices-per-host", "2"])
    assert s["dcn_bytes"] > 0


def test_train_resnet_on_host_batches_matches_torch():
    s = run(["train_resnet.py", "--steps", "12"])
    assert s["early_loss_diff"] < 1e-4 and s["final_loss"] < s["first_loss"]


@pytest.mark.slow
def test_train_resnet_over_two_islands():
    s = run(["train_resnet.py", "--steps", "4", "--islands", "2"])
    assert s["islands"] == 2 and s["early_loss_diff"] < 1e-4
