"""``fit``'s checkpoint directory: ``root/step-NNNNNN/`` (each a ``Trainer.save``) and
``root/latest.json``, naming the newest complete one. ``fit(resume=True)`` reads it
back in a new process (a restarted script) as ``fit`` does after a lost worker.

(How a checkpoint's arrays are written and read by the executors is the client's:
``pathways_torch/client/checkpoint.py``.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import TYPE_CHECKING, List, Optional, Tuple

if TYPE_CHECKING:
    from .trainer import Trainer


_STEP_DIR = re.compile(r"step-(\d{6,})$")


class _Checkpoints:
    """``root/step-NNNNNN/`` written by ``Trainer.save``; ``root/latest.json`` names the
    newest complete one (replaced atomically after the save returned).

    ``latest.json``: ``step`` (fit's step count: batches done), ``path`` (the
    ``step-NNNNNN`` directory), ``trainer_steps`` (``trainer.steps``: optimizer updates,
    fewer than ``step`` with ``accumulate``), ``lrs`` (each param group's learning rate,
    which ``Trainer.save`` does not hold) and ``time`` (when it was written, epoch s)."""

    def __init__(self, root: str, keep: Optional[int]) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None, not {keep}")
        self.root, self.keep = os.path.abspath(root), keep
        self.written: List[str] = []
        os.makedirs(self.root, exist_ok=True)

    def save(self, trainer: "Trainer", step: int) -> None:
        name = f"step-{step:06d}"
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)     # no stale parts of an earlier run
        trainer.save(path)
        info = {"step": step, "path": name, "trainer_steps": trainer.steps,
                "lrs": [float(g["lr"]) for g in trainer.optimizer.param_groups],
                "time": time.time()}
        tmp = os.path.join(self.root, "latest.json.tmp")
        with open(tmp, "w") as f:
            json.dump(info, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.root, "latest.json"))
        if name in self.written:
            self.written.remove(name)
        self.written.append(name)
        while self.keep is not None and len(self.written) > self.keep:
            shutil.rmtree(os.path.join(self.root, self.written.pop(0)), ignore_errors=True)

    def latest(self) -> Tuple[int, str, dict]:
        """(step, directory, the whole latest.json) of the newest complete checkpoint."""
        with open(os.path.join(self.root, "latest.json")) as f:
            info = json.load(f)
        return int(info["step"]), os.path.join(self.root, info["path"]), info

    def exists(self) -> bool:
        """Whether a complete checkpoint is recorded (``latest.json`` is there)."""
        return os.path.exists(os.path.join(self.root, "latest.json"))

    def adopt(self, step: int) -> None:
        """Count the ``step-NNNNNN/`` directories an earlier run left, up to ``step``
        (the one resumed from), as written by this one: ``keep`` then removes the
        oldest of them as new checkpoints come, as that run would have."""
        found = sorted((int(m.group(1)), name) for name in os.listdir(self.root)
                       if (m := _STEP_DIR.match(name))
                       and os.path.isdir(os.path.join(self.root, name)))
        self.written = [name for k, name in found if k <= step]
