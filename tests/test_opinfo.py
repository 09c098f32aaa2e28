"""torch's own operator samples, through ``pw.program``, against plain torch.

torch describes each of its operators with sample inputs (the OpInfo database of
``torch.testing``, which torch's own test suite and torch_xla's run). Every float32 op
here runs its first 4 samples in a program on a one-device slice and in plain torch
on the CPU, value and gradient (the outputs weighted by a fixed pattern, summed and
differentiated with respect to every floating input). Each must either give torch's
numbers, within 1e-3 of ``1 + |torch's|`` (float32 kernels that round differently,
transcendental approximations), or be refused with a typed ``pw.PathwaysError`` (a
shape that depends on data, an op XLA cannot run). A different number is never
acceptable.

The first run (stop 33) found ops that gave other numbers: ``x.amax()``, ``x.sum(())``
and ``aminmax`` did not reduce; an ``as_strided`` (every ``unfold``) of a slice or a
transpose read the wrong elements; ELU/SELU/CELU gradients were off by the input; CTC on
raw scores; bilinear interpolation; and ops refused although a formula exists (average
pooling with ``ceil_mode``, adaptive and dilated pooling, ``cov``, ``pdist``, ``sgn``).
``SKIP`` and ``SKIP_CASES`` list what is left out and why.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import pathways_torch as pw

TOL = 1e-3
# The first 4 samples of each op (stop 36; the first alone before). A sweep of the
# first 12 found what the first sample hid: adaptive max pooling's int32 indices,
# clamp_min with a broadcast bound, embedding_bag's padding_idx=-1, and a client killed
# by nll_loss of one example (cases of test_lowerings.py now). 4 samples cost 139 s
# against 50 here; the samples past the 4th that still differ are listed in
# docs/architecture.md (0-dim inputs of topk/kthvalue/gather, pdist with p=0).
SAMPLES = 4

# Left out: random ops (no two runs agree); complex, sparse and FFT ops (no XLA tensors
# for them here); ops whose output shape depends on data by definition, or is a Python
# value; factories without inputs; linear algebra (test_lowerings.py checks the
# formulas that replace it).
SKIP_PREFIXES = ("masked.", "fft.", "linalg.", "sparse.", "_refs.", "jiterator_",
                 "signal.windows.")
SKIP = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial",
    "normal", "uniform", "rand_like", "randint", "randint_like", "randn", "randn_like",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.rrelu",
    "empty", "empty_like", "empty_permuted", "empty_strided", "new_empty",
    "new_empty_strided", "complex", "polar", "view_as_complex", "view_as_real", "chalf",
    "cfloat", "cdouble", "stft", "istft", "to_sparse", "item", "tolist", "equal",
    "allclose", "nonzero", "nonzero_static", "unique", "unique_consecutive", "histogram",
    "histogramdd", "bincount", "resize_", "resize_as_",
    "cholesky", "cholesky_inverse", "cholesky_solve", "geqrf", "ormqr", "lu", "lu_solve",
    "lu_unpack", "svd", "svd_lowrank", "pca_lowrank", "pinverse", "qr",
    "triangular_solve", "matrix_exp", "logdet", "det",
}
# Individual cases, with the reason each is out.
SKIP_CASES = {
    # random: training=True with dropout_p > 0 in these samples
    ("nn.functional.scaled_dot_product_attention", ""): "dropout in its samples",
    ("nn.functional.multi_head_attention_forward", ""): "dropout in its samples",
    # p = 0 counts differences: torch's output requires grad (a zero gradient), the
    # formula's does not, so the harness's gradient list differs in length
    ("cdist", ""): "p = 0 has no gradient to compare",
    # 50 frames unrolled: 27 s of compiles; test_lowerings.py checks the formula
    ("nn.functional.ctc_loss", ""): "checked in test_lowerings.py",
    # its inputs are views into larger tensors, read through their storage; a program's
    # input is the view's values (pw.put sends those)
    ("as_strided", "partial_views"): "inputs whose storage is larger than they are",
}


def _ops():
    out = []
    for op in op_db:
        if op.name in SKIP or op.name.startswith(SKIP_PREFIXES) or \
                (op.name, op.variant_test_name) in SKIP_CASES:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        out.append(op)
    return out


OPS = _ops()


@pytest.fixture(scope="module")
def s1(cluster8):
    s = pw.slice((1,))
    yield s
    s.release()


def _weights(shape) -> torch.Tensor:
    n = max(1, math.prod(shape))
    return (torch.arange(n, dtype=torch.float64).mul(0.37).sin().float() + 0.5).reshape(shape)


def _value_and_grad(op, leaves, spec, positions):
    def run(*tensors):
        tensors = [t.detach().requires_grad_() if t.is_floating_point()
                   and op.supports_autograd else t.detach() for t in tensors]
        values = list(leaves)
        for j, t in zip(positions, tensors):
            values[j] = t
        inp, args, kwargs = pytree.tree_unflatten(values, spec)
        with torch.enable_grad():
            outs = [v for v in pytree.tree_leaves(op(inp, *args, **kwargs))
                    if isinstance(v, torch.Tensor)]
            diffs = [t for t in tensors if t.requires_grad]
            loss = sum(((v.float() * _weights(v.shape).to(v.device)).sum()
                        for v in outs if v.is_floating_point() and v.requires_grad),
                       torch.zeros((), device=tensors[0].device))
            grads = (torch.autograd.grad(loss, diffs, allow_unused=True)
                     if diffs and loss.requires_grad else [])
        grads = [torch.zeros_like(d) if g is None else g for d, g in zip(diffs, grads)]
        return [v.detach() for v in outs] + list(grads)
    return run


def _worst(got, want) -> float:
    """The largest |got - want| / (1 + |want|) over every output; inf where shapes,
    dtypes, NaNs or integer values differ."""
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return math.inf
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return math.inf
            continue
        if (g.isnan() != w.isnan()).any():
            return math.inf
        d = ((g.double() - w.double()).abs() / (1 + w.double().abs())).nan_to_num(0.0)
        if d.numel():
            worst = max(worst, d.max().item())
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.name}.{op.variant_test_name}"
                         .rstrip("."))
def test_torch_operator_samples_give_torch_numbers_or_a_typed_refusal(s1, op):
    try:
        samples = list(itertools.islice(op.sample_inputs(
            "cpu", torch.float32, requires_grad=op.supports_autograd), SAMPLES))
    except Exception as e:                    # pragma: no cover - torch's own samples
        pytest.skip(f"torch cannot build its samples here: {e}")
    checked = 0
    for i, sample in enumerate(samples):
        leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        positions = [j for j, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        if not positions or any(leaves[j].is_complex() for j in positions):
            continue
        run = _value_and_grad(op, leaves, spec, positions)
        try:
            want = run(*[leaves[j] for j in positions])
        except Exception:
            continue                          # torch itself refuses this sample
        try:
            arrays = pw.program(run)(*[pw.put(leaves[j].detach(), s1) for j in positions])
            got = [a.torch() for a in arrays]
        except pw.PathwaysError:
            continue                          # refused with a typed error: allowed
        worst = _worst(got, want)
        assert worst <= TOL, (f"{op.name} sample {i}: {worst:.3g} from torch "
                              f"(inputs {[tuple(leaves[j].shape) for j in positions]})")
        checked += 1
    if not checked:
        pytest.skip("no sample torch and a program both compute")
