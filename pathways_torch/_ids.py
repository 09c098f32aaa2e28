"""Ids of transfers and data loaders: random 63-bit odd numbers from the OS.

Not from Python's global ``random``: a script that calls ``random.seed(0)`` every epoch
would repeat them (two transfers in flight under one id take each other's bytes), and
every draw would shift the script's own random numbers (its augmentations would differ
from the same script's under plain torch).

Example::

    tid = random_id()
"""

import secrets


def random_id() -> int:
    """A fresh nonzero 63-bit id (odd, so never 0, which the protocol reads as none)."""
    return secrets.randbits(63) | 1
