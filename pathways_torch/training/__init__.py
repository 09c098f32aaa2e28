"""``pw.Trainer`` and its parts: an nn.Module and a torch.optim optimizer trained on slices.

- ``trainer.py``: the ``Trainer`` facade (placement, ``step``, state, ``fit``).
- ``programs.py``: the step / gradient / optimizer-update programs built from a model.
- ``pipeline.py``: the GPipe schedule of ``pw.Pipeline``; ``islands.py``: ``pw.MultiIsland``.
- ``batches.py``: splitting batches and placing them on slices.
- ``elastic.py``: ``fit``'s loop, its restarts after a lost worker, ``resume=True``, its
  progress bar and its ``FitResult``;
  ``checkpoint.py``: its checkpoint directory (``latest.json``).
- ``optim.py``: functional SGD / Adam / AdamW matching torch.optim.

The direction is one way: training uses the client, the client never imports training.
"""

from .elastic import FitResult, Restart
from .optim import UnsupportedOptimizer
from .trainer import Trainer

__all__ = ["Trainer", "Restart", "FitResult", "UnsupportedOptimizer"]
