"""Half-precision ops as torch's CPU kernels compute them: in float32, rounded once.

torch runs an op of bfloat16 or float16 tensors as one kernel that casts its operands to
float32 (the kernel's "opmath" type), computes, and rounds the result once. torch_xla
lowers many such ops as several XLA operations on the half type, each rounding its
result, and rounds their scalars to it (``leaky_relu``'s slope, ``lerp``'s weight). On
4,096 bfloat16 values, ``lerp``, ``addcmul``, ``add(alpha=)``, ``gelu``, ``silu``,
softmax, ``mish``, the ELUs, ``leaky_relu``, ``hypot``, norms and variances came out one
ulp off torch in 10-70% of the elements (stop 37): an optimizer's bfloat16 momentum, a
bfloat16 model's activations. Capture records each op listed here, given
half-precision tensors, as the same op on float32 copies of its operands, rounded
back: torch's arithmetic. XLA keeps that float32 (executors turn excess precision
off). Log-softmax and ``logsumexp`` round where torch's kernels round (``SPECIAL``).

Example::

    table = opmath.wrap(table)     # each op in OPS: float32 inside for half inputs
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch
import torch.utils._pytree as pytree

HALF = (torch.bfloat16, torch.float16)

#: aten ops (name, overload) that torch computes in float32 for half-precision tensors
#: and torch_xla does not; an in-place op (its name ends in "_") runs as its functional
#: form, copied into its first argument
OPS = (
    ("lerp", "Scalar"), ("lerp", "Tensor"), ("lerp_", "Scalar"), ("lerp_", "Tensor"),
    ("addcmul", "default"), ("addcmul_", "default"),
    ("addcdiv", "default"), ("addcdiv_", "default"),
    ("add", "Tensor"), ("add_", "Tensor"), ("sub", "Tensor"), ("sub_", "Tensor"),
    # with a Python number only (``h / 70000.0``): torch's kernel takes the number in
    # float32, torch_xla rounded it to the half type first (70000 is inf in float16,
    # so the quotient came out 0 for torch's 1.4e-05)
    ("mul", "Tensor"), ("div", "Tensor"),
    # torch's kernels accumulate these in float32 (bfloat16 cumprod was 6 ulps off,
    # adaptive average pooling and linear interpolation 2-6)
    ("cumprod", "default"), ("_adaptive_avg_pool2d", "default"),
    ("_adaptive_avg_pool3d", "default"), ("upsample_linear1d", "default"),
    ("upsample_bilinear2d", "default"), ("upsample_bicubic2d", "default"),
    ("upsample_trilinear3d", "default"),
    ("addmm", "default"), ("baddbmm", "default"),
    ("gelu", "default"), ("gelu_backward", "default"),
    ("silu", "default"), ("silu_", "default"), ("silu_backward", "default"),
    ("mish", "default"), ("mish_backward", "default"),
    ("softplus", "default"), ("softplus_backward", "default"),
    ("elu", "default"), ("elu_backward", "default"),
    ("hardswish", "default"), ("hardswish_backward", "default"),
    ("hardsigmoid", "default"), ("hardsigmoid_backward", "default"),
    ("leaky_relu", "default"), ("leaky_relu_backward", "default"),
    ("log_sigmoid_forward", "default"), ("log_sigmoid_backward", "default"),
    ("sigmoid_backward", "default"), ("tanh_backward", "default"),
    ("_softmax", "default"),
    ("_softmax_backward_data", "default"), ("_log_softmax_backward_data", "default"),
    ("logaddexp", "default"), ("hypot", "default"),
    ("linalg_vector_norm", "default"), ("var", "correction"),
    ("var_mean", "correction"), ("std", "correction"), ("std_mean", "correction"),
    ("celu", "default"),
    # not torch's arithmetic: its kernel sums a half-precision loss in the half type, in
    # blocks of 16 rows, which a formula cannot follow row by row; float32 is closer to
    # the exact loss (torch's and XLA's sums both round at every row)
    ("nll_loss_forward", "default"), ("nll_loss_backward", "default"),
    ("nll_loss2d_forward", "default"), ("nll_loss2d_backward", "default"),
    # torch_xla's kernels of these reduce in the half type, where torch's accumulate in
    # float32 (stop 38): a bfloat16 mse_loss over 2**19 elements came out 0.01 for 2.0
    # (the sum stops growing), in float16 an infinity; avg_pool2d over 8x8 windows,
    # index_add and scatter_add with 256 sources per row were 6-12x further from the
    # exact result than torch
    ("mse_loss", "default"),
    ("smooth_l1_loss", "default"),
    ("binary_cross_entropy", "default"),
    ("binary_cross_entropy_with_logits", "default"),
    ("avg_pool2d", "default"),
    ("avg_pool3d", "default"),
    ("index_add", "default"), ("index_add_", "default"),
    ("scatter_add", "default"), ("scatter_add_", "default"),
)


#: float16 matrix products and convolutions: torch's CPU kernels accumulate them in
#: float32, XLA's CPU kernels (Eigen's) in float16, 13x further from the exact product
#: on a 576-long dot (bfloat16 ones XLA already widens). On float32 copies they are
#: torch's up to the order of the sums; a GPU or TPU compiler folds the widening into
#: a mixed-precision dot (float16 operands, float32 accumulation), as its own are.
F16_OPS = (
    ("mm", "default"), ("bmm", "default"), ("mv", "default"), ("dot", "default"),
    ("convolution", "default"), ("convolution_backward", "default"),
)


def half_type(args) -> Optional[torch.dtype]:
    """The half type the op computes in, or None: that of its tensors with dimensions
    (a 0-dim float32 operand of a bfloat16 tensor takes its type, as in torch), all
    one half type."""
    floats = [t for t in pytree.tree_leaves(args)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    kinds = {t.dtype for t in ([t for t in floats if t.dim() > 0] or floats)}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in HALF else None


def rounded(out, half: torch.dtype):
    """``out`` (a tensor or a tree of them) with its float32 tensors rounded to ``half``:
    the one rounding of a result computed in float32."""
    return pytree.tree_map(lambda t: t.to(half) if isinstance(t, torch.Tensor) and
                           t.dtype == torch.float32 else t, out)


def _skip(name: str, args, kwargs) -> bool:
    """Calls the rule does not cover: ``add``/``sub`` without a scale (one rounding
    already), a softmax asked for float32 output, a reduction given its dtype."""
    if name.rstrip("_") in ("add", "sub"):
        return kwargs.get("alpha", 1) == 1
    if name in ("mul", "div"):
        return not any(isinstance(a, (int, float)) and not isinstance(a, bool)
                       for a in args)
    if name in ("_softmax", "_log_softmax"):
        return bool(args[2]) if len(args) > 2 else False
    if name.rstrip("_") == "index_add":     # torch adds into a vector in its own type
        return args[0].dim() <= 1
    return kwargs.get("dtype") is not None


def _in_float(name: str, functional, before: Optional[Callable],
              kinds: tuple = HALF) -> Callable:
    inplace = name.endswith("_")

    def run(*args, **kwargs):
        half = half_type((args, kwargs))
        if half not in kinds or _skip(name, args, kwargs):
            return NotImplemented if before is None else before(*args, **kwargs)

        def up(v):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return v.to(half).float()            # operands in the common type first
            return torch.float32 if isinstance(v, torch.dtype) and v == half else v
        args_f, kwargs_f = pytree.tree_map(up, (args, kwargs))
        if name.rstrip("_") in ("add", "sub"):             # torch's kernel takes alpha
            kwargs_f["alpha"] = float(torch.tensor(kwargs["alpha"], dtype=half))  # in the type
        out = rounded(functional(*args_f, **kwargs_f), half)
        return args[0].copy_(out) if inplace else out
    return run


def _call(before: Optional[Callable], *args, **kwargs):
    return NotImplemented if before is None else before(*args, **kwargs)


def _log_softmax(before: Optional[Callable]) -> Callable:
    """torch's log-softmax of half-precision tensors: along the last dimension (or one
    with nothing after it) its kernel rounds the sum of exponentials and its log to the
    half type before the difference (every element equal on 64x64 bfloat16 and float16,
    against 8% off in float32 throughout); along another dimension, float32."""
    def run(x, dim, half_to_float):
        if x.dtype not in HALF or half_to_float or x.dim() == 0:
            return _call(before, x, dim, half_to_float)
        f = x.float()
        if any(n != 1 for n in x.shape[dim % x.dim() + 1:]):
            return torch.ops.aten._log_softmax.default(f, dim, False).to(x.dtype)
        m = f.amax(dim, keepdim=True)
        total = (f - m).exp().sum(dim, keepdim=True).to(x.dtype).float()
        return (f - m - total.log().to(x.dtype).float()).to(x.dtype)
    return run


def _logsumexp(before: Optional[Callable]) -> Callable:
    """torch.logsumexp of half-precision tensors is not one kernel in torch but ops on
    the half type (the maximum, ``exp`` of the difference, the sum, ``log``, adding the
    maximum back), each rounded: the same ops here, not XLA's fused one."""
    def run(x, dim, keepdim=False):
        if x.dtype not in HALF or x.numel() == 0:
            return _call(before, x, dim, keepdim)
        dims = [d % max(x.dim(), 1) for d in dim] or list(range(x.dim()))
        m = torch.amax(x, dims, keepdim=True)
        m = torch.where(m.abs() == float("inf"), torch.zeros_like(m), m)
        out = (x - m).exp().sum(dims, keepdim=keepdim).log()
        return out + (m if keepdim else m.squeeze(dims))
    return run


#: ops whose half-precision arithmetic in torch is not "float32, rounded once"
SPECIAL = {("_log_softmax", "default"): _log_softmax, ("logsumexp", "default"): _logsumexp}


def wrap(table: Dict[object, Callable]) -> Dict[object, Callable]:
    """``table`` with each op of ``OPS`` (that this torch has) computed in float32 for
    half-precision tensors; other calls go to the entry it had, or to XLA's kernel."""
    aten = torch.ops.aten
    out = dict(table)
    for (name, overload), kinds in ([(o, HALF) for o in OPS]
                                    + [(o, (torch.float16,)) for o in F16_OPS]):
        packet = getattr(aten, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        functional = getattr(getattr(aten, name.rstrip("_"), None), overload, None)
        if op is None or functional is None:
            continue
        out[op] = _in_float(name, functional, table.get(op), kinds)
    for (name, overload), formula in SPECIAL.items():
        op = getattr(getattr(aten, name, None), overload, None)
        if op is not None:
            out[op] = formula(table.get(op))
    return out
