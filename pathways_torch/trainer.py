"""Backward-compatible alias: ``pw.Trainer`` lives in ``pathways_torch.training``."""

from .training import Restart, Trainer

__all__ = ["Trainer", "Restart"]
