"""Slice keys: only the client that owns a slice can call its executor.

The coordinator gives each slice a random key when it allocates it, tells the
executor, and returns it to the owning client only. Every call of the client's
``ExecutorConnection`` carries it as gRPC metadata; the executor refuses calls without
it with ``PERMISSION_DENIED``. Buffer ids (small integers) are scoped by the slice, so
another client cannot read, use or free them by guessing, even with the cluster token.

Example::

    ch = with_slice_key(grpc_util.channel(address), key)
"""

from __future__ import annotations

import hmac

import grpc

from .grpc_util import _AddToken

SLICE_KEY = "x-pathways-slice-key"


class _AddSliceKey(_AddToken):
    def __init__(self, key: str) -> None:
        self._md = (SLICE_KEY, key)


def with_slice_key(ch: grpc.Channel, key: str) -> grpc.Channel:
    """``ch`` with the slice's key added to every call's metadata."""
    return grpc.intercept_channel(ch, _AddSliceKey(key))


def check_slice_key(context, want: str, what: str) -> None:
    """Abort the call with PERMISSION_DENIED (message ``what``) unless it carries ``want``."""
    got = dict(context.invocation_metadata() or ()).get(SLICE_KEY, "")
    if not hmac.compare_digest(got.encode(), want.encode()):
        context.abort(grpc.StatusCode.PERMISSION_DENIED, what)
