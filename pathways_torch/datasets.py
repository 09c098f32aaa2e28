"""Datasets that need no download, made on the hosts that load them.

``SyntheticImages`` is what the ResNet recipe and ``bench/input.py`` feed through
``pw.DataLoader``: every sample is a pure function of (seed, index), so any host makes
the same sample for the same index, and the classes differ enough to be learnt.
``SyntheticImageStream`` gives the same images as a stream (an ``IterableDataset``).

Example::

    loader = pw.DataLoader("pathways_torch.datasets:synthetic_images",
                           dataset_kwargs={"size": 1024, "image_size": 32},
                           batch_size=64, slice=trainer, shuffle=True)
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class SyntheticImages(Dataset):
    """``size`` images of ``channels x image_size x image_size`` float32 and their int64
    labels in ``range(num_classes)``: a class-specific pattern plus noise."""

    def __init__(self, size: int = 1024, num_classes: int = 10, image_size: int = 32,
                 channels: int = 3, seed: int = 0, noise: float = 0.5) -> None:
        self.size, self.num_classes = int(size), int(num_classes)
        self.shape = (int(channels), int(image_size), int(image_size))
        self.seed, self.noise = int(seed), float(noise)
        g = torch.Generator().manual_seed(self.seed)
        self.patterns = torch.randn((self.num_classes,) + self.shape, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} is out of range for {self.size} images")
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * int(index) + 1)
        label = int(torch.randint(self.num_classes, (), generator=g))
        image = self.patterns[label] + self.noise * torch.randn(self.shape, generator=g)
        return image, torch.tensor(label, dtype=torch.int64)


def synthetic_images(**kwargs) -> SyntheticImages:
    """The factory ``pw.DataLoader`` names: ``SyntheticImages(**kwargs)``."""
    return SyntheticImages(**kwargs)


class SyntheticImageStream(IterableDataset):
    """``SyntheticImages`` as a stream, in index order; with torch DataLoader workers,
    worker k streams the images ``i`` with ``i % num_workers == k`` (as torch's docs
    split a stream), so every image comes once."""

    def __init__(self, **kwargs) -> None:
        self.images = SyntheticImages(**kwargs)

    def __len__(self) -> int:
        return len(self.images)

    def __iter__(self):
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, len(self.images), n):
            yield self.images[i]


def synthetic_image_stream(**kwargs) -> SyntheticImageStream:
    """The factory of ``SyntheticImageStream(**kwargs)``."""
    return SyntheticImageStream(**kwargs)
