"""Every user error is typed, says what to do, and leaves the cluster usable."""

import os

import pytest
import torch

import pathways_torch as pw
from pathways_torch import P


@pytest.fixture(scope="module")
def s(cluster8):
    sl = pw.slice((2, 2), axis_names=("data", "model"))
    yield sl
    sl.release()


@pw.program
def matmul(x, w):
    return x @ w


def still_works(s):
    a = pw.put(torch.ones(8, 4), s, P("data"))
    b = pw.put(torch.ones(4, 2), s)
    assert torch.equal(matmul(a, b).torch(), torch.full((8, 2), 4.0))


def test_shape_mismatch_is_raised_in_the_client(s):
    x, w = pw.put(torch.randn(8, 4), s), pw.put(torch.randn(5, 3), s)
    with pytest.raises(pw.ShapeError, match=r"matmul.*float32\[8, 4\].*float32\[5, 3\]"):
        matmul(x, w)
    still_works(s)


def test_dtype_mismatch_is_raised_in_the_client(s):
    @pw.program
    def select(cond, a, b):
        return torch.where(cond, a, b)

    a = pw.put(torch.randn(8), s)
    with pytest.raises(pw.ShapeError, match="select.*bool"):
        select(a, a, a)                              # a float condition: torch rejects it
    got = select(pw.put(torch.arange(8) % 2 == 0, s), a, pw.put(torch.zeros(8), s))
    assert torch.equal(got.torch(), torch.where(torch.arange(8) % 2 == 0, a.torch(), 0.0))
    still_works(s)


def test_item_inside_a_program(s):
    @pw.program
    def normalize(x):
        return x / x.sum().item()

    # the error names the user's line that read the value
    with pytest.raises(pw.DataDependentError,
                       match=r"at test_errors\.py:\d+: return x / x\.sum\(\)\.item\(\).*torch.where"):
        normalize(pw.put(torch.ones(8), s))
    still_works(s)


def test_numpy_a_format_string_and_sparse_tensors_in_a_program_say_what_to_do(s):
    """``t.numpy()`` and ``f"{t:.3f}"`` (logging in a forward) failed with the fake
    tensor's own words (".numpy() is not supported for tensor subclasses", "unsupported
    format string passed to FakeTensor.__format__"), and a sparse adjacency in a step
    with a dispatcher dump that blamed pathways_torch."""
    def as_numpy(x):
        return x * float(x.numpy().sum())

    def logged(x):
        print(f"mean {x.mean():.3f}")
        return x * 2
    a = pw.put(torch.ones(4, 4), s)
    with pytest.raises(pw.DataDependentError, match=r"Tensor\.numpy\(\)\), at "
                                                    r"test_errors\.py:\d+: return x \* float"):
        pw.program(as_numpy)(a)
    with pytest.raises(pw.DataDependentError, match=r"a format string.*at test_errors\.py"):
        pw.program(logged)(a)
    from pathways_torch.client import capture
    err = capture._user_error("step", "", NotImplementedError(
        "Could not run 'aten::t_copy' with arguments from the 'SparseCPU' backend"))
    assert isinstance(err, pw.TraceError) and "index_add_" in str(err)
    still_works(s)


def test_a_read_in_torchs_own_code_is_named_by_torchs_line():
    """A value read inside torch's modules, with no line of the user's around it (a
    module of torch.nn called by another), names torch's line rather than nothing."""
    import os
    from pathways_torch.client.capture import _user_line
    where = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "made_up.py")
    # the read and the frame that catches it both in torch (the runtime's frames,
    # which would sit between, are left out the same way)
    code = compile("def forward(n):\n    return 1.0 / float(n)\n\n\n"
                   "def call(n):\n    try:\n        forward(n)\n"
                   "    except ValueError as e:\n        return e\n", where, "exec")
    ns: dict = {}
    exec(code, ns)
    line = _user_line(ns["call"](torch.tensor([1.0, 2.0])))    # float() of two elements
    assert line == ", in torch's own code at torch/nn/modules/made_up.py:2: ", line


def test_one_hot_without_num_classes_says_to_pass_it(s):
    @pw.program
    def encode(y):
        return torch.nn.functional.one_hot(y).float()

    with pytest.raises(pw.DataDependentError, match="pass num_classes="):
        encode(pw.put(torch.tensor([0, 2, 1]), s))
    assert encode_fixed(pw.put(torch.tensor([0, 2, 1]), s)).torch().tolist() == \
        torch.nn.functional.one_hot(torch.tensor([0, 2, 1]), 4).float().tolist()


class _LastState(torch.nn.Module):
    """An LSTM classifier over sequences of several lengths: ``packed`` packs them (as
    torch tutorials do), otherwise the padded batch with each sequence's last output
    gathered, as pathways' error advises."""

    def __init__(self, packed: bool):
        super().__init__()
        torch.manual_seed(0)
        self.packed = packed
        self.rnn = torch.nn.LSTM(3, 8, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, lengths):
        if self.packed:
            _, (h, _) = self.rnn(torch.nn.utils.rnn.pack_padded_sequence(
                x, lengths, batch_first=True, enforce_sorted=False))
            return self.head(h[-1])
        out, _ = self.rnn(x)
        return self.head(out.gather(1, (lengths - 1).view(-1, 1, 1).expand(
            -1, 1, out.shape[2])).squeeze(1))


def test_pack_padded_sequence_is_refused_with_a_rewrite_that_trains_like_it(s):
    g = torch.Generator().manual_seed(4)
    data = [((torch.randn(4, 6, 3, generator=g), torch.tensor([6, 2, 4, 1])),
             torch.randint(0, 2, (4,), generator=g)) for _ in range(3)]
    loss_fn = torch.nn.functional.cross_entropy
    ref = _LastState(packed=True)            # torch, packed
    opt, want = torch.optim.SGD(ref.parameters(), lr=0.5), []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(ref(*x), y)
        loss.backward()
        opt.step()
        want.append(loss.item())
    one = pw.slice((1,))
    try:
        packed = _LastState(packed=True)
        tr = pw.Trainer(packed, torch.optim.SGD(packed.parameters(), lr=0.5), loss_fn,
                        slice=one)
        with pytest.raises(pw.DataDependentError,
                           match=r"pack_padded_sequence.*out\.gather"):
            tr.step(*data[0])
        padded = _LastState(packed=False)
        tr = pw.Trainer(padded, torch.optim.SGD(padded.parameters(), lr=0.5), loss_fn,
                        slice=one)
        got = [float(tr.step(x, y)) for x, y in data]
    finally:
        one.release()
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_operands_of_two_dtypes_are_refused_as_torch_refuses_them(s):
    """model.half() fed float32 inputs: torch raises; fake tensors would trace it and
    XLA's verifier fail the compile on the worker."""
    @pw.program
    def layer(x, w):
        return torch.nn.functional.linear(x, w)

    with pytest.raises(pw.ShapeError, match="float32 and float16.*cast the inputs"):
        layer(pw.put(torch.randn(4, 8), s), pw.put(torch.randn(3, 8).half(), s))
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.nn.functional.linear(torch.randn(4, 8), torch.randn(3, 8).half())
    still_works(s)


def test_a_static_number_that_keeps_changing_warns_once_with_its_name(s):
    """Each value of a Python float is a trace and a compile: the third value warns,
    naming the argument and saying to pass a tensor; a tensor is an input (no retrace)."""
    @pw.program
    def anneal(x, tau):
        return torch.softmax(x / tau, -1)

    x = pw.put(torch.randn(4, 5), s)
    anneal(x, 1.0)
    anneal(x, 0.9)
    with pytest.warns(pw.RetraceWarning, match=r"float tau \(3 values.*torch.tensor"):
        anneal(x, 0.8)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        anneal(x, 0.7)                                   # warned once only
        for t in (0.6, 0.5, 0.4):
            got = anneal(x, torch.tensor(t))
    assert not [w for w in caught if w.category is pw.RetraceWarning]
    assert len(anneal._traces) == 5                      # 4 floats, 1 tensor
    torch.testing.assert_close(got.torch(), torch.softmax(x.torch() / 0.4, -1))


def test_a_shape_that_keeps_changing_warns_once_at_the_callers_line(s):
    """Each new sequence length is a trace and an XLA compile (25-75 s a length for a
    small TCN here), which went without a word: the fourth set of shapes warns once,
    at the script's line, saying to pad to a few lengths."""
    import warnings

    @pw.program
    def mean_over_time(x):
        return x.mean(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in (8, 12, 8, 16):
            mean_over_time(pw.put(torch.ones(2, t), s))
    assert not [w for w in caught if w.category is pw.RetraceWarning]
    with pytest.warns(pw.RetraceWarning, match=r"4 so far, now \[\[2, 20\]\].*pad them") as got:
        mean_over_time(pw.put(torch.ones(2, 20), s))
    assert got[0].filename == __file__
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mean_over_time(pw.put(torch.ones(2, 24), s))      # warned once only
    assert not [w for w in caught if w.category is pw.RetraceWarning]
    torch.testing.assert_close(out.torch(), torch.ones(2))


def test_an_array_updated_in_place_and_passed_twice_is_refused(s):
    """torch: f(a, a) with x.add_(1) makes y see the update too; a program would read
    the old value through y, so it is refused, and the Array is left as it was."""
    @pw.program
    def bump_and_double(x, y):
        x.add_(1)
        return y * 2

    a = pw.put(torch.ones(3), s)
    with pytest.raises(pw.TraceError, match="passed as another input too"):
        bump_and_double(a, a)
    assert a.torch().tolist() == [1.0, 1.0, 1.0]
    b = pw.put(torch.ones(3), s)
    assert bump_and_double(a, b).torch().tolist() == [2.0, 2.0, 2.0]  # then the fast path
    with pytest.raises(pw.TraceError, match="passed as another input too"):
        bump_and_double(a, a)
    assert a.torch().tolist() == [2.0, 2.0, 2.0]


@pw.program
def encode_fixed(y):
    return torch.nn.functional.one_hot(y, num_classes=4).float()


def test_data_dependent_control_flow(s):
    @pw.program
    def branch(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(pw.DataDependentError, match="normalize|branch|control flow"):
        branch(pw.put(torch.ones(8), s))


def test_unknown_axis_and_indivisible_dimension(s):
    with pytest.raises(pw.ShardingError, match="'batch'.*\\('data', 'model'\\)"):
        pw.put(torch.ones(8, 8), s, P("batch"))
    with pytest.raises(pw.ShardingError, match="size 6.*multiple of 4"):
        pw.put(torch.ones(6, 8), s, P(("data", "model")))
    with pytest.raises(ValueError):                 # ShardingError is a ValueError too
        pw.put(torch.ones(8, 7), s, P(None, "model"))

    @pw.program(out_specs=P("data"))
    def ident(x):
        return x + 1

    with pytest.raises(pw.ShardingError, match="output 0 of program 'ident'"):
        ident(pw.put(torch.ones(5), s))
    still_works(s)


def test_inputs_on_two_slices_move_to_the_first(s):
    other = pw.slice((1,))
    try:
        y = matmul(pw.put(torch.ones(2, 2), s), pw.put(torch.ones(2, 2) * 3, other))
        assert y.slice is s and torch.equal(y.torch(), torch.full((2, 2), 6.0))
        with pytest.raises(pw.PlacementError, match="no pw.Array"):
            matmul(torch.ones(2, 2), torch.ones(2, 2))
        with pytest.raises(pw.ShardingError, match="Array.to"):
            pw.put(torch.ones(4), s).to(other, P("data", "model"))
    finally:
        other.release()


def test_slice_larger_than_free(s):
    # (the slice it holds, and where the script made it: a notebook cell run again)
    with pytest.raises(pw.ResourceExhaustedError, match=r"free now: island 0 host 0: 4 of 8"
                       r".*holds Slice\(data=2, model=2.*made at test_errors\.py:\d+"):
        pw.slice((8,))
    with pytest.raises(pw.ResourceExhaustedError, match="at most 8"):
        pw.slice((16,))


def test_failure_on_the_worker_names_the_program(s):
    @pw.program(out_specs=P())
    def huge(x):
        return torch.ones(2 ** 38, device=x.device) * x.sum()   # 1 TiB: cannot be allocated

    y = huge(pw.put(torch.ones(4), s))      # dispatch returns: the failure is remote
    assert y.shape == (2 ** 38,)
    with pytest.raises(pw.OutOfMemoryError, match="huge.*1024.00 GiB.*budget") as info:
        y.torch()
    assert isinstance(info.value, pw.ProgramError)
    assert info.value.program == "huge" and "host 0" in info.value.host

    @pw.program
    def huge_no_specs(x):
        return torch.ones(2 ** 38, device=x.device) * x.sum()

    with pytest.raises(pw.OutOfMemoryError, match="huge_no_specs"):
        huge_no_specs(pw.put(torch.ones(4), s))     # learning its shardings would not fit
    still_works(s)


def test_static_arguments_must_be_plain_values(s):
    with pytest.raises(pw.TraceError, match="static Python value"):
        matmul(pw.put(torch.ones(2, 2), s), object())


def test_array_cannot_be_used_as_bool(s):
    with pytest.raises(TypeError, match="item"):
        bool(pw.put(torch.ones(1), s))


def test_a_torch_xla_loops_habits_on_an_array_say_what_to_do(s):
    """``loss.to("cpu")`` reads the value as torch_xla's loops do; ``loss.to(float64)``
    failed with an AttributeError from inside the runtime, and ``val < best``,
    ``running += loss``, ``loss / 4`` with Python's bare "unsupported operand"."""
    a = pw.put(torch.tensor(2.5), s)
    assert torch.equal(a.to("cpu"), torch.tensor(2.5))
    assert torch.equal(a.to(torch.device("cpu")), torch.tensor(2.5))
    with pytest.raises(TypeError, match="takes a pw.Slice.*inside a @pw.program"):
        a.to(torch.float64)
    for habit in (lambda: a < 3.0, lambda: sum([a, a]), lambda: a / 4, lambda: -a,
                  lambda: min(1.0, a), lambda: round(a)):
        with pytest.raises(TypeError, match=r"would block for its value: use a\.item\(\)"):
            habit()
    running = 0.0
    with pytest.raises(TypeError, match="would block"):
        running += a
    v = pw.put(torch.arange(4.), s)
    for habit in (lambda: list(v), lambda: [x for x in v], lambda: tuple(v)):
        with pytest.raises(TypeError, match="iterating over a pw.Array.*a.torch()"):
            habit()
    with pytest.raises(TypeError, match="only a 0-d Array formats as a number"):
        f"{v:.2f}"
    assert f"{a:.2f}" == "2.50" and f"{v}".startswith("pw.Array(float32[4]")
    still_works(s)


def test_process_collectives_and_the_xla_device_in_a_program_say_what_to_do(s):
    """A DistributedDataParallel wrapper's buffer broadcast ("c10d.broadcast_ ... has
    no shape function") and ``torch.zeros(..., device=xm.xla_device())`` in a forward
    ("Unhandled FakeTensor Device Propagation") gave torch's words, not pathways'."""
    import torch_xla.core.xla_model as xm
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    def on_xla(x):
        return x + torch.zeros(4, device=xm.xla_device())
    with pytest.raises(pw.TraceError, match=r"makes a tensor on the XLA device.*"
                                            r"device=x\.device"):
        pw.program(on_xla)(pw.put(torch.ones(4), s))
    from pathways_torch.client import capture
    err = capture._user_error("train_step", "", UnsupportedOperatorException(
        torch.ops.c10d.broadcast_.default))
    assert isinstance(err, pw.TraceError) and "model.module" in str(err)
    still_works(s)


def test_hugging_faces_layerdrop_gets_the_config_to_change():
    """BART's ``if dropout_probability < self.layerdrop`` (a torch.rand draw read in
    Python) said to use torch.where, which a user cannot do inside a library."""
    from pathways_torch.client.capture import _data_dependent
    err = _data_dependent("train_step_BartForCausalLM", "aten._local_scalar_dense",
                          ", at modeling_bart.py:657: if dropout_probability < "
                          "self.layerdrop:")
    assert "decoder_layerdrop) to 0.0" in str(err)


def test_ctrl_c_during_the_first_traces_torch_xla_import_leaves_the_session_usable():
    """Ctrl-C while the first program call imports torch_xla (seconds): the interrupt
    comes once the import is done, and the next call works. Before, torch_xla stayed
    half-imported and every later call failed until the process restarted (stop 43)."""
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent("""
        import os, signal, threading
        import torch
        from pathways_torch._xla import import_torch_xla
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            import_torch_xla()
            print("NOT INTERRUPTED")
        except KeyboardInterrupt:
            print("INTERRUPTED")
        import_torch_xla()
        import torch_xla
        print("VALUE", (torch.ones(2, device=torch_xla.device()) + 1).cpu().tolist())
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PJRT_DEVICE="CPU"))
    assert out.stdout.splitlines() == ["INTERRUPTED", "VALUE [2.0, 2.0]"], \
        out.stdout + out.stderr[-2000:]
