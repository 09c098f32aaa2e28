"""Datasets and functions the tests' worker hosts import by name (pw.DataLoader,
pw.colocated); the embedded cluster puts this folder on their path."""

import os
import time

import torch


class Rows(torch.utils.data.Dataset):
    """Sample i: ``x`` = i repeated ``dim`` times (float32), ``y`` = a fixed random
    regression target; ``bad``: an index whose read raises."""

    def __init__(self, n=64, dim=8, out=4, bad=-1):
        self.n, self.dim, self.bad = n, dim, bad
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, dim, generator=g)
        self.x[:, 0] = torch.arange(n, dtype=torch.float32)
        self.y = torch.randn(n, out, generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise KeyError(f"sample {i} is corrupt")
        return self.x[i], self.y[i]


def rows(**kw):
    return Rows(**kw)


def dict_rows(**kw):
    class D(Rows):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return {"x": x, "y": y}
    return D(**kw)


def pid_rows(**kw):
    """Rows whose samples also carry the pid of the process that read them. The class
    is made inside the factory, so it cannot be pickled (many users' datasets cannot)."""
    class WithPid(Rows):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x, y, torch.tensor([os.getpid()])
    return WithPid(**kw)


def slow_rows(delay=120.0, **kw):
    """Rows whose samples take ``delay`` seconds to read in a DataLoader worker (the
    host's own reads, for the loader's structure, are quick)."""
    class Slow(Rows):
        def __getitem__(self, i):
            if torch.utils.data.get_worker_info() is not None:
                time.sleep(delay)
            return super().__getitem__(i)
    return Slow(**kw)


# a collate function that pickle cannot name
lambda_collate = lambda samples: torch.utils.data.default_collate(samples)  # noqa: E731


def with_strings(**kw):
    class S(Rows):
        def __getitem__(self, i):
            return super().__getitem__(i)[0], f"name-{i}"
    return S(**kw)


def broken_factory(**kw):
    raise RuntimeError("no such split: " + str(kw.get("split")))


def summarize(x, y, scale=1.0):
    return {"sum": float(x.double().sum()) * scale, "doubled": x * 2,
            "pair": (y + 1, "label")}


def slow_double(x, secs=1.0):
    time.sleep(secs)
    return x * 2


def boom(x):
    raise ValueError("bad value in a colocated function")


def row_stats(x, y=None):
    out = {"rows": int(x.shape[0]), "first": float(x[0, 0]), "sum": float(x.double().sum())}
    if y is not None:
        out["y_shape"] = list(y.shape)
    return out


def scaled_rows(x, by=2.0):
    """A host's rows, scaled, and its first row (its own region of each output)."""
    return {"scaled": x * by, "first": x[:1].clone(), "rows": int(x.shape[0])}


def tensors_on_host_0(x):
    """A tensor from the host whose rows start at 0 only: hosts disagree."""
    return [x * 1] if float(x[0, 0]) == 0.0 else []


class Stream(torch.utils.data.IterableDataset):
    """``Rows(n)`` as a stream: its samples in order, split over torch's DataLoader
    workers as torch's docs show (worker k takes every num_workers-th sample);
    ``bad``: the position where the stream raises."""

    def __init__(self, n=20, bad=-1, **kw):
        self.rows, self.bad = Rows(n=n, **kw), bad

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(len(self.rows)):
            if info is not None and i % info.num_workers != info.id:
                continue
            if i == self.bad:
                raise IOError(f"record {i} of the stream is unreadable")
            yield self.rows[i]


class SizedStream(Stream):
    def __len__(self):
        return len(self.rows)


def stream(**kw):
    return Stream(**kw)


def sized_stream(**kw):
    return SizedStream(**kw)
