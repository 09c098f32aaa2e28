"""Per-call RNG seeds: every call of a program that draws random numbers gets its own.

A program's random ops (dropout, ``torch.rand*``, ``bernoulli``...) draw from one
int64 seed input (see capture). A ``SeedStream`` hands out the seeds: the k-th is a
hash of (base, k), so a stream with the same base gives the same numbers run after
run, and its ``position`` is all a checkpoint needs to resume it exactly.

A stream made by ``SeedStream.of_torch()`` (a Trainer without ``seed=``) starts from
``torch.initial_seed()`` and starts again when the script seeds torch with another
seed, so seeding after building a Trainer gives the same run every time, as in a torch
loop. Program calls outside a Trainer without ``pw.init(seed=)`` use
``drawn_from_torch``: each call's seed is a draw from torch's generator.

Example::

    seeds = SeedStream(1234)
    s0, s1 = seeds(), seeds()          # different; the same on every run
    seeds.position                     # 2
"""

from __future__ import annotations

from typing import Optional

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def drawn_from_torch() -> int:
    """A call's seed drawn from torch's default generator, as torch's own random ops
    draw from it: ``torch.manual_seed(s)`` replays the same calls' numbers."""
    import torch
    return int(torch.randint(0, _MASK >> 1, (), dtype=torch.int64))


class SeedStream:
    """Seeds ``hash(base, 0), hash(base, 1), ...`` as non-negative int64 values."""

    def __init__(self, base: int, position: int = 0) -> None:
        self.base = int(base) & _MASK
        self.position = int(position)
        self._torch_seed: Optional[int] = None     # followed torch.initial_seed()

    @classmethod
    def of_torch(cls) -> "SeedStream":
        """A stream that follows ``torch.manual_seed``: from ``torch.initial_seed()``,
        and from the start of a new one each time the script seeds torch."""
        import torch
        stream = cls(torch.initial_seed())
        stream._torch_seed = torch.initial_seed()
        return stream

    def restore(self, base: int, position: int) -> None:
        """Go on from a checkpoint's place (a ``torch.manual_seed`` before this does
        not override it; one after it starts again, as in torch)."""
        self.base, self.position = int(base) & _MASK, int(position)
        if self._torch_seed is not None:
            import torch
            self._torch_seed = torch.initial_seed()

    def __call__(self) -> int:
        if self._torch_seed is not None:
            import torch
            seed = torch.initial_seed()
            if seed != self._torch_seed:        # the script called torch.manual_seed
                self.base, self.position, self._torch_seed = seed & _MASK, 0, seed
        k = self.position
        self.position += 1
        return _splitmix64(self.base ^ _splitmix64(k)) >> 1

    def __repr__(self) -> str:
        return f"SeedStream(base={self.base}, position={self.position})"
