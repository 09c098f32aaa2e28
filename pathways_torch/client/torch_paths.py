"""torch's CPU-only paths, replaced while a program is traced by what they compute.

Programs are traced on fake CPU tensors, so torch's modules take the paths they take on
a CPU, some of which XLA cannot lower:

- **oneDNN.** ``nn.LSTM`` and ``nn.GRU`` call ``mkldnn_rnn_layer`` on CPU tensors.
  Without oneDNN they are cells of matmuls, the same numbers.
- **The native attention fast path.** In eval mode without gradients,
  ``nn.TransformerEncoder`` turns a padding mask into nested tensors (and
  ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call fused kernels).
  With the fast path off every layer computes the same numbers, except one thing the
  nested tensors change: the encoder's outputs at padded positions are zeros when
  torch takes that path (a data-dependent choice: only when every row's padding is at
  its end). ``_encoder_forward`` computes exactly that with ``torch.where``.
- **Sparse gradients.** ``nn.Embedding(sparse=True)`` (and ``embedding_bag``) make
  sparse gradients, which XLA has no tensors for. They are traced dense: the same
  numbers with every optimizer that accepts sparse ones (SGD, Adagrad).
- **Autocast on the device.** A call under ``torch.autocast("xla")`` (or "cuda", the
  device a user's script was written for) is traced under CPU autocast with the same
  dtype: the fake tensors are CPU tensors, which only a CPU autocast would cast.
  ``autocast_state()`` is part of a program's cache key, so the same program called
  with and without autocast is two programs, as in torch.
- **torch.compile.** A compiled module or function inside a program would run dynamo
  inside the trace; XLA compiles the whole program, so they run as the code they wrap
  (``torch.compiler.set_stance("force_eager")``).
- **Functions whose backward XLA lacks.** ``F.grid_sample``, ``torch.cdist``,
  ``linalg.solve``/``det``/``slogdet``, ``matrix_exp``, the margin losses, ...: a
  ``TorchFunctionMode`` runs their formulas (``lowerings.above_autograd()``) in their
  place, so autograd differentiates ops XLA has.
- **torch.distributions' argument checks** read values (``validate_args`` is on by
  default): off by default while tracing; the numbers are the same.
- **Anomaly detection's NaN check** (``torch.autograd.set_detect_anomaly(True)``)
  reads every gradient's values in the backward: while tracing, anomaly mode stays on
  without it (``check_nan=False``), and a warning says so once. A NaN then shows in the
  loss, or in ``Trainer.grad_norm``.
- **BatchNorm's cumulative average** (``momentum=None``; ``SyncBatchNorm`` too, which
  in a client without torch.distributed is a BatchNorm) divides by
  ``float(num_batches_tracked)``, a read: the running statistics are updated by the
  same formula with the count as a tensor (``_cumulative_batch_norm``).
- **Reentrant activation checkpointing** (``checkpoint(..., use_reentrant=True)``,
  torch's default when the argument is left out) recomputes inside a backward that
  refuses ``torch.autograd.grad``, which the step uses. It runs as the non-reentrant
  form, which computes the same gradients (and which remat.py makes save memory);
  as in torch, a block none of whose inputs requires grad gives its parameters no
  gradient.

The switches are process-wide while a trace runs (traces are serialized by capture's
lock); another thread's torch code during a trace would take the same paths, with the
same numbers.

Example::

    with torch_paths.traceable():
        joint = make_fx(fn, tracing_mode="fake")(*fakes)
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from . import lowerings


_AUTOCAST_DEVICES = ("cpu", "xla", "cuda")


def autocast_state() -> tuple:
    """The enabled ``torch.autocast`` contexts of this thread, as (device, dtype)
    pairs: () when none is, the common case."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(d))


def _causal_hint_only(mask=None, is_causal=None, size=None) -> bool:
    """``nn.Transformer*``'s guess whether a mask is causal, without reading it: torch
    compares the mask's values with a causal one when no ``is_causal`` hint is given
    (``bool((mask == causal).all())``: a value read, which a trace cannot make), only
    to pick a faster kernel. Without the hint the mask itself is applied: the same
    numbers."""
    return is_causal is True


@contextlib.contextmanager
def traceable() -> Iterator[None]:
    """Within the block, torch's modules take paths that XLA lowers, with torch's
    CPU numbers (see the module's docstring)."""
    import torch.compiler as tc
    encoder = torch.nn.TransformerEncoder
    original = encoder.forward
    transformer = torch.nn.modules.transformer
    detect = transformer._detect_is_causal_mask
    fastpath = torch.backends.mha.get_fastpath_enabled()
    mkldnn = torch._C._get_mkldnn_enabled()

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal=None):
        return _encoder_forward(original, fastpath, self, src, mask, src_key_padding_mask,
                                is_causal)

    embedding, embedding_bag = F.embedding, F.embedding_bag
    def dense_embedding(*args, **kwargs):
        return embedding(*_not_sparse(embedding, args, kwargs))

    def dense_embedding_bag(*args, **kwargs):
        return embedding_bag(*_not_sparse(embedding_bag, args, kwargs))

    device_autocast = [dt for d, dt in autocast_state() if d != "cpu"]
    cpu_autocast = (torch.autocast("cpu", dtype=device_autocast[0])
                    if device_autocast and not torch.is_autocast_enabled("cpu")
                    else contextlib.nullcontext())
    from torch.distributions import Distribution
    import torch.utils.checkpoint as ckpt
    validate = Distribution._validate_args
    reentrant = vars(ckpt.CheckpointFunction).get("apply")     # None: autograd.Function's
    formulas = lowerings.above_autograd()
    norms = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.SyncBatchNorm)
    norm_forwards = [vars(cls)["forward"] for cls in norms]
    anomaly = contextlib.nullcontext()
    if torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled():
        _warn_anomaly()
        anomaly = torch.autograd.set_detect_anomaly(True, check_nan=False)
    # F.embedding_bag's torch-function dispatch names the module's global, which is
    # dense_embedding_bag while this block runs
    formulas[dense_embedding_bag] = formulas[embedding_bag]
    with tc.set_stance("force_eager"), cpu_autocast, _Formulas(formulas), anomaly:
        Distribution.set_default_validate_args(False)
        for cls, norm_forward in zip(norms, norm_forwards):
            cls.forward = _cumulative_batch_norm(norm_forward)
        ckpt.CheckpointFunction.apply = staticmethod(_non_reentrant)
        torch._C._set_mkldnn_enabled(False)
        torch.backends.mha.set_fastpath_enabled(False)
        encoder.forward = forward
        transformer._detect_is_causal_mask = _causal_hint_only
        F.embedding, F.embedding_bag = dense_embedding, dense_embedding_bag
        try:
            yield
        finally:
            F.embedding, F.embedding_bag = embedding, embedding_bag
            transformer._detect_is_causal_mask = detect
            for cls, norm_forward in zip(norms, norm_forwards):
                cls.forward = norm_forward
            encoder.forward = original
            torch.backends.mha.set_fastpath_enabled(fastpath)
            torch._C._set_mkldnn_enabled(mkldnn)
            Distribution.set_default_validate_args(validate)
            if reentrant is None:
                del ckpt.CheckpointFunction.apply
            else:
                ckpt.CheckpointFunction.apply = reentrant


_ANOMALY_WARNED = False


def _warn_anomaly() -> None:
    global _ANOMALY_WARNED
    if not _ANOMALY_WARNED:
        _ANOMALY_WARNED = True
        from ..errors import warn_at_caller
        warn_at_caller(
            "torch.autograd.set_detect_anomaly(True) checks every gradient for NaN by "
            "reading its values, which a traced program cannot do: pathways_torch "
            "programs run with check_nan=False. Watch the loss (or Trainer.grad_norm "
            "with max_grad_norm=float('inf')) for nan instead", UserWarning)


def _cumulative_batch_norm(forward):
    """``_BatchNorm.forward`` whose cumulative moving average (``momentum=None``, in
    training with running statistics) takes its factor ``1 / num_batches_tracked`` as
    a tensor: torch's reads the count with ``float()``. The output is the batch's
    normalization, as there; the statistics get torch's update (the variance
    unbiased)."""
    def cumulative(self, input):
        if not (self.momentum is None and self.training and self.track_running_stats
                and self.num_batches_tracked is not None):
            return forward(self, input)
        self._check_input_dim(input)
        self.num_batches_tracked.add_(1)
        out = F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)
        with torch.no_grad():
            dims = [d for d in range(input.dim()) if d != 1]
            x = input.detach().to(self.running_mean.dtype)
            f = 1.0 / self.num_batches_tracked.to(x.dtype)
            self.running_mean.mul_(1 - f).add_(x.mean(dims) * f)
            self.running_var.mul_(1 - f).add_(x.var(dims, correction=1) * f)
        return out
    return cumulative


def _non_reentrant(function, preserve_rng_state, *args):
    """``CheckpointFunction.apply`` (the reentrant checkpoint) as the non-reentrant
    one. The reentrant form's outputs require grad only if an input does: without one,
    the block runs without gradients, as there."""
    import torch.utils.checkpoint as ckpt
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        with torch.no_grad():
            return function(*args)
    gen = ckpt._checkpoint_without_reentrant_generator(function, preserve_rng_state,
                                                       ckpt.noop_context_fn, "default",
                                                       False, True, *args)
    next(gen)
    out = function(*args)
    with contextlib.suppress(StopIteration):
        next(gen)
    return out


class _Formulas(torch.overrides.TorchFunctionMode):
    """Calls to the public functions of ``table`` run its formula instead (lowerings.py:
    ops whose backward XLA lacks, differentiated by autograd from the formula)."""

    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        formula = self.table.get(func)
        if formula is not None:
            out = formula(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def _not_sparse(fn, args, kwargs):
    """``args`` of ``fn`` (F.embedding or F.embedding_bag) with ``sparse=False``, all
    given by position."""
    import inspect
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.arguments["sparse"] = False
    bound.apply_defaults()
    return list(bound.arguments.values())


def _encoder_forward(original, fastpath: bool, self, src, mask, src_key_padding_mask,
                     is_causal):
    """``nn.TransformerEncoder.forward`` as on a CPU: the layers without the fast path,
    then zeros at the padded positions where torch's nested-tensor path would put them,
    then the final norm."""
    zero = _nested_zeros(self, fastpath, src, mask, src_key_padding_mask)
    if zero is None:
        return original(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                        is_causal=is_causal)
    norm, self.norm = self.norm, None
    try:
        out = original(self, src, mask=mask, src_key_padding_mask=src_key_padding_mask,
                       is_causal=is_causal)
    finally:
        self.norm = norm
    out = torch.where(zero.unsqueeze(-1), torch.zeros((), dtype=out.dtype), out)
    return norm(out) if norm is not None else out


def _nested_zeros(self, fastpath: bool, src, mask, src_key_padding_mask
                  ) -> Optional[torch.Tensor]:
    """Where torch's nested-tensor path would leave zeros in the encoder's output (a
    bool [batch, seq] tensor), or None when torch would not take that path whatever the
    values. The static conditions are torch's (``TransformerEncoder.forward``); the one
    on values, that each row's padding is at its end, goes into the tensor."""
    first = self.layers[0]
    if (not fastpath or not getattr(self, "use_nested_tensor", False) or first.training
            or src.dim() != 3 or src_key_padding_mask is None or mask is not None
            or torch.is_autocast_enabled()):
        return None
    weights = (first.self_attn.in_proj_weight, first.self_attn.in_proj_bias,
               first.self_attn.out_proj.weight, first.self_attn.out_proj.bias,
               first.norm1.weight, first.norm1.bias, first.norm2.weight, first.norm2.bias,
               first.linear1.weight, first.linear1.bias, first.linear2.weight,
               first.linear2.bias)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (src, *weights)):
        return None
    pad = F._canonical_mask(mask=src_key_padding_mask, mask_name="src_key_padding_mask",
                            other_type=None, other_name="", target_type=src.dtype)
    keep = pad == 0           # [batch, seq]; a bool mask: True pads, a float one: -inf
    if getattr(self, "mask_check", True):
        aligned = (keep[:, 1:] <= keep[:, :-1]).all()  # no kept position after a padded one
    else:
        aligned = torch.ones((), dtype=torch.bool)
    return keep.logical_not() & aligned     # use_nested_tensor implies batch_first
