"""Batches as torch's pytree sees them, on the client and on the hosts alike.

Hugging Face's tokenizers and data collators return a ``BatchEncoding``, a ``UserDict``
that torch's pytree takes for one opaque leaf; ``model(**batch)`` takes it as a dict.

Example::

    batch = plain_batch(tokenizer(texts, return_tensors="pt"))   # a dict of tensors
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils import _pytree as pytree


def plain_batch(value: Any) -> Any:
    """``value`` with every mapping that torch's pytree does not know as a dict (and
    the lists, tuples and dicts around them rebuilt); everything else as it is."""
    if type(value) is dict or (isinstance(value, Mapping)
                               and type(value) not in pytree.SUPPORTED_NODES):
        return {k: plain_batch(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_batch(v) for v in value)
    return value
