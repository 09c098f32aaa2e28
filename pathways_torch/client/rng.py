"""Per-call RNG seeds: every call of a program that draws random numbers gets its own.

A program's random ops (dropout, ``torch.rand*``, ``bernoulli``...) draw from one
int64 seed input (see capture). A ``SeedStream`` hands out the seeds: the k-th is a
hash of (base, k), so a stream with the same base gives the same numbers run after
run, and its ``position`` is all a checkpoint needs to resume it exactly.

Example::

    seeds = SeedStream(torch.initial_seed())
    s0, s1 = seeds(), seeds()          # different; the same on every run
    seeds.position                     # 2
"""

from __future__ import annotations

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class SeedStream:
    """Seeds ``hash(base, 0), hash(base, 1), ...`` as non-negative int64 values."""

    def __init__(self, base: int, position: int = 0) -> None:
        self.base = int(base) & _MASK
        self.position = int(position)

    def __call__(self) -> int:
        k = self.position
        self.position += 1
        return _splitmix64(self.base ^ _splitmix64(k)) >> 1

    def __repr__(self) -> str:
        return f"SeedStream(base={self.base}, position={self.position})"
