"""Capture: trace a torch function into a portable XLA program.

Two steps, so that capture never depends on what the process did before:

1. **The graph.** ``make_fx`` runs the function once per input signature on fake CPU
   tensors (shape and dtype, no memory: tracing a program over a 100 GB input costs
   nothing) and records the ATen ops it reaches, *below* autograd: a function that
   calls ``torch.autograd.grad`` yields its joint forward-backward graph, and the
   autograd engine never sees an XLA tensor (it sizes its per-device queues once per
   process, so a CPU ``backward()`` earlier would otherwise break every later trace).
   A second pass functionalizes the graph: views become copies and in-place updates of
   the function's inputs become extra outputs (``Traced.mutations``), which the
   caller writes back to the input Arrays. While the user's code runs,
   ``torch.compiler.is_compiling()`` is true, as under ``torch.compile``/``torch.export``,
   so libraries take their trace-friendly paths (Hugging Face attention masks), and
   ``scaled_dot_product_attention`` takes its math path (what XLA runs). Ops that
   torch_xla does not lower are decomposed into ones it does (torch's own
   decompositions, and the static-shape formulas of lowerings.py).
2. **The program.** The graph is replayed on torch_xla placeholder tensors (factory
   ops' CPU devices remapped to the XLA device) and the lazy IR of its outputs is
   lowered to an HLO module (``_get_xla_tensors_hlo_proto``), which is what travels to
   the workers. Output shapes and dtypes are known before anything runs.

Nothing reads a placeholder's value: a read (``.item()``, ``if t:``, a data-dependent
shape) raises ``DataDependentError`` in the fake run, and an op that torch_xla would run
on the CPU (``torch.histc``) is refused by name before the replay.

The HLO's parameters follow the graph's device-data order, not the argument order:
each parameter is mapped back to a program input (by tensor id), to a constant the
function created (a Python scalar, a tensor literal), whose value ships with the
program, or to the RNG seed (``Traced.rng``): torch_xla draws every random number of a
graph from one seed leaf, which becomes a trailing int64 input so that each call draws
fresh values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils import _pytree as pytree

from .._xla import cpu_fallbacks
from ..errors import (DataDependentError, PathwaysError, ShapeError, TraceError,
                      warn_at_caller)
from . import hostrng, lowerings, opmath, remat, torch_paths

_lock = threading.RLock()

#: Functions of the CPU tensors a trace read from outside its arguments that bring
#: them up to date and return a function doing so again before each later call, or
#: None when they have nothing to do with them. training/reads.py registers one: the
#: module a pw.Trainer trains is behind its workers until synced, and a program that
#: calls it must see the trained values, as a torch loop would.
KEEPERS: List[Callable[[List[torch.Tensor]], Optional[Callable[[], None]]]] = []
_device = None
#: The RNG seed set before each replay: the one int64 scalar leaf holding it is the
#: graph's seed (torch_xla derives every further random op's seed from it in the IR).
_SEED_SENTINEL = 0x1D2C3B4A59687766
_REPORT = ("this is a bug in pathways_torch, not in your code: please report it with "
           "the traceback")


def xla_device():
    """The client's local XLA device, used only for tracing (created once)."""
    global _device
    if _device is None:
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        from .._xla import import_torch_xla
        torch_xla = import_torch_xla()
        _device = torch_xla.device()
    return _device


class _TensorLeaf:
    def __repr__(self) -> str:
        return "TENSOR"


#: Marks the flat output leaves that are tensors (``Traced.out_static``).
TENSOR = _TensorLeaf()


@dataclasses.dataclass
class Traced:
    name: str
    hlo: bytes
    params: List[Tuple[str, int]]        # ("i", input index) or ("c", constant index)
    constants: List[torch.Tensor]        # CPU tensors
    out_avals: List[Tuple[Tuple[int, ...], torch.dtype]]
    out_tree: Any                        # pytree spec of the function's outputs
    out_static: List[Any]                # per flat output leaf: TENSOR, else the value
    fingerprint: str
    #: (input index, output index): the input was updated in place; the output (after
    #: the function's own tensor outputs) holds its new value.
    mutations: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    #: The program draws random numbers: it takes one more input, an int64 seed.
    rng: bool = False
    #: Trailing outputs that only keep an input in the program (the caller drops them).
    extra: int = 0
    #: The CPU tensors the function read from outside its arguments (a global, a
    #: closure), with their version counters at the trace: changed in place since,
    #: the program is stale (``stale``).
    sources: List[Tuple[torch.Tensor, int]] = dataclasses.field(default_factory=list)
    #: Brings the sources up to date before each check (``KEEPERS``), or None.
    keep: Optional[Callable[[], None]] = None
    #: ``value_print`` of each source at the trace.
    prints: List[int] = dataclasses.field(default_factory=list)

    def stale(self) -> bool:
        """A tensor the function read from outside its arguments changed in place:
        its version counter moved, or its values (a write through ``.data`` or a numpy
        view, which the counter misses: a target network's Polyak update
        ``tp.data.mul_(1 - tau).add_(tau * p.data)``)."""
        if not self.sources:            # the common case, on every call
            return False
        if self.keep is not None:
            self.keep()
        return any(t._version != v for t, v in self.sources) or any(
            value_print(t) != p for (t, _), p in zip(self.sources, self.prints))

    def __post_init__(self) -> None:
        # what each call looks up (derived once: calls are the dispatch hot path)
        self.mutated_inputs = frozenset(k for k, _ in self.mutations)
        self.written_by = {o: k for k, o in self.mutations}     # output -> input
        self.kept_outputs = len(self.out_avals) - self.extra


_PRINT_WHOLE = 4096          # elements: larger tensors are fingerprinted by a sample
_PRINT_SAMPLE = 256


def _refuse_old_fakes(outside: List[torch.Tensor], name: str) -> None:
    """A tensor a program read from outside that an earlier trace made: a cache in
    Python state filled inside the function (``CACHE[shape] = torch.linspace(...)``,
    PWC-Net's base grid) kept it. It holds no numbers; reading them failed with
    ".numpy() is not supported for tensor subclasses", and so does a CPU forward."""
    from torch._subclasses.fake_tensor import FakeTensor
    if any(isinstance(t, FakeTensor) for t in outside):
        shapes = [list(t.shape) for t in outside if isinstance(t, FakeTensor)][:3]
        raise TraceError(
            f"program '{name}' reads a tensor (shape {', '.join(map(str, shapes))}) that "
            "an earlier trace made and Python state kept: a cache filled inside the "
            "function (a dict or attribute keyed by shape). A traced function's tensors "
            "hold no numbers outside its trace, so the cache holds none either (a CPU "
            "forward fails on it too). Compute the tensor in every call (XLA folds a "
            "constant), or make it outside the program and keep it in a buffer "
            "(module.register_buffer); then clear the cache")


def value_print(t: torch.Tensor) -> int:
    """A CRC-32 of ``t``'s values: all of them up to ``_PRINT_WHOLE`` elements, else
    ``_PRINT_SAMPLE`` spread evenly over it (an update through ``.data`` that touches
    every element, as a Polyak average or a ``copy_`` does, shows in any sample). About
    6-10 µs a tensor, at each call of a program that reads it from outside."""
    flat = t.detach().reshape(-1)
    if flat.numel() > _PRINT_WHOLE:
        flat = flat[::flat.numel() // _PRINT_SAMPLE]
    flat = flat.contiguous()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    return zlib.crc32(flat.view(torch.uint8).numpy()) if flat.numel() else 0


def _data_dependent(name: str, what: str, where: str = "") -> DataDependentError:
    hint = ""
    if "layerdrop" in where.lower():
        hint = (" Hugging Face's LayerDrop decides in Python, on a random tensor, whether "
                "to run each layer: set the model's config.*layerdrop (encoder_layerdrop, "
                "decoder_layerdrop) to 0.0 for training here.")
    elif "one_hot(" in where and "num_classes" not in where:
        hint = " F.one_hot without num_classes reads the largest class: pass num_classes=."
    elif "bincount" in what or "bincount(" in where:
        hint = (" bincount's length is the largest value read (minlength= only raises "
                "it): count into a fixed number of bins with "
                "F.one_hot(idx, num_classes=n).sum(0), or torch.histc(idx.float(), "
                "bins=n, min=0, max=n - 1).")
    elif "istft(" in where:
        hint = (" torch.istft checks its window's overlap-add on values (NOLA) before "
                "inverting: invert the frames with torch.fft.irfft and add them back "
                "with F.fold (and divide by the window's squared overlap-add), or run "
                "istft on the client on the fetched spectrogram.")
    elif "_pack_padded_sequence" in what:
        hint = (" A PackedSequence is as long as the lengths add up to: give the RNN the "
                "padded batch, and take each sequence's last output with "
                "out.gather(1, (lengths - 1).view(-1, 1, 1).expand(-1, 1, out.shape[2])) "
                "(or mask the padding), which gives the same hidden state for a "
                "unidirectional RNN.")
    return DataDependentError(
        f"program '{name}' reads a tensor's value while being traced ({what})"
        f"{where}.{hint} Programs "
        "are traced once, on shapes and dtypes only, so their Python control flow and "
        "shapes cannot depend on data: use torch.where / masks, or move that logic "
        "outside the program and read the result with Array.torch()")


_LIBRARY = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))


def _user_line(e: BaseException) -> str:
    """', at file:line: code' of the innermost frame of ``e`` outside torch and
    pathways_torch (the user's line that made the read); when the read is in torch's
    own code with none of the user's around it (a module of torch.nn called by
    another), its innermost frame there; or ''."""
    import traceback
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "<" not in f.filename]
    user = [f for f in frames if not f.filename.startswith(_LIBRARY)]
    if user:
        f = user[-1]
        return f", at {os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()}"
    torch_dir = _LIBRARY[0]
    # torch's public modules (torch/nn/...), not its machinery (torch/_subclasses/...)
    theirs = [f for f in frames if f.filename.startswith(torch_dir) and not any(
        part.startswith("_") for part in os.path.relpath(f.filename, torch_dir).split(os.sep))]
    if not theirs:
        return ""
    f = theirs[-1]
    where = os.path.relpath(f.filename, os.path.dirname(torch_dir))
    return f", in torch's own code at {where}:{f.lineno}: {(f.line or '').strip()}"


_VALUE_READS = {
    "_local_scalar_dense": ".item(), bool(t), float(t) or `if t:`",
    "is_nonzero": "bool(t) or `if t:`",
    "equal": "torch.equal",
    "nonzero": "nonzero (a shape that depends on data)",
    "masked_select": "masked_select (a shape that depends on data)",
    "_unique2": "unique (a shape that depends on data)",
    "unique_consecutive": "unique_consecutive",
}

_SHAPE_WORDS = ("shape", "size", "dimension", "dtype", "expected", "got torch.",
                "must match", "broadcast", "mat1", "mat2", "same number",
                "cannot be multiplied", "scalar type")


_DECOMPS = None


@functools.lru_cache(maxsize=None)
def _lacks_kernel(op) -> bool:
    """Whether torch_xla certainly runs ``op`` on the CPU (its fallback reads the
    values): it has neither an XLA kernel nor a composite one, or its composite kernel
    computes through an ``out=`` variant of its own that XLA lacks (``median(dim)``
    calls ``median.dim_values``). Other fallbacks only running it shows
    (``_falls_back``)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    name = op.name()
    try:
        if has(name, "XLA") or has(name, "CompositeImplicitAutograd"):
            return False
        if not has(name, "CompositeExplicitAutograd"):
            return True
    except RuntimeError:            # an overload the dispatcher does not know
        return True
    packet = getattr(torch.ops.aten, op._schema.name.split("::")[-1], None)
    for overload in (packet.overloads() if packet is not None else ()):
        other = getattr(packet, overload)
        full = other._schema.name + (f".{other._schema.overload_name}"
                                     if other._schema.overload_name else "")
        try:
            if other._schema.is_mutable and not any(
                    has(full, k) for k in ("XLA", "CompositeExplicitAutograd",
                                           "CompositeImplicitAutograd")):
                return True
        except RuntimeError:
            continue
    return False


_FALLBACKS: Dict[tuple, List[str]] = {}
_PROBE_LIMIT = 1 << 26                 # elements: a probe past this would cost more than
                                       # the rare fallback it could find


def _falls_back(op, node, device) -> List[str]:
    """The ops torch_xla runs on the CPU when it runs ``op`` with the node's arguments,
    found by running it once on zeros of the node's shapes and reading torch_xla's
    fallback counters. The dispatcher cannot tell: a composite kernel computes through
    others (``cummin`` through ``_cummin_helper``), and an XLA kernel falls back for
    some arguments (``scatter_reduce`` with ``"amax"``); on a placeholder that fallback
    aborts the process. Lazy ops do not run, so a probe costs a dispatch; cached per
    op, argument ranks and dtypes and the other arguments."""
    sizes, key = [], [op]

    def real(n):
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor) or not all(isinstance(d, int) for d in v.shape):
            raise LookupError(n)
        sizes.append(v.numel())
        key.append((v.dim(), v.dtype))
        return torch.zeros(tuple(v.shape), dtype=v.dtype, device=device)

    try:
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), real)
        key.append(repr(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: None)))
    except LookupError:
        return []                   # not a plain tensor op: the dispatcher's word stands
    key = tuple(key)
    if key in _FALLBACKS:
        return _FALLBACKS[key]
    if sum(sizes) > _PROBE_LIMIT:
        return []

    def run():
        # a random op draws a seed from torch's generator: the probe leaves it as it
        # was, or a program's first call would shift the draws after it (its later
        # calls, the script's own) from what torch.manual_seed set
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            op(*args, **kwargs)

    _FALLBACKS[key] = cpu_fallbacks(run)
    return _FALLBACKS[key]


def _decompositions() -> Dict:
    """Core ATen decompositions of the ops torch_xla has no kernel for (it would run
    them on the CPU): the graph then holds only ops that XLA lowers."""
    global _DECOMPS
    if _DECOMPS is None:
        from torch._decomp import core_aten_decompositions, decomposition_table
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        aten = torch.ops.aten
        # torch_xla's batch norm updates running_var with the biased batch variance
        # (torch: unbiased), and its ELU backward reads its last argument as the ELU's
        # output even when it is the input (is_result=False: F.elu, selu and celu's
        # gradients were off by the input's value); torch's decompositions do what
        # torch does
        wrong_on_xla = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                        aten._native_batch_norm_legit_functional.default,
                        aten._native_batch_norm_legit.no_stats, aten.elu_backward.default}
        _DECOMPS = {op: f for op, f in core_aten_decompositions().items()
                    if isinstance(op, torch._ops.OpOverload)
                    and (not has(op.name(), "XLA") or op in wrong_on_xla)}
        _DECOMPS.update({op: decomposition_table[op] for op in wrong_on_xla
                         if op in decomposition_table})
        # beyond the core set, torch's decompositions of the ops XLA lacks (Tensor.unfold,
        # bicubic upsampling, grid_sampler_2d, bucketize, ...): a formula of ops XLA has
        # beats a refusal
        _DECOMPS.update({op: f for op, f in decomposition_table.items()
                         if isinstance(op, torch._ops.OpOverload) and op not in _DECOMPS
                         and _lacks_kernel(op)})
    return _DECOMPS


@contextlib.contextmanager
def _compiling():
    """What user code sees while it is traced: ``torch.compiler.is_compiling()`` (so
    libraries avoid reading values), the math path of SDPA (XLA's own choice), and
    torch's modules on paths that XLA lowers (torch_paths.py)."""
    import torch.compiler as tc
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with torch_paths.traceable():
        old = tc._is_compiling_flag
        tc._is_compiling_flag = True
        try:
            with sdpa_kernel([SDPBackend.MATH]):
                yield
        finally:
            tc._is_compiling_flag = old


@contextlib.contextmanager
def _quiet(logger: str):
    """Fake tensors log every failing shape function; the error says it already."""
    log = logging.getLogger(logger)
    old = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)


def _sparse(name: str, where: str = "") -> TraceError:
    return TraceError(
        f"program '{name}' uses a sparse tensor{where}, which XLA does not compute: "
        "aggregate with dense ops instead (a graph's messages with index_add_ or "
        "scatter_add over an edge list, or a dense adjacency matrix)")


def _user_error(name: str, sig: str, e: BaseException) -> PathwaysError:
    """The PathwaysError for an exception raised while the user's function ran."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException,
                                               UnsupportedOperatorException)
    if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)):
        op = getattr(e, "func", None)
        short = getattr(op, "_opname", "") or str(op)
        return _data_dependent(name, _VALUE_READS.get(short, f"aten.{short}"), _user_line(e))
    if isinstance(e, UnsupportedOperatorException) and "c10d" in str(e.func):
        return TraceError(
            f"program '{name}' calls torch.distributed's {e.func}: a "
            "collective between processes, which a program cannot run (one client "
            "drives every device). A DistributedDataParallel wrapper broadcasts its "
            "buffers so (broadcast_buffers=True, its default): pass pw.Trainer the "
            "module itself (model.module), with parallelism=pw.DataParallel, which "
            "averages the gradients over the slice's devices as DDP does")
    if "two different devices" in str(e) and "xla" in str(e):
        return TraceError(
            f"program '{name}' makes a tensor on the XLA device{_user_line(e)} "
            "(device=xm.xla_device() or torch_xla.device(), or .to() of it): a "
            "program's tensors live on its slice, traced on the CPU. Make them like "
            "the inputs (device=x.device, torch.zeros_like(x)) or without device=")
    if isinstance(e, UnsupportedOperatorException):
        return TraceError(
            f"program '{name}' uses {e.func}, which has no shape function in torch, so it "
            "cannot be traced without running it; compute it outside the program")
    text = str(e)
    if ".numpy() is not supported for tensor subclasses" in text:
        return _data_dependent(name, "Tensor.numpy()", _user_line(e))
    if "format string passed to FakeTensor.__format__" in text:
        return _data_dependent(
            name, "a format string, f'{t:.3f}', which prints its value", _user_line(e))
    if "Could not run" in text and "Sparse" in text:
        return _sparse(name, _user_line(e))
    if isinstance(e, NotImplementedError) and "Generator" in text:
        return TraceError(
            f"program '{name}' draws random numbers with a torch.Generator of its own "
            f"(generator=){_user_line(e)}. A program's random ops draw from its seed, "
            "a new one each call (pw.init(seed=), or torch.manual_seed before the calls, "
            "repeats a run): remove generator=, or draw the numbers outside the program "
            "and pass them in to have the same ones every call")
    if "does not require grad and does not have a grad_fn" in text and \
            name.startswith(("evaluate_", "predict_")):
        return TraceError(
            f"program '{name}' differentiates in the forward{_user_line(e)} (a "
            "physics-informed loss's torch.autograd.grad of the outputs w.r.t. the "
            "inputs), and trainer.evaluate and trainer.predict run the model under "
            "torch.no_grad(), as an evaluation loop does: wrap that part of the forward "
            "in `with torch.enable_grad():` (a torch evaluation loop under no_grad needs "
            "the same)")
    if "INTERNAL ASSERT" in text:
        return TraceError(f"tracing program '{name}' with inputs ({sig}) hit an internal "
                          f"error in torch: {type(e).__name__}: {text}\n{_REPORT}")
    msg = f"tracing program '{name}' with inputs ({sig}) failed: {type(e).__name__}: {e}"
    if isinstance(e, (RuntimeError, ValueError, IndexError, TypeError)) and (
            _from_shape_check(e) or any(w in text.lower() for w in _SHAPE_WORDS)):
        return ShapeError(msg + "\nCheck the shapes and dtypes of the arguments.")
    return TraceError(msg)


_SHAPE_CHECKS = ("_meta_registrations.py", "_prims_common", "/_refs/", "/_decomp/",
                 "fake_impls.py")


def _from_shape_check(e: BaseException) -> bool:
    """Raised by an op's shape function (a meta kernel), which checks only shapes and
    dtypes of what the user's code passed it."""
    tb = e.__traceback__
    while tb is not None:
        if any(k in tb.tb_frame.f_code.co_filename for k in _SHAPE_CHECKS):
            return True
        tb = tb.tb_next
    return False


_tracing = threading.local()


def tracing_now() -> bool:
    """Whether this thread is inside a program's function, tracing it."""
    return getattr(_tracing, "depth", 0) > 0


def _graph(fn: Callable, name: str, sig: str, fakes: list, build_args,
           device) -> Tuple[Any, dict]:
    """The functional ATen graph of ``fn`` on ``fakes``; info: output tree and statics."""
    from torch.fx.experimental.proxy_tensor import make_fx
    info: dict = {}

    def flat_fn(*tensors):
        args, kwargs = build_args(list(tensors))
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _tracing.depth -= 1
        register_dataclasses(out)
        out = _open_objects(out)
        leaves, tree = pytree.tree_flatten(out)
        info["tree"] = tree
        info["statics"] = [TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return [x for x in leaves if isinstance(x, torch.Tensor)]

    table = opmath.wrap({**_decompositions(), **lowerings.table()})
    try:
        with _compiling(), _quiet("torch._subclasses.fake_tensor"), remat.tagging():
            joint = make_fx(flat_fn, tracing_mode="fake", decomposition_table=table,
                            _allow_non_fake_inputs=True)(*fakes)
    except PathwaysError:
        raise
    except Exception as e:
        raise _user_error(name, sig, e) from e
    _refuse_captured_writes(joint, name)
    remat.share_random(joint, name)
    remat.tie_regions(joint)
    # New fakes: the first trace set requires_grad on its copies of ``fakes``, and a
    # module that keeps references to them (nn.LSTM's _flat_weights) keeps them in the
    # fake mode's memo, which would hand them to this trace as leaves that require grad.
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = [torch.empty(f.shape, dtype=f.dtype) for f in fakes]
    try:
        gm = make_fx(torch.func.functionalize(joint, remove="mutations_and_views"),
                     tracing_mode="fake", decomposition_table=table,
                     _allow_non_fake_inputs=True)(*fakes)
    except Exception as e:
        if "Could not run" in str(e) and "Sparse" in str(e):
            raise _sparse(name) from e
        raise TraceError(f"functionalizing program '{name}' failed: {type(e).__name__}: "
                         f"{e}\n{_REPORT}") from e
    info["mutations"] = _lift_input_mutations(gm)
    if not info["mutations"] and not any(s is TENSOR for s in info["statics"]):
        raise TraceError(f"program '{name}' returns no tensor and updates none of its "
                         "inputs in place; return at least one tensor")
    return gm, info


def _refuse_captured_writes(gm, name: str) -> None:
    """Refuse a program that writes in place into a tensor it closes over instead of
    taking it as an argument (a module in train mode called inside it: BatchNorm's
    running statistics). torch would update that tensor at every call; a program's
    constants are fixed when it is traced, so its calls could not (the trace itself
    has run the write: the tensor holds it once or twice now). Before, a batch norm
    failed with a functionalization assert that blamed pathways_torch, and a
    ``counter.add_(1)`` ran silently, not counting."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for k, arg in enumerate(schema.arguments):
            value = node.args[k] if k < len(node.args) else node.kwargs.get(arg.name)
            if arg.alias_info is None or not arg.alias_info.is_write or \
                    not isinstance(value, torch.fx.Node):
                continue
            while value.op == "call_function" and remat.aliases_first(value):
                value = value.args[0]
            if value.op == "get_attr":
                op = node.target.name().replace("aten::", "torch.")
                renorm = (" An nn.Embedding with max_norm= renormalises the rows it "
                          "looks up in its weight, in place, at every forward (in eval "
                          "mode and under no_grad too): pass the weight as an argument "
                          "(F.embedding(ids, weight, max_norm=...)) or use a pw.Trainer's "
                          "predict()." if op == "torch.mul_.Tensor" else "")
                raise TraceError(
                    f"program '{name}' writes in place ({op}) into a tensor it does not "
                    "take as an argument, one its function closes over: a module's "
                    "buffer (BatchNorm's running statistics in train mode), a buffer of a "
                    "pw.Trainer's loss_fn module (a running count), or a global tensor. "
                    "Pass that tensor as an argument (a program updates its arguments in "
                    "place, as torch does); train the module with pw.Trainer, or call "
                    "model.eval() for inference; a loss_fn's buffer: register it on the "
                    "model, whose buffers each step updates in place." + renorm)


def register_dataclasses(value, depth: int = 0) -> None:
    """Dataclass outputs (a model's output type) and inputs become pytree nodes, so
    their tensors are outputs (inputs) of the program and the caller gets the same
    dataclass of Arrays."""
    if depth > 8:
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if cls not in pytree.SUPPORTED_NODES:
            try:
                pytree.register_dataclass(cls)
            except (TypeError, ValueError):
                return                     # not a plain dataclass: stays a static leaf
        children = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, (list, tuple)):
        children = list(value)
    elif isinstance(value, dict):
        children = list(value.values())
    else:
        return
    for c in children:
        register_dataclasses(c, depth + 1)


class _Opened:
    """An output object that is no pytree node but holds tensors in its attributes (a
    Hugging Face ``DynamicCache``, a user's class), as a pytree node: its attributes'
    tensors become outputs of the program, and the caller gets an object of the same
    class whose attributes hold the Arrays (built without calling its ``__init__``).
    Without it the object came back as a static, holding the trace's fake tensors."""

    __slots__ = ("cls", "names", "values")

    def __init__(self, cls: type, names: tuple, values: list) -> None:
        self.cls, self.names, self.values = cls, names, values


def _rebuild(values, context):
    cls, names = context
    obj = cls.__new__(cls)
    obj.__dict__.update(zip(names, values))
    return obj


pytree.register_pytree_node(_Opened, lambda o: (o.values, (o.cls, o.names)), _rebuild)


def _attributes(leaf) -> Optional[dict]:
    """The attributes of an object that may hold tensors (not a tensor, class or
    module), or None."""
    attrs = getattr(leaf, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(leaf, (torch.Tensor, type, torch.nn.Module)):
        return None
    return attrs


def _holds_tensors(value, depth: int = 0) -> bool:
    if depth > 8:
        return False
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            return True
        attrs = _attributes(leaf)
        if attrs is not None and _holds_tensors(list(attrs.values()), depth + 1):
            return True
    return False


def _open_objects(out, depth: int = 0):
    """``out`` with every leaf object that holds tensors in its attributes (at any
    depth, through lists, dicts and other such objects) made an ``_Opened`` node."""
    if depth > 8:
        return out
    opened = {}                     # id(leaf) -> its attributes, for the leaves that open
    for leaf in pytree.tree_leaves(out):
        attrs = _attributes(leaf)
        if attrs is not None and _holds_tensors(list(attrs.values())):
            opened[id(leaf)] = attrs
    if not opened:
        return out                  # rebuilt by tree_map only when something opens

    def open_one(leaf):
        attrs = opened.get(id(leaf))
        if attrs is None:
            return leaf
        names = tuple(attrs)
        return _Opened(type(leaf), names, [_open_objects(attrs[n], depth + 1) for n in names])
    return pytree.tree_map(open_one, out)


def _lift_input_mutations(gm) -> List[int]:
    """Turn the functional graph's trailing ``copy_(input, new)`` into extra outputs;
    returns the mutated inputs' indices in the order of those outputs."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    index = {n: k for k, n in enumerate(placeholders)}
    mutated, values = [], []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default \
                and node.args[0] in index:
            k = index[node.args[0]]
            if k in mutated:                       # updated twice: the last one wins
                values[mutated.index(k)] = node.args[1]
            else:
                mutated.append(k)
                values.append(node.args[1])
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
    if mutated:
        out = next(n for n in graph.nodes if n.op == "output")
        outs = list(out.args[0]) + values
        out.args = (outs,)
        graph.lint()
        gm.recompile()
    return mutated


def _check_ops(gm, name: str, device) -> None:
    """Refuse ops torch_xla would run on the CPU: on a placeholder that reads data
    that does not exist, and the process dies."""
    for node in gm.graph.nodes:
        op = node.target
        if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or \
                op is torch.ops.aten.lift_fresh_copy.default:
            continue
        short = op.name().replace("aten::", "torch.").replace("prims::", "torch.")
        if _lacks_kernel(op):
            raise _no_lowering(name, short)
        if op.overloadpacket in _same_dtype_ops():
            _check_same_dtype(node, name, short)
        inner = _falls_back(op, node, device)
        if inner:
            through = [i for i in inner if i != short]
            raise _no_lowering(name, short + (f" (through {', '.join(through)})"
                                              if through else ""))


def _no_lowering(name: str, short: str) -> DataDependentError:
    return DataDependentError(
        f"program '{name}' uses {short}, which has no XLA lowering: torch_xla would run "
        "it on the CPU, reading values that a trace does not have (programs are traced "
        "on shapes and dtypes only). Compute it outside the program (on Array.torch()), "
        "or with ops XLA lowers; docs/architecture.md lists the ops pathways_torch "
        "computes by formula instead")


@functools.lru_cache(maxsize=None)
def _same_dtype_ops() -> frozenset:
    a = torch.ops.aten
    return frozenset({a.mm, a.addmm, a.bmm, a.baddbmm, a.addbmm, a.mv, a.addmv, a.dot,
                      a.convolution, a._convolution})


def _check_same_dtype(node, name: str, short: str) -> None:
    """torch's CPU kernels refuse a matmul or convolution of operands of different
    floating dtypes (a ``model.half()`` fed float32 inputs); fake tensors do not check,
    and XLA's verifier then fails the compile on the worker: refused here, as torch
    would."""
    vals = [a.meta.get("val") for a in node.args[:3] if hasattr(a, "meta")]
    dtypes = [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if len(set(dtypes)) > 1:
        what = " and ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ShapeError(
            f"program '{name}': {short} of {what} operands, which torch refuses (its "
            "operands must have one dtype): cast the inputs to the model's dtype "
            "(x.half() for a model.half()), or use torch.autocast / "
            "Trainer(precision='bf16') for mixed precision")


class _Replay(torch.fx.Interpreter):
    """Runs the graph on XLA tensors: factory ops traced on the CPU are made on the XLA
    device, tensor constants of the graph move there."""

    def __init__(self, gm, device) -> None:
        super().__init__(gm)
        self.device = device
        self._flag = None                  # remat.lower_tie's runtime False

    def run_node(self, n):
        self._traced = n.meta.get("val")
        value = super().run_node(n)
        if n.op == "get_attr" and isinstance(value, torch.Tensor):
            value = value.to(self.device)
        traced = n.meta.get("val")
        if isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor) \
                and value.dtype != traced.dtype:
            # torch_xla's lowering can give another dtype than torch's (in AdamW's
            # update, addcdiv of bfloat16 values gave float32): keep the traced one
            value = value.to(traced.dtype)
        return value

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.lift_fresh_copy.default:
            return args[0].clone()
        if target is remat.tie_op():
            if self._flag is None:
                self._flag = torch.tensor(False).to(self.device)
            return remat.lower_tie(args[0], self._flag)
        dev = kwargs.get("device") if kwargs else None
        if dev is not None and torch.device(dev).type == "cpu":
            kwargs = dict(kwargs, device=self.device)
        args = _bool_as_float(target, args, self._traced)
        args = _scalars_in_result_type(target, args, self._traced)
        vector = _scalars_as_vectors(target, args, kwargs)
        if vector is not None:
            out = super().call_function(target, *vector)
            return _reshaped_as(out, self._traced)
        return super().call_function(target, args, kwargs)


def _bool_as_float(target, args, traced):
    """The args of a one-tensor op that torch computes on a bool tensor in floats
    (``x.exp()``, ``x.sqrt()``, ``x.sigmoid()`` of a mask) with that tensor cast to the
    output's dtype first: torch promotes it so, and torch_xla failed to lower the op
    on booleans (an untyped error)."""
    if not isinstance(traced, torch.Tensor) or not traced.is_floating_point() or \
            not isinstance(target, torch._ops.OpOverload):
        return args
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) != 1 or tensors[0].dtype != torch.bool:
        return args
    return tuple(a.to(traced.dtype) if isinstance(a, torch.Tensor) else a for a in args)


def _scalars_in_result_type(target, args, traced):
    """The args of an elementwise op with each 0-dim tensor of the result's kind but
    another width (a float64 scalar beside float32 tensors, an int64 one beside uint8)
    cast to the result's dtype first. torch computes such an op in the dtype of the
    tensors with dimensions; torch_xla widened its XLA value to the scalar's type while
    its tensor said the narrower one (the next program refused the buffer, and uint8
    250 + 10 came out 260), and lerp refused the mix."""
    if not isinstance(traced, torch.Tensor) or traced.dtype == torch.bool or \
            not isinstance(target, torch._ops.OpOverload) or \
            torch.Tag.pointwise not in target.tags:
        return args
    kind = traced.dtype.is_floating_point, traced.dtype.is_complex

    def cast(a):
        if isinstance(a, torch.Tensor) and a.dim() == 0 and a.dtype != traced.dtype and \
                (a.dtype.is_floating_point, a.dtype.is_complex) == kind and \
                a.dtype != torch.bool:
            return a.to(traced.dtype)
        return a
    return tuple(cast(a) for a in args)


def _scalars_as_vectors(target, args, kwargs):
    """(args, kwargs) of an op along a dimension of 0-dim tensors (``t.sum(0)``,
    ``t.softmax(-1)``, ``t.max(0)``), with each tensor as a 1-element vector and the
    dimension as 0; None for any other op. torch reads dimension 0 or -1 of a 0-dim
    tensor as the tensor itself, torch_xla refuses it ("Value out of range")."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    names = [a.name for a in target._schema.arguments]
    if "dim" not in names and "dims" not in names:       # flip's is "dims"
        return None
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    # the first is the 0-dim one; an index may be a 1-element vector (index_select)
    if not tensors or tensors[0].dim() != 0 or any(
            t.dim() > 1 or t.numel() != 1 for t in tensors):
        return None
    key = "dim" if "dim" in names else "dims"
    k = names.index(key)
    arg = target._schema.arguments[k]
    dim = args[k] if k < len(args) else kwargs.get(
        key, arg.default_value if arg.has_default_value() else None)   # sort's -1
    dims = [dim] if isinstance(dim, int) else list(dim or ())
    if not dims or any(d not in (0, -1) for d in dims):
        return None
    dim = 0 if isinstance(dim, int) else [0] * len(dims)
    args, kwargs = pytree.tree_map(
        lambda x: x.reshape(1) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    if k < len(args):
        args = args[:k] + (dim,) + args[k + 1:]
    else:
        kwargs = dict(kwargs, **{key: dim})
    return args, kwargs


def _reshaped_as(value, traced):
    """``value`` in the shape torch gave the op's output in the trace."""
    if isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor):
        return value.reshape(traced.shape) if value.shape != traced.shape else value
    if isinstance(value, (tuple, list)) and isinstance(traced, (tuple, list)):
        return type(value)(*map(_reshaped_as, value, traced)) if hasattr(value, "_fields") \
            else type(value)(map(_reshaped_as, value, traced))
    return value


def _executions() -> Tuple[int, int]:
    import torch_xla.debug.metrics as met
    transfers = met.metric_data("TransferFromDeviceTime")
    return (met.counter_value("ExecuteComputation") or 0,
            transfers[0] if transfers else 0)


def trace(fn: Callable, name: str, in_avals: Sequence[Tuple[Tuple[int, ...], torch.dtype]],
          build_args: Callable[[List[torch.Tensor]], Tuple[tuple, dict]]) -> Traced:
    """Trace ``fn`` on inputs of ``in_avals``; ``build_args`` places them in the args."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    sig = ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for s, d in in_avals)
    dev = xla_device()
    with _lock:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fakes = [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in in_avals]
        del mode
        torch_rng = torch.random.get_rng_state()
        rngs = hostrng.generators(fn)
        with hostrng.watch() as draws:
            gm, info = _graph(fn, name, sig, fakes, build_args, dev)
        if not draws:           # (a draw watch() saw moves a global generator too)
            draws = [f"a generator object, {n}" for n in hostrng.moved(rngs)]
        if not torch.equal(torch_rng, torch.random.get_rng_state()):
            warn_at_caller(
                f"program '{name}' seeded or drew from torch's generator while it was "
                "traced (torch.manual_seed inside the function?): that runs once, at the "
                "trace, and does not reach the program's random ops, which take a new "
                "seed each call. Seed outside the program (torch.manual_seed or "
                "pw.manual_seed before the calls) to repeat a run; to have the same "
                "numbers every call, draw them outside and pass them in", UserWarning)
        if draws:
            warn_at_caller(
                f"program '{name}' drew random numbers from Python's or numpy's "
                f"generators while it was traced ({'; '.join(draws[:4])}): the compiled "
                "program holds those draws as constants, so every call takes the same "
                "ones (the same layers dropped, the same positions masked), where torch "
                "draws anew each step. Draw with torch (torch.rand, torch.randint, "
                "torch.bernoulli: each call gets a new seed), or turn the feature off "
                "(Hugging Face: config.layerdrop=0.0, mask_time_prob=0.0)", UserWarning)
        _check_ops(gm, name, dev)
        outside = [t for t in (getattr(gm, n.target) for n in gm.graph.nodes
                               if n.op == "get_attr")
                   if isinstance(t, torch.Tensor) and not t.is_inference()]
        _refuse_old_fakes(outside, name)
        keeps = [k for k in (keeper(outside) for keeper in KEEPERS) if k is not None] \
            if outside else []
        sources = [(t, t._version) for t in outside]
        prints = [value_print(t) for t in outside]
        import torch_xla
        import torch_xla.core.xla_model as xm
        from torch_xla.core.xla_builder import create_placeholder_tensor
        X = torch_xla._XLAC
        placeholders = [create_placeholder_tensor(tuple(shape), dtype)
                        for shape, dtype in in_avals]
        ids = {X._xla_get_tensor_id(p): k for k, p in enumerate(placeholders)}
        xm.set_rng_state(_SEED_SENTINEL, device=dev)
        before = _executions()
        try:
            # the graph holds the casts of the user's autocast already; one active
            # around the call (torch.autocast("xla")) would cast them again
            with torch.no_grad(), torch.autocast(dev.type, enabled=False), \
                    torch.autocast("cpu", enabled=False):
                outs = _Replay(gm, dev).run(*placeholders)
        except PathwaysError:
            raise
        except Exception as e:
            if "access XLA data" in str(e):
                raise _data_dependent(name, "an op that reads values") from e
            raise TraceError(f"replaying program '{name}' on XLA failed: "
                             f"{type(e).__name__}: {e}\n{_REPORT}") from e
        if _executions() != before:
            raise _data_dependent(name, "something made XLA execute")
        outs = [o if o.device.type == "xla" else o.to(dev) for o in outs]
        n_out = len(outs)
        data_ids, _ = X._get_tensors_xla_device_data_node(outs)
        if placeholders and not any(tid in ids for tid in data_ids):
            # No output depends on an input (``x.zero_()``): executors run programs
            # with parameters only, so the first input passes through as an extra
            # output that the caller drops.
            outs.append(placeholders[0])
        data_ids, data = X._get_tensors_xla_device_data_node(outs)
        params, constants, rng = [], [], False
        for tid, t in zip(data_ids, data):
            if tid in ids:
                params.append(("i", ids[tid]))
            elif t.dtype == torch.int64 and t.dim() == 0 and \
                    int(t.cpu()) == _SEED_SENTINEL:
                params.append(("i", len(in_avals)))
                rng = True
            else:
                params.append(("c", len(constants)))
                constants.append(t.cpu())
        hlo = X._get_xla_tensors_hlo_proto(outs)
        out_avals = [(tuple(o.shape), o.dtype) for o in outs]
    n_user = n_out - len(info["mutations"])
    mutations = [(k, n_user + j) for j, k in enumerate(info["mutations"])]
    h = hashlib.sha256(hlo)
    h.update(repr((params, mutations, rng)).encode())
    for c in constants:
        h.update(repr((c.dtype, tuple(c.shape))).encode())
        h.update(c.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                 if c.numel() else b"")
    return Traced(name, hlo, params, constants, out_avals, info["tree"], info["statics"],
                  h.hexdigest()[:24], mutations, rng, len(out_avals) - n_out, sources,
                  _each(keeps), prints)


def _each(fns: List[Callable[[], None]]) -> Optional[Callable[[], None]]:
    """One function calling every one of ``fns`` (KEEPERS' answers), or None."""
    if len(fns) <= 1:
        return fns[0] if fns else None

    def each() -> None:
        for f in fns:
            f()
    return each
