"""Unit tests of the tensor <-> bytes codec (no pickle; lengths checked)."""

import pytest
import torch

from pathways_torch.rpc import codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16, torch.int32, torch.int64, torch.int8,
                                   torch.uint8, torch.bool])
def test_round_trip(dtype):
    t = (torch.randn(3, 5) * 10).to(dtype)
    back = codec.from_bytes(codec.to_bytes(t), codec.dtype_name(dtype), t.shape)
    assert back.dtype == dtype and torch.equal(back, t)


def test_non_contiguous_and_empty():
    t = torch.arange(12.).reshape(3, 4).t()
    assert torch.equal(codec.from_bytes(codec.to_bytes(t), "float32", (4, 3)), t)
    e = codec.from_bytes(b"", "float32", (0, 4))
    assert e.shape == (0, 4)


def test_lazy_views_and_tensors_that_need_grad_give_their_values():
    z = torch.randn(3, 4, dtype=torch.complex64)
    x = torch.randn(3, 4, requires_grad=True)
    for t, want in ((z.conj(), z.conj().resolve_conj()), (torch._neg_view(x.detach()), -x),
                    (x, x), (torch.randn(5).bfloat16().t(), None)):
        want = t.detach() if want is None else want.detach()
        back = codec.from_bytes(codec.to_bytes(t), codec.dtype_name(t.dtype), t.shape)
        assert torch.equal(back, want)


def test_length_mismatch_is_rejected():
    with pytest.raises(ValueError, match="needs 16"):
        codec.from_bytes(b"\0" * 12, "float32", (2, 2))
    with pytest.raises(ValueError, match="unknown dtype"):
        codec.from_bytes(b"", "float99", (0,))
    with pytest.raises(ValueError, match="negative"):
        codec.from_bytes(b"", "float32", (-1,))


def test_chunks_cover_payload():
    data = bytes(range(256)) * 100
    parts = codec.chunks(data, 1000)
    assert b"".join(bytes(p) for p in parts) == data
    assert all(len(p) <= 1000 for p in parts)
