"""Static-shape formulas for ops that torch_xla has no lowering for but real models reach.

torch_xla runs an op it does not lower on the CPU, reading its input's values: in a
trace on placeholders that cannot work (capture refuses such ops by name). Some of them
only *look* data-dependent: their output shape is static and a formula of ordinary ops
computes them. Capture decomposes these while it records the graph, so the program holds
only ops XLA compiles. The ones here are what mixture-of-experts layers use (Hugging
Face's default ``grouped_mm`` experts path: ``torch.histc`` to count tokens per expert,
then a grouped matmul over the rows sorted by expert), the backward of a
weight-normed layer, and a median along a dimension.

Example::

    table = lowerings.table()          # {op overload: python decomposition}
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

from ..errors import DataDependentError


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:
    """torch.histc as a comparison count: O(numel x bins), static shapes."""
    if min == max:
        raise DataDependentError(
            "torch.histc without min= and max= takes its range from the data; give both "
            "(the range then is static) or compute the histogram outside the program")
    xs = x.reshape(-1)
    # torch's CPU kernel: pos = (x - min) * bins / (max - min), clamped to the last bin at max
    pos = ((xs - min) * bins / (max - min)).floor().to(torch.int64)
    pos = torch.where(xs == max, torch.full_like(pos, bins - 1), pos)
    inside = (xs >= min) & (xs <= max)
    hits = (pos.unsqueeze(1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(1)
    return hits.sum(0).to(x.dtype)


def _group_mask(offs: torch.Tensor, rows: int, groups: int, dtype) -> torch.Tensor:
    """[rows, groups]: 1 where row r belongs to group e (offs are cumulative ends); rows
    past the last end belong to none."""
    r = torch.arange(rows, device=offs.device).unsqueeze(1)
    ends = offs.to(torch.int64).unsqueeze(0)
    starts = torch.cat([torch.zeros_like(ends[:, :1]), ends[:, :-1]], dim=1)
    return ((r >= starts) & (r < ends)).to(dtype)


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``input`` (sorted by group) times their group's ``weight[e]`` ([in, out])."""
    m = _group_mask(offs, input.shape[0], weight.shape[0], input.dtype)
    return torch.einsum("se,si,eio->so", m, input, weight)


def grouped_mm_backward(input, weight, offs, grad_output):
    m = _group_mask(offs, input.shape[0], weight.shape[0], input.dtype)
    grad_input = torch.einsum("se,so,eio->si", m, grad_output, weight)
    grad_weight = torch.einsum("se,si,so->eio", m, input, grad_output)
    return grad_input, grad_weight


def _aten_grouped_mm(input, mat2, offs=None, bias=None, out_dtype=None):
    if offs is None or input.dim() != 2 or mat2.dim() != 3 or bias is not None:
        return NotImplemented
    out = grouped_mm(input, mat2, offs)
    return out.to(out_dtype) if out_dtype is not None else out


def weight_norm_backward(grad_w, v, g, norms, dim: int):
    """The gradients of ``w = g * v / ||v||`` (norms over every dimension but ``dim``)
    with respect to ``v`` and ``g``: torch's formula for ``_weight_norm_interface``
    (nn.utils.parametrizations.weight_norm on a CPU), whose own backward XLA lacks."""
    dims = [d for d in range(v.dim()) if d != dim]
    sums = (grad_w * v).sum(dims, keepdim=True)
    grad_v = (g / norms) * (grad_w - v * (sums / (norms * norms)))
    return grad_v, sums / norms


def median_dim(x: torch.Tensor, dim: int = -1, keepdim: bool = False):
    """``x.median(dim)``: torch's lower median is the ((n - 1) // 2 + 1)-th smallest,
    which XLA computes as a kthvalue (torch_xla runs median(dim) on the CPU)."""
    return torch.ops.aten.kthvalue.default(x, (x.shape[dim] - 1) // 2 + 1, dim, keepdim)


def table() -> Dict[object, Callable]:
    """The decompositions for the ops that exist in this process (a library's custom
    ops exist once it is imported)."""
    aten = torch.ops.aten
    out: Dict[object, Callable] = {
        aten.histc.default: histc,
        aten._weight_norm_interface_backward.default: weight_norm_backward,
        aten.median.dim: median_dim,
    }
    if hasattr(torch.ops.aten, "_grouped_mm"):
        out[torch.ops.aten._grouped_mm.default] = _aten_grouped_mm
    try:
        hf = torch.ops.transformers
        out[hf.grouped_mm_fallback.default] = grouped_mm
        out[hf.grouped_mm_fallback_backward.default] = grouped_mm_backward
    except (AttributeError, RuntimeError):
        pass                                   # transformers not imported
    return out
