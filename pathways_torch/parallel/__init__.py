"""Parallelism strategies for pw.Trainer: how parameters and batches are laid out."""
