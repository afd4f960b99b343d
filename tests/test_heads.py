"""The heads and the torch backend: ResidualSwiGLUHead (the official BST head) against its definition
and against the float64 reference on every path that takes it, the per-token split of any head
(pair_parts), chunk boundaries of the torch backend, tying, the model/config/CLI switch, decoding
with the new head, and a short star-graph run."""
import copy
import importlib.util
import math
import os
import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bst_fast import BeliefStateTransformer, ModelConfig, ResidualSwiGLUHead, TextHead, belief_state_loss
from bst_fast import _pairs, decode
from bst_fast.backends import runtime, torch_backend, torch_chunks
from bst_fast.head import PairParts, split_linear, swiglu, swiglu_grad, swiglu_hidden, zero_padding

from _helpers import (SwiGLUHead, check_against_reference, errors, loss_and_grads, make_head, make_inputs,
                      bf16_head_draw, random_grad_out, reference64, rel_err, switch, tiny_weight_float16_errors)


@pytest.fixture(params=["torch_ops", "triton"])
def engine(request, monkeypatch):
    """The torch backend's engine, both ways: torch ops, or the Triton kernels (through
    the interpreter on the CPU). Yields the list of parts the Triton engine summed, so that a test
    can check that the engine it asked for ran."""
    if request.param == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    switch(monkeypatch, triton_ops=request.param == "triton")
    calls = []
    real = torch_chunks.TritonOps.gather
    monkeypatch.setattr(torch_chunks.TritonOps, "gather", lambda self, k, c, what: calls.append(k) or real(self, k, c, what))
    yield request.param, calls
    assert bool(calls) == (request.param == "triton"), "the pair-sum engine the test asked for did not run"


def make_swiglu(m=7, V=13, hidden=10, bias=False, seed=0, scale=0.6):
    """A ResidualSwiGLUHead with N(0, scale^2) weights (a softmax far from flat), norm weights near 1."""
    g = torch.Generator().manual_seed(seed)
    head = ResidualSwiGLUHead(m, V, hidden=hidden, bias=bias)
    with torch.no_grad():
        for name, q in head.named_parameters():
            q.copy_(torch.randn(q.shape, generator=g) * (0.3 if "norm" in name else scale)
                    + (1.0 if name == "norm.weight" else 0.0))
    return head


def swiglu_by_hand(head, x):
    """The official TextHead's formula, written out: x + Down(silu(gate) * up), the norm, lm_head on each half."""
    m, H = head.d_model, head.hidden
    gate_up = x @ head.mlp[0].gate_up.weight.t()
    down = head.mlp[2]
    if head.bias:
        gate_up = gate_up + head.mlp[0].gate_up.bias
    y = x + (F.silu(gate_up[:, :H]) * gate_up[:, H:]) @ down.weight.t() + (down.bias if head.bias else 0)
    if head.bias:
        y = (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, unbiased=False, keepdim=True) + 1e-5)
        y = y * head.norm.weight + head.norm.bias
    else:
        y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + 1e-5) * head.norm.weight
    w = head.lm_head.weight
    return torch.cat([y[:, :m] @ w.t(), y[:, m:] @ w.t()], -1)


@pytest.mark.parametrize("bias", [False, True], ids=["rmsnorm", "layernorm"])
def test_swiglu_head_is_the_official_head(bias):
    head = make_swiglu(m=6, V=11, hidden=9, bias=bias, seed=1).double()
    x = torch.randn(5, 12, dtype=torch.float64)
    out = head(x)
    assert out.shape == (5, 22)
    assert torch.allclose(out, swiglu_by_hand(head, x), rtol=1e-12, atol=1e-12)
    assert head(x[None]).shape == (1, 5, 22)  # any leading shape
    # The official parameter names and widths; no bias anywhere with bias=False, lm_head never has one.
    names = {"mlp.0.gate_up.weight", "mlp.2.weight", "norm.weight", "lm_head.weight"}
    if bias:
        names |= {"mlp.0.gate_up.bias", "mlp.2.bias", "norm.bias"}
    assert set(head.state_dict()) == names
    assert head.mlp[0].gate_up.weight.shape == (18, 12) and head.lm_head.weight.shape == (11, 6)


def test_swiglu_default_width():
    # model_bst.py: 128 * round((8 * 2m / 3) / 128)
    assert [swiglu_hidden(m) for m in (512, 768, 128, 7)] == [2688, 4096, 640, 128]
    assert ResidualSwiGLUHead(128, 5).hidden == 640
    with pytest.raises(ValueError, match="hidden"):
        ResidualSwiGLUHead(8, 5, hidden=0)


@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_pair_parts_give_the_head_on_each_pair(kind):
    """tail(the pairs' sums of the per-token parts) equals head([f_i ; b_j])."""
    head = (make_head(5, 7, hidden=[6, 4], n_layers=3) if kind == "mlp" else make_swiglu(5, 7, hidden=9)).double()
    f, b = torch.randn(2, 6, 5, dtype=torch.float64), torch.randn(2, 6, 5, dtype=torch.float64)
    lengths = torch.tensor([6, 4])
    parts = head.pair_parts(f, b, lengths)
    row, i, j = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 2, 0, 1]), torch.tensor([5, 4, 3, 3])
    assert parts.dtypes == [torch.float64] * len(parts.prefix)
    assert parts.swiglu == ((1,) if kind == "swiglu" else ())  # the gate_up projection
    sums = [P[row, i] + Q[row, j] for P, Q in zip(parts.prefix, parts.suffix)]
    got = parts.tail([swiglu(*x.chunk(2, dim=-1)) if k in parts.swiglu else x for k, x in enumerate(sums)])
    assert torch.allclose(got, head(torch.cat([f[row, i], b[row, j]], -1)), rtol=1e-12, atol=1e-12)


CASES = {
    "default": {},
    "lengths_gaps": dict(lengths=torch.tensor([13, 4, 9]), min_gap=3, max_gap=7, next_weight=0.3),
    "prefix_start_sum": dict(prefix_start=torch.tensor([0, 5, 2]), reduction="sum"),
    "explicit": dict(pairs=(torch.tensor([2, 0, 0, 1, 2, 0]), torch.tensor([5, 0, 3, 1, 0, 0]),
                            torch.tensor([9, 2, 12, 4, 11, 2]))),  # (0, 0, 2) twice
    "fraction": dict(pairs=0.4, generator_seed=3, next_weight=0.7),
}
# Not the reference: it is the float64 oracle here (tests/test_pair_set.py holds it to a hand sum).
PATHS = [("torch", torch.float64), ("torch", torch.float32), ("auto", torch.float64), ("auto", torch.float32)]


@pytest.mark.parametrize("backend,dtype", PATHS, ids=[f"{b}-{str(d)[6:]}" for b, d in PATHS])
@pytest.mark.parametrize("bias", [False, True], ids=["rmsnorm", "layernorm"])
@pytest.mark.parametrize("case", list(CASES))
def test_swiglu_against_reference(case, bias, backend, dtype):
    """docs/contract.md §6 tolerances against the float64 reference, a random grad_output."""
    seed = 10 * list(CASES).index(case) + bias
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=seed)
    head = make_swiglu(7, 13, hidden=10, bias=bias, seed=seed)
    check_against_reference(f, b, tokens, head, backend=backend, dtype=dtype, seed=seed, **CASES[case])


CHUNKS = [1, 2, 7, 13, 97, 10**6]  # one pair, primes (chunks across rows), more than all pairs


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("kind", ["mlp", "swiglu", "other"])
def test_chunk_boundaries(monkeypatch, kind, chunk):
    """Every chunk size gives the reference to float64 precision: a chunk of one pair, prime sizes
    that cut rows anywhere, rows shorter than a chunk (row 1 has 3 pairs) and a chunk holding all."""
    switch(monkeypatch, chunk_pairs=chunk)
    seed = 30 + CHUNKS.index(chunk)
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = {"mlp": mlp, "swiglu": make_swiglu(seed=seed), "other": SwiGLUHead(7, 13, seed=seed)}[kind]
    lengths = torch.tensor([13, 4, 11])
    check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=seed, lengths=lengths)
    check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=seed, lengths=lengths,
                            pairs=0.5, generator_seed=seed, reduction="sum")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["mlp", "swiglu", "other"])
def test_both_engines_against_reference(case, kind, monkeypatch, engine):
    """Both pair-sum engines in float32 at docs/contract.md §6's tolerances, chunks of 7 pairs
    (cutting rows anywhere) and of the byte budget (one chunk)."""
    seed = 90 + 3 * list(CASES).index(case) + ["mlp", "swiglu", "other"].index(kind)
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = {"mlp": mlp, "swiglu": make_swiglu(seed=seed, bias=seed % 2 == 1), "other": SwiGLUHead(7, 13, seed=seed)}[kind]
    for chunk in (7, None):
        switch(monkeypatch, chunk_pairs=chunk)
        check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float32, seed=seed, **CASES[case])


@pytest.mark.parametrize("kind,chunk", [("mlp", 7), ("swiglu", 7), ("swiglu", None), ("other", 5)])
def test_structured_sums_in_the_triton_engine(monkeypatch, kind, chunk):
    """Switches.structured_sums in the torch backend's Triton engine: its plain ("sum") and swiglu
    segment sums by arithmetic, at docs/contract.md §6's tolerances, chunks cutting rows anywhere,
    ragged rows, gaps, prefix_start and packed documents."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    switch(monkeypatch, triton_ops=True, structured_sums=True, chunk_pairs=chunk)
    seed = 140 + (chunk or 0) + ["mlp", "swiglu", "other"].index(kind)
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = {"mlp": mlp, "swiglu": make_swiglu(seed=seed), "other": SwiGLUHead(7, 13, seed=seed)}[kind]
    documents = torch.tensor([[0] * 4 + [1] * 9, [0] * 13, [2] * 6 + [5] * 7])
    lists = []
    real = torch_backend.pair_list
    monkeypatch.setattr(torch_backend, "pair_list", lambda *a, **k: lists.append(real(*a, **k)) or lists[-1])
    for opts in (CASES["lengths_gaps"], CASES["prefix_start_sum"], dict(documents=documents, min_gap=1, meet_token=0)):
        check_against_reference(f, b, tokens, head, backend="torch", seed=seed, **opts)
    assert lists and all(pl.jlo is not None for pl in lists)  # the structured walk ran


@pytest.mark.parametrize("chunk", [1, 2, 13, 97])
def test_both_engines_chunk_boundaries(monkeypatch, chunk, engine):
    """The segment sums of a chunk of one pair, of prime sizes, of rows shorter than a chunk, in
    float32 with ragged rows; and the same with explicit pairs that repeat."""
    switch(monkeypatch, chunk_pairs=chunk)
    seed = 130 + chunk
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=seed)
    head = make_swiglu(seed=seed)
    check_against_reference(f, b, tokens, head, backend="torch", seed=seed, lengths=torch.tensor([13, 4, 11]))
    check_against_reference(f, b, tokens, head, backend="torch", seed=seed, pairs=CASES["explicit"]["pairs"])


WINDOW_CASES = {"lengths_gaps": CASES["lengths_gaps"], "explicit": CASES["explicit"], "fraction": CASES["fraction"],
                "documents": dict(documents=torch.tensor([[0] * 4 + [1] * 9, [0] * 13, [2] * 6 + [5] * 7]), min_gap=1,
                                  meet_token=0, prefix_start=torch.tensor([0, 3, 1]))}


def _count_windows(monkeypatch):
    """The windows each run of the torch backend made (a list per run)."""
    made = []
    real = torch_backend._windows
    monkeypatch.setattr(torch_backend, "_windows", lambda *a: made.append(real(*a)) or made[-1])
    return made


# (window rows, chunk pairs) -> the cases the Triton engine runs there (the interpreter takes 1-12 s
# a case; the torch ops engine runs every case everywhere): each case in two shapes, the costly
# ones (documents, a subsample) away from the chunk of one pair
TRITON_WINDOW_CASES = {(1, 7): ("documents", "fraction"), (2, 5): ("lengths_gaps", "documents"),
                       (1, 1): ("explicit", "lengths_gaps"), (1, 40): ("fraction", "explicit")}


@pytest.mark.parametrize("kind", ["mlp", "swiglu", "other"])
def test_windows_of_rows(monkeypatch, kind, engine):
    """The parts' tables and their gradient sums a window of rows at a time (Switches.window_rows):
    windows of one and two rows, chunks that end inside a row (a row in two windows, its sums mapped
    in two pieces), a chunk of one pair, chunks that span more rows than a window; explicit pairs
    (unsorted, repeated, rows skipped), a subsample and packed documents; both engines, float32."""
    made = _count_windows(monkeypatch)
    seed = 170 + ["mlp", "swiglu", "other"].index(kind)
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = {"mlp": mlp, "swiglu": make_swiglu(seed=seed, bias=True), "other": SwiGLUHead(7, 13, seed=seed)}[kind]
    for (rows, chunk), interpreted in TRITON_WINDOW_CASES.items():
        switch(monkeypatch, window_rows=rows, chunk_pairs=chunk)
        for case, opts in WINDOW_CASES.items():
            if engine[0] == "triton" and case not in interpreted:
                continue
            check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float32, seed=seed, **opts)
    # a window takes the chunks that begin within its rows (two at most here)
    assert max(len(w) for w in made) >= 3 and all(c.pre_lo // 13 < ra + 2 for w in made for ra, rb, cs in w for c in cs)
    # some row was in two windows
    assert any(w[k][1] == w[k + 1][0] for w in made for k in range(len(w) - 1))


@pytest.mark.parametrize("kind", ["mlp", "swiglu", "other"])
def test_windows_of_rows_float64(monkeypatch, kind):
    """The same windows in float64 (the torch ops), at float64's precision: the pieces of a shared
    row's sums and the windows' parameter gradients add up exactly as one window's."""
    made = _count_windows(monkeypatch)
    seed = 180 + ["mlp", "swiglu", "other"].index(kind)
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = {"mlp": mlp, "swiglu": make_swiglu(seed=seed), "other": SwiGLUHead(7, 13, seed=seed)}[kind]
    for rows, chunk in ((1, 7), (2, 11)):
        switch(monkeypatch, window_rows=rows, chunk_pairs=chunk)
        for case, opts in WINDOW_CASES.items():
            check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=seed, **opts)
    assert max(len(w) for w in made) >= 3


def test_windows_drop_what_they_made(monkeypatch):
    """Nothing a window made (its parts, the engine's gradient sums) is alive while the next window
    makes its parts: the SwiGLU head, windows of one row (an independent review found the last
    part's tables and sums kept by a loop variable: 24% of the modelled peak at the paper's shape)."""
    import weakref
    switch(monkeypatch, window_rows=1, chunk_pairs=9)
    f, b, tokens, _ = make_inputs(B=4, L=10, m=5, V=7, seed=2)
    head = make_swiglu(m=5, V=7, hidden=12, bias=True, seed=2).double()
    refs, alive = [], []
    real_parts, real_init = head.pair_parts, torch_chunks.TorchOps.__init__

    def pair_parts(f, b, lengths):
        if torch.is_grad_enabled():  # a window (the probe of one row runs without grad)
            alive.append([tuple(r().shape) for r in refs if r() is not None])
            refs.clear()
        out = real_parts(f, b, lengths)
        if torch.is_grad_enabled():
            refs.extend(weakref.ref(t) for t in (*out.prefix, *out.suffix))
        return out

    def init(self, prefix, suffix, dtypes, swiglu_parts, pl, grads, *a, **k):
        real_init(self, prefix, suffix, dtypes, swiglu_parts, pl, grads, *a, **k)
        refs.extend(weakref.ref(g) for g in grads if g is not None)

    monkeypatch.setattr(head, "pair_parts", pair_parts)
    monkeypatch.setattr(torch_chunks.TorchOps, "__init__", init)
    f, b = f.double().requires_grad_(), b.double().requires_grad_()
    belief_state_loss(f, b, tokens, head, backend="torch").backward()
    assert len(alive) >= 4 and alive[1:] == [[]] * (len(alive) - 1)


class _GainHead(nn.Module):
    """A head whose pair_parts reads `gain`, a tensor that requires grad but is not its parameter."""

    def __init__(self, gain, m=4, V=5):
        super().__init__()
        self.lin, self.m, self.shared = nn.Linear(2 * m, 2 * V), m, [gain]

    def forward(self, x):
        return self.lin(torch.cat([x[..., : self.m] * self.shared[0], x[..., self.m :]], -1))

    def pair_parts(self, f, b, lengths):
        w = self.lin.weight
        P = (f * self.shared[0]) @ w[:, : self.m].t() + self.lin.bias
        return PairParts([P], [b @ w[:, self.m :].t()], [f.dtype], lambda xs: xs[0])


def test_pair_parts_reaching_another_tensor_is_refused():
    """The torch backend maps the parts' gradients to f, b and the head's parameters alone (head.py),
    so a part that reads another tensor that requires grad is an error, not a silently lost gradient;
    detached, it is a constant. autocast's cached casts of the parameters (made by the probe, before
    the window) still lead to the parameters: a custom head's Linear parts under CPU autocast."""
    gain = torch.full((4,), 1.5, requires_grad=True)
    f, b, tokens, _ = make_inputs(B=2, L=9, m=4, V=5, seed=3)
    with pytest.raises(ValueError, match="pair_parts uses a tensor that requires grad besides f, b"):
        belief_state_loss(f, b, tokens, _GainHead(gain), backend="torch")
    # nothing else requires grad (a frozen head): the loss would carry no gradient to gain at all
    frozen = _GainHead(gain).requires_grad_(False)
    with pytest.raises(ValueError, match="pair_parts uses a tensor that requires grad besides f, b"):
        belief_state_loss(f, b, tokens, frozen, backend="torch")
    with torch.no_grad():  # no gradient asked for: nothing is lost
        belief_state_loss(f, b, tokens, frozen, backend="torch")
    check_against_reference(f, b, tokens, _GainHead(gain.detach()), backend="torch", dtype=torch.float64)

    class LinearParts(nn.Module):
        def __init__(self, m=4, V=5, h=6):
            super().__init__()
            self.p, self.q, self.out = nn.Linear(m, h), nn.Linear(m, h, bias=False), nn.Linear(h, 2 * V)

        def forward(self, x):
            return self.out(torch.relu(self.p(x[..., :4]) + self.q(x[..., 4:])))

        def pair_parts(self, f, b, lengths):
            P, Q = self.p(f), self.q(b)
            return PairParts([P], [Q], [P.dtype], lambda xs: self.out(torch.relu(xs[0])))

    head = LinearParts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mat = loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="reference")
        got = loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="torch")
    for name, g in got[1].items():
        assert g is not None and rel_err(g, mat[1][name]) < 2e-2, name


def test_window_rows_rule():
    """A sixteenth of the chunk budget's bytes, or a sixteenth of the batch if more; the switch wins."""
    sw = runtime.Switches()
    assert runtime.window_rows(256, 2**20, 256 * 2**20, sw) == 16
    assert runtime.window_rows(32, 2**10, 256 * 2**20, sw) == 16384
    assert runtime.window_rows(1000, 2**30, 256 * 2**20, sw) == 63
    assert runtime.window_rows(1, 2**40, 1, sw) == 1
    assert runtime.window_rows(1000, 1, 1, runtime.Switches(window_rows=3)) == 3


@pytest.mark.parametrize("case", ["default", "explicit", "fraction"])
def test_unfused_swiglu_against_reference(case, monkeypatch, engine):
    """fused_swiglu off: gate and up summed apart (column halves of one table, strided rows for the
    Triton engine's gathers and segment sums) and combined by torch; both engines in float32,
    chunks of 7 pairs and of the byte budget. The default (fused) path is every other swiglu test."""
    switch(monkeypatch, fused_swiglu=False)
    whats = []
    real = torch_backend._PairSum.forward
    monkeypatch.setattr(torch_backend._PairSum, "forward",
                        staticmethod(lambda ctx, *a: whats.append(a[-1]) or real(ctx, *a)))
    seed = 160 + list(CASES).index(case)
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=seed)
    head = make_swiglu(seed=seed, bias=seed % 2 == 1)
    for chunk in (7, None):
        switch(monkeypatch, chunk_pairs=chunk)
        check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float32, seed=seed, **CASES[case])
    assert set(whats) == {"sum", "gate", "up"}


def test_fused_swiglu_gathers_half_width(monkeypatch):
    """The fused swiglu part makes one (n, H) tensor per chunk (not gate and up, (n, 2H)), and the
    chunk budget counts it so: the budget of 5 pairs' logits, residual and SwiGLU output gives 5."""
    m, V, H = 7, 13, 10
    widths = []
    real = torch_backend._PairSum.forward

    def forward(ctx, *a):
        x = real(ctx, *a)
        widths.append((a[-1], x.shape[1]))
        return x
    monkeypatch.setattr(torch_backend._PairSum, "forward", staticmethod(forward))
    switch(monkeypatch, torch_cpu_chunk_bytes=5 * (2 * V + 2 * m + H) * 8)
    sizes = []
    real_ce = torch_chunks._cross_entropy_
    monkeypatch.setattr(torch_chunks, "_cross_entropy_", lambda z, *a: sizes.append(z.shape[0]) or real_ce(z, *a))
    f, b, tokens, _ = make_inputs(B=3, L=13, m=m, V=V, seed=41)
    check_against_reference(f, b, tokens, make_swiglu(m, V, hidden=H, seed=41), backend="torch", dtype=torch.float64,
                            seed=41)
    assert set(widths) == {("sum", 2 * m), ("swiglu", H)}
    assert max(sizes) == 5


def test_chunk_size_from_the_byte_budget(monkeypatch):
    assert runtime.SWITCHES.chunk_pairs is None
    if "BST_FAST_TORCH_CHUNK_MB" not in os.environ:
        assert runtime.SWITCHES.torch_chunk_bytes == 256 * 2**20  # the GPU default
    assert torch_backend.chunk_pairs(4000, torch.device("cuda"), runtime.SWITCHES) == 256 * 2**20 // 4000
    assert torch_backend.chunk_pairs(10**12, torch.device("cpu"), runtime.SWITCHES) == 1
    # A budget of 5 pairs' logits and first-layer sums (2V + h float64 each) on the CPU: chunks of 5
    # across rows, still exact.
    switch(monkeypatch, torch_cpu_chunk_bytes=5 * (2 * 13 + 9) * 8)
    assert torch_backend.chunk_pairs((2 * 13 + 9) * 8 + 1, torch.device("cpu"), runtime.SWITCHES) == 4
    sizes = []
    real = torch_chunks._cross_entropy_
    monkeypatch.setattr(torch_chunks, "_cross_entropy_", lambda z, *a: sizes.append(z.shape[0]) or real(z, *a))
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, seed=40)
    check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=40,
                            lengths=torch.tensor([13, 4, 11]))
    assert sizes == [5] * (sum(sizes) // 5) + ([sum(sizes) % 5] if sum(sizes) % 5 else [])
    assert sum(sizes) == 66 + 3 + 45


class _SlicedGLU(nn.Module):
    """A custom head whose swiglu part is a column slice of a wider projection (rows 2h + 2 apart)."""

    def __init__(self, m=3, V=5, h=4):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.h, self.w, self.out = h, nn.Linear(2 * m, 2 * h + 2), nn.Linear(h, 2 * V)
        with torch.no_grad():
            for q in self.parameters():
                q.copy_(torch.randn(q.shape, generator=g))

    def forward(self, x):
        return self.out(swiglu(*self.w(x)[..., : 2 * self.h].chunk(2, -1)))

    def pair_parts(self, f, b, lengths):
        gf, gb = split_linear(self.w, f, b)
        return PairParts([gf[..., : 2 * self.h]], [gb[..., : 2 * self.h]], [f.dtype], lambda xs: self.out(xs[0]),
                         swiglu=(0,))


def test_swiglu_part_with_strided_rows(engine):
    """A swiglu part may be a column slice of a wider table (rows not contiguous): both engines."""
    f, b, tokens, _ = make_inputs(B=2, L=6, m=3, V=5, seed=44)
    check_against_reference(f, b, tokens, _SlicedGLU(), backend="torch", seed=44)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_swiglu_of_16_bit_tables_rounds_once(dtype, engine):
    """16-bit [gate | up] tables (a custom head's): SwiGLU of their float32 sums, rounded once, and
    the gradients from the same float32 sums, on both engines."""
    B, L, h = 2, 9, 8
    tokens = torch.zeros(B, L, dtype=torch.long)
    p = _pairs.prepare(torch.zeros(B, L, 3), torch.zeros(B, L, 3), tokens, 5, lengths=None, prefix_start=0,
                       min_gap=2, max_gap=None, pairs=None, next_weight=0.5, reduction="mean", generator=None)
    pl = _pairs.pair_list(p, B, L, 1000)
    g = torch.Generator().manual_seed(45)
    P, Q = [(torch.randn(B, L, 2 * h, generator=g) * 3).to(dtype) for _ in range(2)]
    ia, ib = pl.ia.long(), pl.ib.long()
    s = P.double().reshape(B * L, -1)[ia] + Q.double().reshape(B * L, -1)[ib]  # exact in float32 too
    dx = torch.randn(ia.numel(), h, generator=g).to(dtype)
    dg, du = swiglu_grad(dx.double(), s[:, :h], s[:, h:])
    want = torch.zeros(2 * B * L, 2 * h, dtype=torch.float64)
    for rows in (ia, ib + B * L):
        want.index_add_(0, rows, torch.cat([dg, du], 1))
    grads = [torch.zeros(2 * B * L, 2 * h)]
    ops = (torch_chunks.TritonOps if engine[0] == "triton" else torch_chunks.TorchOps)(
        [P], [Q], [dtype], (0,), pl, grads, tokens, 0.5)
    x = ops.gather(0, pl.chunks[0], "swiglu")
    assert torch.equal(x, swiglu(s[:, :h], s[:, h:]).float().to(dtype))
    ops.add_grad(0, pl.chunks[0], dx, 1.0, "swiglu")
    assert rel_err(grads[0], want) < 1e-6


def test_bad_swiglu_parts_are_refused(monkeypatch):
    """A head's swiglu parts must be among its parts and of even width ([gate | up])."""
    f, b, tokens, _ = make_inputs(B=2, L=6, m=7, V=13, seed=42)
    head = make_swiglu(seed=42)
    real = head.pair_parts
    odd = lambda f, b, l: PairParts([f], [b], [f.dtype], lambda xs: xs[0], swiglu=(0,))  # 7 wide
    for parts in (lambda f, b, l: real(f, b, l)._replace(swiglu=(2,)),
                  lambda f, b, l: real(f, b, l)._replace(swiglu=(-1,)), odd):
        monkeypatch.setattr(head, "pair_parts", parts)
        with pytest.raises(ValueError, match="swiglu must list parts of even width"):
            belief_state_loss(f, b, tokens, head, backend="torch")


def test_variants_set_and_restore_the_settings():
    def settings():
        return runtime.SWITCHES.compile_tail, runtime.SWITCHES.fused_swiglu

    before = settings()
    with torch_backend.variant("torch+unfused"):
        assert settings() == (False, False)
        with torch_backend.variant("torch+compile"):
            assert settings() == (True, True)
        assert runtime.SWITCHES.fused_swiglu is False
    assert settings() == before
    with pytest.raises(ValueError, match="variant must be one of"):
        with torch_backend.variant("torch+fast"):
            pass


def test_environment_settings_are_checked(monkeypatch):
    from bst_fast.backends.runtime import env_count, env_flag, env_mb

    monkeypatch.setenv("BST_FAST_X_MB", "0.5")
    assert env_mb("BST_FAST_X_MB", 256) == 2**19
    monkeypatch.delenv("BST_FAST_X_MB")
    assert env_mb("BST_FAST_X_MB", 256) == 256 * 2**20
    for bad in ("", "abc", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("BST_FAST_X_MB", bad)
        with pytest.raises(ValueError, match="BST_FAST_X_MB must be a positive number of MB"):
            env_mb("BST_FAST_X_MB", 256)
    assert env_flag("BST_FAST_X_ON") is False
    monkeypatch.setenv("BST_FAST_X_ON", "1")
    assert env_flag("BST_FAST_X_ON") is True
    for bad in ("yes", "true", "2", ""):
        monkeypatch.setenv("BST_FAST_X_ON", bad)
        with pytest.raises(ValueError, match="BST_FAST_X_ON must be 0 or 1"):
            env_flag("BST_FAST_X_ON")
    assert env_count("BST_FAST_X_N") == 0
    monkeypatch.setenv("BST_FAST_X_N", "128")
    assert env_count("BST_FAST_X_N") == 128
    for bad in ("-1", "1.5", "", "x"):
        monkeypatch.setenv("BST_FAST_X_N", bad)
        with pytest.raises(ValueError, match="BST_FAST_X_N must be an int >= 0"):
            env_count("BST_FAST_X_N")


def test_switches_come_from_the_environment(monkeypatch):
    """Each environment variable sets its switch; a LossOptions made without switches takes the ones in force."""
    for name, value in (("BST_FAST_CHUNK_MB", "0.5"), ("BST_FAST_TORCH_CHUNK_MB", "2"),
                        ("BST_FAST_TORCH_COMPILE", "1"), ("BST_FAST_TORCH_UNFUSED_SWIGLU", "1"),
                        ("BST_FAST_BIAS_IN_GEMM", "1"), ("BST_FAST_VOCAB_PAD", "128"),
                        ("BST_FAST_STRUCTURED_SUMS", "1"), ("BST_FAST_DEVICE_SAMPLER", "1"),
                        ("BST_FAST_CE_BIAS_SUMS", "1"), ("BST_FAST_FUSED_CE", "1"), ("BST_FAST_RELU_IN_GEMM", "1"),
                        ("BST_FAST_HIDDEN_SUMS", "1"), ("BST_FAST_DEVICE_PAIR_LIST", "1"), ("BST_FAST_SPLIT_16BIT", "1")):
        monkeypatch.setenv(name, value)
    assert runtime.Switches.from_environment() == runtime.Switches(
        triton_chunk_bytes=2**19, torch_chunk_bytes=2 * 2**20, compile_tail=True, fused_swiglu=False,
        bias_in_gemm=True, vocab_pad=128, structured_sums=True, device_sampler=True, ce_bias_sums=True,
        fused_ce=True, relu_in_gemm=True, hidden_sums=True, host_pairs=False, split_16bit=True)
    with runtime.switched(chunk_pairs=5):
        assert runtime.LossOptions(next_weight=0.5, vocab_size=3).switches.chunk_pairs == 5
    assert runtime.LossOptions(next_weight=0.5, vocab_size=3).switches is runtime.SWITCHES


def test_flat_pairs_are_the_pair_set_in_order():
    B, L = 3, 15
    tokens = torch.zeros(B, L, dtype=torch.long)
    f = torch.zeros(B, L, 2)
    p = _pairs.prepare(f, f, tokens, 1, lengths=torch.tensor([15, 7, 10]), prefix_start=torch.tensor([0, 2, 1]),
                       min_gap=3, max_gap=6, pairs=None, next_weight=0.5, reduction="mean", generator=None)
    ia, ib, w = _pairs.flat_pairs(p, L)
    row, i, j = _pairs.pair_mask(p.lengths, p.prefix_start, 3, 6, L).nonzero(as_tuple=True)
    assert w is None and torch.equal(ia, row * L + i) and torch.equal(ib, row * L + j)


def test_pair_list_chunk_larger_than_the_pairs():
    """A chunk budget far above the pair count gives one chunk of all pairs, without allocating
    for the budget (the last chunk is padded to the chunk size)."""
    B, L = 2, 9
    f = torch.zeros(B, L, 2)
    p = _pairs.prepare(f, f, torch.zeros(B, L, dtype=torch.long), 1, lengths=None, prefix_start=0, min_gap=2,
                       max_gap=None, pairs=None, next_weight=0.5, reduction="mean", generator=None)
    pl = _pairs.pair_list(p, B, L, 10**12)  # would need terabytes if padded to the budget
    total = pl.ia.numel()
    assert total == 2 * 28 and [c[:2] for c in pl.chunks] == [(0, total)]


def test_no_host_synchronisation_per_chunk(monkeypatch):
    """The number of device-to-host reads (item, tolist, int(), bool(), ...) does not grow with the
    number of chunks: the pair list is built once and sliced."""
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, seed=50)
    f.requires_grad_()
    counts = []
    for chunk in (1, 10**6):
        switch(monkeypatch, chunk_pairs=chunk)
        calls = []
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__float__", "__index__"):
                real = getattr(torch.Tensor, name)
                mp.setattr(torch.Tensor, name, lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
            belief_state_loss(f, b, tokens, make_swiglu(seed=50), backend="torch").backward()
        counts.append(len(calls))
    assert counts[0] == counts[1], counts


class TanhHead(nn.Module):
    """A head whose last op saves its own output (tanh): its logits must not be overwritten in place."""

    def __init__(self, m, V):
        super().__init__()
        self.inp = nn.Linear(2 * m, 2 * V)

    def forward(self, x):
        return torch.tanh(self.inp(x)) * 3.0 if self.training else torch.tanh(self.inp(x))


@pytest.mark.parametrize("training", [True, False])
def test_logits_saved_by_the_head_are_not_overwritten(training):
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=60)
    head = TanhHead(7, 13).train(training)
    check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=60)


def test_compiled_tail_against_reference(monkeypatch):
    """Switches.compile_tail: the heads' per-pair tail under torch.compile (inductor on the CPU),
    chunks of 7 pairs (a static graph, then a dynamic one for the shorter last chunk), in float32
    at docs/contract.md §6's tolerances; a head whose backward reads its logits (tanh) keeps them."""
    pytest.importorskip("torch._inductor")
    switch(monkeypatch, compile_tail=True, chunk_pairs=7)
    stats = torch._dynamo.utils.counters["stats"]
    graphs = stats["unique_graphs"]
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=65)
    for head in (make_swiglu(seed=65, bias=True), TanhHead(7, 13).eval()):
        check_against_reference(f, b, tokens, head, backend="torch", seed=65, lengths=torch.tensor([13, 4, 11]))
    assert stats["unique_graphs"] >= graphs + 2, "the tails were not compiled"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_half_precision_torch(kind, dtype, engine):
    """docs/contract.md §6: error at most 2x that of the materialised run in the same dtype, plus 1e-3."""
    seed = 70 + (kind == "swiglu")
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = (mlp if kind == "mlp" else make_swiglu(seed=seed)).to(dtype)
    f, b = f.to(dtype), b.to(dtype)
    opts = dict(lengths=torch.tensor([13, 6, 11]), next_weight=0.3)
    go = random_grad_out(seed)
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **opts)
    mat_loss, mat_grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="reference", **opts)
    loss, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="torch", **opts)
    assert loss.dtype == torch.float32 and all(g.dtype == dtype for g in grads.values())
    err = errors(loss, grads, ref_loss, ref_grads)
    mat_err = errors(mat_loss, mat_grads, ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


def test_tied_lm_head():
    emb = nn.Embedding(13, 7)
    head = make_swiglu(seed=80).tie(emb)
    assert head.lm_head.weight is emb.weight
    assert sum(q is emb.weight for q in head.parameters()) == 1
    with pytest.raises(ValueError, match="lm_head"):
        make_swiglu().tie(nn.Embedding(12, 7))
    # The embedding's gradient is the sum of its two uses: the head's (checked against the
    # reference) and the encoder's.
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=80)
    ids = torch.tensor([[1, 2, 3]])
    grads = {}
    for backend in ("torch", "reference"):
        h = copy.deepcopy(head).double()
        enc = nn.Embedding(13, 7).double()
        enc.weight = h.lm_head.weight
        loss = belief_state_loss(f.double(), b.double(), tokens, h, backend=backend) + enc(ids).sum()
        loss.backward()
        grads[backend] = h.lm_head.weight.grad
    assert rel_err(grads["torch"], grads["reference"]) < 1e-10


def test_model_head_type_and_tying(tmp_path):
    cfg = dict(vocab_size=11, max_len=16, n_layer=1, d_model=8, n_head=2)
    model = BeliefStateTransformer(ModelConfig(**cfg, head_type="swiglu", head_tie_embedding=True))
    assert isinstance(model.head, ResidualSwiGLUHead) and model.head.hidden == 128
    assert model.head.lm_head.weight is model.forward_encoder.tok.weight
    assert isinstance(BeliefStateTransformer(ModelConfig(**cfg)).head, TextHead)
    with pytest.raises(ValueError, match="model.head_type"):
        BeliefStateTransformer(ModelConfig(**cfg, head_type="gru"))
    with pytest.raises(ValueError, match="head_tie_embedding"):
        BeliefStateTransformer(ModelConfig(**cfg, head_tie_embedding=True))
    tokens = torch.randint(0, 11, (2, 9))
    model(tokens)["total"].backward()
    assert model.forward_encoder.tok.weight.grad is not None


def test_tied_head_checkpoint_round_trip(tmp_path):
    """A run with a tied swiglu head saves (safetensors refuses shared storage: the trainer copies
    it) and loads back tied, with the trained weights."""
    from bst_fast import TrainConfig, load_model, train

    d = TrainConfig.load("configs/tiny_test.yaml").to_dict()
    d["model"].update(head_type="swiglu", head_tie_embedding=True)
    d.update(steps=3, ckpt_every=3, eval_every=3, out_dir=str(tmp_path))
    train(TrainConfig.from_dict(d))
    model, _ = load_model(tmp_path)
    assert model.head.lm_head.weight is model.forward_encoder.tok.weight
    from safetensors.torch import load_file

    from bst_fast.checkpoint import latest_checkpoint
    saved = load_file(str(latest_checkpoint(tmp_path) / "model.safetensors"))
    state = model.state_dict()
    assert saved and all(torch.equal(state[k], v) for k, v in saved.items())  # the trained weights, every one


def test_cli_sets_the_head_type():
    from bst_fast.config import apply_sets as _apply_sets
    from bst_fast import TrainConfig

    cfg = _apply_sets(TrainConfig(), ["model.head_type=swiglu", "model.head_tie_embedding=true"])
    assert cfg.model.head_type == "swiglu" and cfg.model.head_tie_embedding is True


def test_decoding_with_the_swiglu_head():
    """Planning, beam search and belief states run unchanged on the swiglu head (cached decoding:
    test_decode.test_cached_decoding_equals_full_reencoding[bst_swiglu])."""
    from test_decode import EOS, tiny_bst

    model = tiny_bst(head_type="swiglu")
    prompt, goal = [4, 0, 1], [2, 1]
    result = decode.plan(model, prompt, goal, horizon=3, rollouts=4, eos_id=EOS)
    assert len(result.candidates) == 4 and all(math.isfinite(s) for s in result.scores.tolist())
    assert decode.plan(model, prompt, [], horizon=3, rollouts=3, eos_id=EOS).best is not None
    seqs, logp = decode.beam_search(model, prompt, 3, beams=2, goal=goal, eos_id=EOS)
    assert seqs.shape == (2, 3) and torch.isfinite(logp).all()
    states = decode.belief_states(model, torch.tensor([[4, 0, 1, 2, 0]]), torch.tensor([5]))
    assert states.shape == (1, 16)


def test_star_graph_smoke_with_swiglu_head(tmp_path):
    """A short run of the star config with the swiglu head (the full run:
    bench/results/star_cpu_swiglu.md)."""
    from bst_fast import TrainConfig, train

    cfg = TrainConfig.load("configs/star_cpu_swiglu.yaml")
    assert cfg.model.head_type == "swiglu"
    d = cfg.to_dict()
    d.update(steps=40, batch_size=32, warmup=5, n_test=50, eval_every=40, log_every=10, progress=False,
             out_dir=str(tmp_path))
    result = train(TrainConfig.from_dict(d))
    assert math.isfinite(result["loss"]) and 0.0 <= result["path_accuracy"] <= 1.0
    rows = [r.split(",") for r in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    losses = [float(v) for _, key, v in rows if key == "loss"]
    assert losses[-1] < losses[0] - 0.3, losses  # it learns
    from bst_fast import load_model
    assert isinstance(load_model(tmp_path)[0].head, ResidualSwiGLUHead)  # and it was this head that did


@pytest.mark.parametrize("split16", [False, True], ids=["split32", "split16"])
@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_autocast_float32_model(kind, engine, split16, monkeypatch):
    """An fp32 model under bf16 autocast: the split layer's per-pair sum is rounded to bf16, as the
    unsplit layer's autocast output is, and the error stays within 2x that of the materialised
    objective under the same autocast, plus 1e-3; also with the split's operands in bf16 (split_16bit)."""
    switch(monkeypatch, split_16bit=split16)
    seed = 140 + (kind == "swiglu")
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    head = mlp if kind == "mlp" else make_swiglu(seed=seed)
    opts = dict(lengths=torch.tensor([13, 6, 11]))
    go = random_grad_out(seed)
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **opts)
    summed = []  # the dtype of each per-pair sum the backend hands to the head's tail
    forward = torch_backend._PairSum.forward
    monkeypatch.setattr(torch_backend._PairSum, "forward",
                        staticmethod(lambda *a: (lambda x: summed.append(x.dtype) or x)(forward(*a))))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = head.pair_parts(f, b, opts["lengths"])
        mat = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="reference", **opts)
        loss, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="torch", **opts)
    assert parts.dtypes[-1] == torch.bfloat16 and parts.dtypes[0] == (torch.bfloat16 if kind == "mlp" else torch.float32)
    # each sum in its part's dtype: bf16 as autocast rounds the unsplit layer (a swiglu part float32)
    assert summed and set(summed) == set(parts.dtypes) and torch.bfloat16 in summed
    err, mat_err = errors(loss, grads, ref_loss, ref_grads), errors(*mat, ref_loss, ref_grads)
    assert mat_err["loss"] > 1e-6  # autocast really ran in bf16
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("model", [torch.float32, torch.bfloat16])
def test_split_16bit_operands(model, compute, monkeypatch):
    """split_16bit: the split layer's products take the compute dtype's operands (a 16-bit one; a
    float32 compute keeps float32) with float32 sums, forward and backward (the backward's dA, dB
    rounded only to bfloat16: float16 keeps them and the backward float32): on the CPU exactly the
    float32 products of the rounded operands. Off, the operands are float32 whatever the compute."""
    g = torch.Generator().manual_seed(7)
    B, L, m, h = 3, 6, 5, 7
    lin = nn.Linear(2 * m, h).to(model)
    with torch.no_grad():
        for q in lin.parameters():
            q.copy_(torch.randn(q.shape, generator=g))
    f, b = torch.randn(B, L, m, generator=g).to(model), torch.randn(B, L, m, generator=g).to(model)
    lengths = torch.tensor([6, 4, 5])
    dA, dB = torch.randn(B, L, h, generator=g), torch.randn(B, L, h, generator=g)
    for on in (False, True):
        switch(monkeypatch, split_16bit=on)
        fr, br = f.clone().requires_grad_(), b.clone().requires_grad_()
        layer = copy.deepcopy(lin)
        A, Bt = split_linear(layer, fr, br, lengths, compute)
        df, db, dw = torch.autograd.grad((A * dA).sum() + (Bt * dB).sum(), [fr, br, layer.weight])
        op = compute if on and compute.itemsize == 2 else torch.float32
        back = op if op == torch.bfloat16 else torch.float32
        r = lambda x: x.to(op).float()  # an operand as the GEMM sees it
        rb = lambda x: x.to(back).float()  # the backward's
        pad = (torch.arange(L)[None, :] >= lengths[:, None])[..., None]
        fz, bz = r(f.masked_fill(pad, 0)), r(b.masked_fill(pad, 0))
        wf, wb = r(lin.weight[:, :m].detach()), r(lin.weight[:, m:].detach())
        assert A.dtype == Bt.dtype == torch.float32
        torch.testing.assert_close(A, fz @ wf.t() + lin.bias.detach().float(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(Bt, bz @ wb.t(), rtol=1e-6, atol=1e-6)
        wfb, wbb = rb(lin.weight[:, :m].detach()), rb(lin.weight[:, m:].detach())
        fb, bb = rb(f.masked_fill(pad, 0)), rb(b.masked_fill(pad, 0))
        torch.testing.assert_close(df, (rb(dA) @ wfb).masked_fill(pad, 0).to(model), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(db, (rb(dB) @ wbb).masked_fill(pad, 0).to(model), rtol=1e-6, atol=1e-6)
        want_dw = torch.cat([rb(dA).reshape(-1, h).t() @ fb.reshape(-1, m), rb(dB).reshape(-1, h).t() @ bb.reshape(-1, m)], 1)
        torch.testing.assert_close(dw, want_dw.to(model), rtol=1e-6, atol=1e-5)
        if on and op != torch.float32 and model == torch.float32:  # the rounding really happened
            assert not torch.allclose(A, f.masked_fill(pad, 0) @ lin.weight[:, :m].detach().t() + lin.bias.detach(),
                                      rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_split_16bit_reaches_every_caller(on, monkeypatch):
    """Where each backend's split layer takes its operand dtype: triton from the compute dtype it is
    given (the CUDA autocast dtype; it runs with autocast off), the torch backend from the caller's
    autocast, cpp always float32 (its engine's); float32 for all with the switch off."""
    from bst_fast import head as head_mod
    from bst_fast.backends import cpp_backend
    from bst_fast.backends.runtime import LossOptions

    switch(monkeypatch, split_16bit=on)
    seen = []
    real = head_mod._linear_f32
    monkeypatch.setattr(head_mod, "_linear_f32", lambda x, w, c: seen.append(x.dtype) or real(x, w, c))
    f, b, tokens, head = make_inputs(B=2, L=7, m=4, V=9, seed=3)  # a float32 model
    p = _pairs.prepare(f, b, tokens, 9, lengths=None, prefix_start=0, min_gap=2, max_gap=None, pairs=None,
                       next_weight=0.5, reduction="mean", generator=None)
    want = torch.bfloat16 if on else torch.float32
    pytest.importorskip("triton")
    from bst_fast.backends import triton_backend
    triton_backend.run(f, b, tokens, head, p, LossOptions(next_weight=0.5, vocab_size=9, compute_dtype=torch.bfloat16))
    assert seen == [want, want]
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        belief_state_loss(f, b, tokens, head, backend="torch")
    assert len(seen) >= 2 and set(seen) == {want}  # a probe of one row, then each window's parts
    if importlib.util.find_spec("bst_fast._C") is not None:
        seen.clear()
        cpp_backend.run(f, b, tokens, head, p, LossOptions(next_weight=0.5, vocab_size=9))
        assert seen == [torch.float32, torch.float32]


def _large_float16_gradients(seed):
    """(f, b, tokens, head): a linear head whose float16 weight gradient, summed over a chunk's
    pairs without scaling, overflows 65504."""
    m, V, B, L = 4, 5, 3, 14
    f = torch.zeros(B, L, m)
    f[..., 0] = 600.0
    b = torch.zeros(B, L, m)
    tokens = torch.zeros(B, L, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(2 * m, 2 * V)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) * 1e-3)
        head.bias.zero_()
    return f, b, tokens, head


def test_float16_parameter_gradients_do_not_overflow(engine):
    """A chunk's parameter gradient is a sum over its pairs; in float16 it must not overflow where
    the materialised run's (which carries 1/|P| inside) stays finite."""
    f, b, tokens, head = _large_float16_gradients(80)
    f16, b16, h16 = f.half(), b.half(), copy.deepcopy(head).half()
    ref_loss, ref_grads = reference64(f16, b16, tokens, h16, 1.0, next_weight=1.0)
    mat_loss, mat_grads = loss_and_grads(f16, b16, tokens, copy.deepcopy(h16), 1.0, backend="reference", next_weight=1.0)
    loss, grads = loss_and_grads(f16, b16, tokens, copy.deepcopy(h16), 1.0, backend="torch", next_weight=1.0)
    assert all(torch.isfinite(x).all() for x in grads.values() if x is not None)
    err, mat_err = errors(loss, grads, ref_loss, ref_grads), errors(mat_loss, mat_grads, ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


def test_float16_autocast_parameter_gradients_do_not_overflow(engine):
    """The same under float16 autocast with a float32 model: the head's products, and a chunk's
    weight gradient summed over its pairs, are float16 there too, so the chunk scale applies."""
    f, b, tokens, head = _large_float16_gradients(81)
    grads = {}
    for backend in ("reference", "torch"):
        h = copy.deepcopy(head)
        with torch.autocast("cpu", dtype=torch.float16):
            belief_state_loss(f, b, tokens, h, backend=backend, next_weight=1.0).backward()
        grads[backend] = h.weight.grad
    assert torch.isfinite(grads["reference"]).all()
    assert torch.isfinite(grads["torch"]).all()
    assert rel_err(grads["torch"], grads["reference"]) < 1e-2


def assert_torch_within_half_bound(f, b, tokens, head, go, **opts):
    """The torch backend's bf16 loss and gradients within 2x the materialised run's error + 1e-3
    (docs/contract.md §6), plus one rounding, 2**-8, on the head's parameters when grad_output
    go is not 1 (§6's one known excess)."""
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **opts)
    mat_err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="reference", **opts),
                     ref_loss, ref_grads)
    err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="torch", **opts), ref_loss, ref_grads)
    for name in err:
        extra = 2.0 ** -8 if go != 1.0 and name not in ("loss", "f", "b") else 0.0
        assert err[name] <= 2 * mat_err[name] + 1e-3 + extra, (name, err[name], mat_err[name])


@pytest.mark.parametrize("go", [1.0, 0.9])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_bf16_swiglu_gate_up_parts_round_once(engine, fused, go, monkeypatch):
    """The gate/up parts are summed per pair in float32 and rounded once (fused: SwiGLU of the
    float32 sums rounded once; unfused: gate and up rounded, as [f ; b] W^T is): two bf16 parts
    rounded apart broke the 2x bound on mlp.2.bias for this draw. With a grad_output that is not
    a power of two, a bf16 parameter's gradient is rounded once more (docs/contract.md §6): one
    rounding, 2**-8, is allowed on top for the parameters."""
    switch(monkeypatch, fused_swiglu=fused)
    B, L, m, V, seed = 3, 14, 6, 17, 3
    g = torch.Generator().manual_seed(seed)
    f = (torch.randn(B, L, m, generator=g) * 2).bfloat16()
    b = (torch.randn(B, L, m, generator=g) * 2).bfloat16()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(seed)
    head = ResidualSwiGLUHead(m, V, hidden=10, bias=True)
    with torch.no_grad():
        for name, q in head.named_parameters():
            q.copy_(torch.randn(q.shape) * 0.6 + (1.0 if name == "norm.weight" else 0.0))
    head = head.bfloat16()
    opts = dict(next_weight=1.0, lengths=torch.tensor([14, 5, 9]))
    assert_torch_within_half_bound(f, b, tokens, head, go, **opts)


@pytest.mark.parametrize("seed", [12, 13, 29])
def test_bf16_parameter_gradients_take_the_pair_weights_before_rounding(engine, seed):
    """bf16 parameter gradients of the layers after the first: the chunk's cross-entropy gradient
    carries the true pair weights (1/|P|), so autograd's bf16 result is the only rounding at
    grad_output 1. These draws broke the 2x bound (layers.1.weight, norm.weight, norm.bias) when
    the gradients were taken at unit weights and rescaled in float32, then rounded again."""
    f, b, tokens, head = bf16_head_draw(seed)
    opts = dict(lengths=torch.tensor([12, 6, 9]), next_weight=0.3)
    assert_torch_within_half_bound(f, b, tokens, head, 1.0, **opts)


@pytest.mark.parametrize("B, L, m, V, hidden, n_layers, act, seed, opts", [
    (1, 4, 4, 2, 7, 2, "silu", 1014, dict(next_weight=1.0, reduction="sum")),
    (1, 5, 5, 7, 3, 3, "leaky_relu", 1021, dict(next_weight=1.0)),
    (1, 8, 6, 2, 8, 3, "gelu", 1027, dict(next_weight=1.0)),
    (1, 7, 5, 7, 5, 3, "silu", 1049, dict(reduction="sum")),
    (1, 6, 1, 3, 3, 2, "gelu", 1052, dict(next_weight=0.0, reduction="sum")),
])
def test_bf16_cross_entropy_gradient_is_rounded_once(B, L, m, V, hidden, n_layers, act, seed, opts):
    """The torch ops' cross-entropy forms the logits' gradient in float32 and rounds it once to
    bf16, as the materialised run and the Triton kernel do. Formed in bf16 step by step (exp, the
    scale, the one-hot subtraction each rounded) it broke the 2x bound in these tiny draws, from an
    independent review's 150 (reduction sum too, so not the pair weights)."""
    g = torch.Generator().manual_seed(seed)
    f, b = torch.randn(B, L, m, generator=g).bfloat16(), torch.randn(B, L, m, generator=g).bfloat16()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(seed)
    head = TextHead(m, V, hidden=hidden, n_layers=n_layers, activation=act)
    with torch.no_grad():
        for q in head.parameters():
            q.mul_(2.0)
    head = head.bfloat16()
    assert_torch_within_half_bound(f, b, tokens, head, 1.0, **opts)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_double_backward_is_an_error(backend):
    """The fused and chunked backends compute their gradients in the forward pass: a backward with
    create_graph=True raises instead of returning second derivatives without the head's terms."""
    f, b, tokens, head = make_inputs(B=2, L=8, m=6, V=11, seed=5)
    f.requires_grad_()
    loss = belief_state_loss(f, b, tokens, head, backend=backend)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, f, create_graph=True)
    (gf,) = torch.autograd.grad(belief_state_loss(f, b, tokens, head, backend=backend), f)  # first order still works
    (gr,) = torch.autograd.grad(belief_state_loss(f, b, tokens, head, backend="reference"), f)
    torch.testing.assert_close(gf, gr, rtol=1e-4, atol=1e-6)


def _tiny_inputs(seed):
    """f, b (2, 6, 3) float64 and tokens over V=4: for heads that ignore their input."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)
    b = torch.randn(2, 6, 3, dtype=torch.float64, generator=g)
    return f, b, torch.randint(0, 4, (2, 6), generator=g)


class _ExpandedLogits(nn.Module):
    """Logits that are a view (an expand) of a parameter: the in-place cross-entropy must not write
    its gradient into the parameter."""

    def __init__(self, V):
        super().__init__()
        self.vocab_size = V
        self.logit = nn.Parameter(torch.randn(2 * V, dtype=torch.float64, generator=torch.Generator().manual_seed(81)))

    def forward(self, x):
        return self.logit.expand(x.shape[0], -1)


@pytest.mark.parametrize("n_pairs", [1, 3])
def test_logits_viewing_a_parameter_are_not_overwritten(n_pairs):
    f, b, tokens = _tiny_inputs(82)
    head = _ExpandedLogits(4)
    before = head.logit.detach().clone()
    pairs = (torch.tensor([0, 1, 1])[:n_pairs], torch.tensor([0, 1, 2])[:n_pairs], torch.tensor([3, 4, 5])[:n_pairs])
    loss = belief_state_loss(f, b, tokens, head, pairs=pairs, backend="torch")
    assert torch.equal(head.logit.detach(), before)
    ref = belief_state_loss(f, b, tokens, head, pairs=pairs, backend="reference")
    assert rel_err(loss, ref) < 1e-12


class _BufferRows(nn.Module):
    """Logits that are a contiguous slice of a buffer (no parameter, no saved tensor), plus a
    learned bias so that there is a gradient: the buffer must survive the in-place cross-entropy."""

    def __init__(self, V, n):
        super().__init__()
        self.vocab_size = V
        self.register_buffer("table", torch.randn(n, 2 * V, dtype=torch.float64, generator=torch.Generator().manual_seed(83)))
        self.scale = nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.table[: x.shape[0]] if not torch.is_grad_enabled() else self.table[: x.shape[0]] * self.scale


def test_logits_viewing_a_buffer_are_not_overwritten():
    f, _, tokens = _tiny_inputs(84)
    head = _BufferRows(4, 40)
    before = head.table.clone()
    with torch.no_grad():  # no grad: the logits are the buffer's rows themselves
        loss = belief_state_loss(f, f, tokens, head, backend="torch")
    assert torch.equal(head.table, before)
    assert rel_err(loss, belief_state_loss(f, f, tokens, head, backend="reference")) < 1e-12


class _CachedRows(nn.Module):
    """Logits that are rows of a tensor with a grad_fn made before the loss (param + 1, kept by the
    head): not the chunk's own result, so the in-place cross-entropy must not write into it."""

    def __init__(self, V, n):
        super().__init__()
        self.vocab_size = V
        self.param = nn.Parameter(torch.randn(n, 2 * V, dtype=torch.float64, generator=torch.Generator().manual_seed(86)))
        self.table = self.param + 1.0

    def forward(self, x):
        return self.table[: x.shape[0]]


def test_logits_viewing_an_earlier_result_are_not_overwritten():
    f, _, tokens = _tiny_inputs(87)
    head = _CachedRows(4, 40)
    before = head.table.detach().clone()
    belief_state_loss(f, f, tokens, head, backend="torch").backward()
    assert torch.equal(head.table.detach(), before)
    assert head.param.grad is not None


@pytest.mark.parametrize("kind", ["mlp", "swiglu"])
def test_the_heads_logits_are_overwritten_without_a_copy(monkeypatch, kind):
    """Both heads' logits are fresh tensors of the chunk (the SwiGLU head's a flatten, a view, of
    lm_head's output): the cross-entropy writes the gradient into them, with no copy of the logits."""
    f, b, tokens, mlp = make_inputs(B=3, L=13, m=7, V=13, seed=85)
    head = mlp if kind == "mlp" else make_swiglu(seed=85)
    f.requires_grad_()
    copies, made, written = [], [], []
    for name in ("clone", "copy_"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _real=real, **k:
                            copies.append(tuple(t.shape)) or _real(t, *a, **k))
    tail, ce = torch_backend._call_tail, torch_chunks._cross_entropy_
    def spied_tail(*a):
        out = tail(*a)
        made.append(out.data_ptr())
        return out
    monkeypatch.setattr(torch_backend, "_call_tail", spied_tail)
    monkeypatch.setattr(torch_chunks, "_cross_entropy_", lambda z, *a: written.append(z.data_ptr()) or ce(z, *a))
    belief_state_loss(f, b, tokens, head, backend="torch").backward()
    assert not [s for s in copies if s[-1:] in ((13,), (2 * 13,))], copies  # no copy of (n, 2V) logits
    assert written and written == made[-len(written):]  # the gradient goes into the tail's own logits


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("chunk", [None, 333])
def test_torch_backend_on_a_gpu(monkeypatch, chunk, engine):
    """On a GPU, at widths above one kernel block and chunks across rows: float32 at
    docs/contract.md §6's tolerances, both heads, both engines; with the Triton engine (the default
    there) two runs are bitwise equal."""
    switch(monkeypatch, chunk_pairs=chunk)
    dev = torch.device("cuda")
    f, b, tokens, mlp = make_inputs(B=3, L=61, m=72, V=517, hidden=[160, 96], n_layers=3, seed=150)
    lengths = torch.tensor([61, 40, 23])
    for head in (mlp, make_swiglu(m=72, V=517, hidden=300, seed=150, scale=0.2)):
        check_against_reference(f.to(dev), b.to(dev), tokens.to(dev), head.to(dev), backend="torch", seed=150,
                                lengths=lengths.to(dev))
        if engine[0] == "triton":
            runs = [loss_and_grads(f.to(dev), b.to(dev), tokens.to(dev), copy.deepcopy(head).to(dev), 1.3,
                                   backend="torch", pairs=0.5, generator=torch.Generator().manual_seed(1))
                    for _ in range(2)]
            assert torch.equal(runs[0][0], runs[1][0])
            assert all(torch.equal(x, runs[1][1][k]) for k, x in runs[0][1].items() if x is not None)


def test_float16_tiny_pair_weights_keep_their_digits(monkeypatch):
    """A mean over a million pairs weighs each by ~1e-6: w * (softmax - onehot) is subnormal in
    float16. The torch backend works in units of the largest weight, scaled by 1/sqrt(n), and
    multiplies the scale back in its float32 accumulators, so the gradients keep their digits."""
    switch(monkeypatch, chunk_pairs=7)
    f, b, tokens, head = make_inputs(B=1, L=9, m=5, V=13, seed=10)
    loss_err, grad_errs = tiny_weight_float16_errors(torch_backend.run, f, b, tokens, head, 13, scale=2e-6)
    assert loss_err < 1e-2 and max(grad_errs) < 2e-2, grad_errs
    # Windows of one row under a loss scale: each window's sums map to f, b and the first layer
    # through the head's float16 backward before the scale reaches them, so in units of the pair
    # weights (in true units, 1e-8 a pair, they would be all but lost to float16's subnormals there)
    switch(monkeypatch, window_rows=1)
    for kind in ("mlp", "swiglu"):
        f, b, tokens, mlp = make_inputs(B=3, L=9, m=5, V=13, seed=11)
        head = mlp if kind == "mlp" else make_swiglu(m=5, V=13, seed=11)
        loss_err, grad_errs = tiny_weight_float16_errors(torch_backend.run, f, b, tokens, head, 13, scale=1e-8,
                                                         grad_output=65536.0)
        assert loss_err < 1e-2 and max(grad_errs) < 2e-2, (kind, grad_errs)


def test_float16_windows_keep_parameter_gradients_finite():
    """A window's sums mapped to the split layer's parameters through the head's float16 backward:
    a first-layer bias gradient of 100 (every pair's) stays 100, not inf. In the units of a position's
    sum (wscale * L) it was about 740 times larger, past 65504, whatever grad_output (an independent
    review's case); the materialised float16 run keeps it finite."""
    torch.manual_seed(0)
    B, L, m, h, V = 24, 64, 4, 8, 5
    head = TextHead(m, V, hidden=h, n_layers=2, activation="relu")
    with torch.no_grad():
        head.layers[0].weight.mul_(0.1)
        head.layers[0].bias.fill_(1.0)  # relu' = 1 everywhere
        head.layers[1].weight.zero_()
        head.layers[1].bias.zero_()
        for half in (0, V):  # every pair predicts token 1 while every label is 0: dz1 ~ 100 a pair
            head.layers[1].weight[half + 1].fill_(5.0)
            head.layers[1].weight[half].fill_(-95.0)
    tokens = torch.zeros(B, L, dtype=torch.long)
    f, b = torch.randn(B, L, m), torch.randn(B, L, m)
    grads = {}
    for backend, dtype in (("reference", torch.float64), ("torch", torch.float16)):
        hh = copy.deepcopy(head).to(dtype)
        ff, bb = f.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        loss = belief_state_loss(ff, bb, tokens, hh, backend=backend)
        grads[backend] = torch.autograd.grad(loss * 2.0 ** -4, [ff, bb, *hh.parameters()])
    for got, want in zip(grads["torch"], grads["reference"]):
        assert torch.isfinite(got).all()
        assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("window_rows, chunk", [(None, None), (1, 97), (None, 4000)])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("kind", ["text", "swiglu"])
def test_float16_row_mean_with_rows_of_unequal_weight(kind, backend, window_rows, chunk, monkeypatch):
    """row_mean (docs/contract.md §9) over rows of 200 and of 3 positions weighs a pair of the long
    rows 1/19701 of the short rows' one. float16 keeps both within §6's bound: the chunk's gradient
    scale and the window's mapping units follow the weights of its pairs (Chunk.half_scale), not
    only the largest weight, which put the long rows' per-pair terms below float16's subnormals (an
    independent review: errors of 3-49% on every gradient of the torch backend)."""
    if backend == "cpp":
        if kind == "swiglu" or window_rows is not None:
            pytest.skip("the cpp backend takes a TextHead, and has no windows")
        pytest.importorskip("bst_fast._C")
    switch(monkeypatch, window_rows=window_rows, chunk_pairs=chunk)
    B, L, m, V = 3, 200, 12, 13
    g = torch.Generator().manual_seed(5)
    f, b = torch.randn(B, L, m, generator=g).half(), torch.randn(B, L, m, generator=g).half()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(5)
    head = (TextHead(m, V, hidden=24) if kind == "text" else ResidualSwiGLUHead(m, V, hidden=16, bias=True)).half()
    opts = dict(lengths=torch.tensor([L, 3, L - 7]), reduction="row_mean")
    ref_loss, ref_grads = reference64(f, b, tokens, head, 1.0, **opts)
    mat_err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="reference", **opts),
                     ref_loss, ref_grads)
    err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend=backend, **opts),
                 ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


def test_float16_row_mean_heavy_pair_among_light_ones_stays_finite(monkeypatch):
    """A row of 3 positions (one pair, weight 1 in wscale's units) in one float16 chunk of 65536
    pairs with a row of 600 (179101 pairs, 2**-17.5 each), activations of a few hundred: scaled
    for the chunk's average weight, sqrt(n) / wsum = 2**8, the heavy pair's own term overflowed the
    output layer's weight gradient (an independent review); capped at 2**4 / wmax it is finite and
    within docs/contract.md §6's bound, as the materialised float16 run is."""
    switch(monkeypatch, chunk_pairs=65536)
    B, L, m, V = 2, 600, 16, 50
    g = torch.Generator().manual_seed(1)
    f, b = ((torch.randn(B, L, m, generator=g) * 1024).half() for _ in range(2))
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(1)
    head = TextHead(m, V, hidden=32).half()
    opts = dict(lengths=torch.tensor([3, L]), reduction="row_mean")
    ref_loss, ref_grads = reference64(f, b, tokens, head, 1.0, **opts)
    mat_err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="reference", **opts),
                     ref_loss, ref_grads)
    loss, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="torch", **opts)
    assert all(torch.isfinite(g).all() for g in grads.values())
    err = errors(loss, grads, ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


def test_float16_split_parameters_keep_their_digits():
    """The SwiGLU head's gate_up gradient, a float32 sum over every position rounded once to
    float16 by the head's backward: in units of the window's total weight (its pairs, under
    reduction="sum") the terms of random sign averaged to about 1e-4 at their largest, so that its
    smaller elements lost digits to float16's subnormals (errors of 0.8-1%, 7 times the bound, an
    independent review); a largest result below 2**-4 is mapped again at 2**8 (_mapped_float16)."""
    B, L, m, V = 3, 200, 12, 13
    g = torch.Generator().manual_seed(5)
    f, b = torch.randn(B, L, m, generator=g).half(), torch.randn(B, L, m, generator=g).half()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(5)
    head = ResidualSwiGLUHead(m, V, hidden=16, bias=True).half()
    opts = dict(lengths=torch.tensor([L, 3, L - 7]), reduction="sum")
    ref_loss, ref_grads = reference64(f, b, tokens, head, 1.0, **opts)
    mat_err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="reference", **opts),
                     ref_loss, ref_grads)
    err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="torch", **opts),
                 ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])


def test_float16_chunk_scale_follows_its_weights():
    """Chunk.half_scale: a power of two; equal weights give 1/sqrt(n) (summed) and 1; rows of
    unequal weight put the average (summed) or the geometric middle (not summed) near 1, the
    heaviest pair's term at most 2**4 (summed: one heavy pair among light ones had sqrt(n) times
    its term, and a review's head overflowed) or 2**8."""
    def chunk(n, wsum, wmin, wmax):
        return _pairs.Chunk(0, n, 0, 1, 0, 1, wsum, wmin, wmax)
    assert chunk(4096, 4096.0, 1.0, 1.0).half_scale(True) == 2.0**-6
    assert chunk(4096, 4096.0, 1.0, 1.0).half_scale(False) == 1.0
    light = chunk(1000, 1000 * 2.0**-10, 2.0**-10, 2.0**-10)  # a chunk of a long row's pairs
    assert light.half_scale(False) == 2.0**10
    assert light.half_scale(True) == 2.0 ** round(math.log2(1000**0.5 * 2**10 / 1000))
    mixed = chunk(1000, 1.0 + 999 * 2.0**-20, 2.0**-20, 1.0)  # one heavy pair among light ones
    assert mixed.half_scale(False) == 2.0**8  # sqrt(2**20) = 2**10, capped
    assert mixed.half_scale(True) == 2.0**4  # sqrt(1000) / 1.001 = 2**5, capped at 2**4 / wmax



def _within_float16_bound(f, b, tokens, head, go, **opts):
    """The torch backend's float16 loss and gradients within docs/contract.md §6's bound (2x the
    materialised float16 run's error + 1e-3; one rounding more on the parameters, 2**-11, where go
    is not a power of two)."""
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **opts)
    mat_err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="reference", **opts),
                     ref_loss, ref_grads)
    err = errors(*loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="torch", **opts), ref_loss, ref_grads)
    for name in err:
        extra = 2.0**-11 if math.log2(abs(go)) % 1 and name not in ("loss", "f", "b") else 0.0
        assert err[name] <= 2 * mat_err[name] + 1e-3 + extra, (name, err[name], mat_err[name])


@pytest.mark.parametrize("mul", [2.0**-12, 2.0**-16, 2.0**-20])
def test_float16_loss_scale_reaches_the_chunks(mul):
    """A float16 head's per-pair gradients under a GradScaler's loss scale of 65536, with a last layer
    of tiny weights: the chunks' gradients are computed in the backward, at the scale the
    materialised run's per-pair gradients have (grad_output times the pair weights). Computed in
    the forward, before the loss scale was known, the first layer's and f's and b's gradients fell
    to float16's subnormals (errors of 2%, 25% and 100% against bounds near 2e-3); and at 2**-20
    the mapped first-layer gradients fell to zero in their units (mapped again 2**24 smaller)."""
    g = torch.Generator().manual_seed(16)
    B, L, m, V = 2, 40, 8, 13
    f, b = torch.randn(B, L, m, generator=g).half(), torch.randn(B, L, m, generator=g).half()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(16)
    head = TextHead(m, V, hidden=16).half()
    with torch.no_grad():
        head.layers[-1].weight.mul_(mul)
    _within_float16_bound(f, b, tokens, head, 65536.0, lengths=torch.tensor([L, L]), reduction="mean")


@pytest.mark.parametrize("go", [1.0, 0.7])
def test_float16_sum_keeps_the_materialised_scale(go):
    """reduction="sum" weighs every pair 1, so the materialised float16 run's per-pair gradients are
    O(1): a chunk scaled down to 1 / sqrt(n) (Chunk.half_scale) put the SwiGLU head's per-pair
    gradients, behind a LayerNorm of large inputs (f and b 16 times larger), among the subnormals:
    gate_up's gradients had errors of 0.4-0.6% against a bound of 0.16%. The larger scale wins."""
    g = torch.Generator().manual_seed(14)
    B, L, m, V = 3, 60, 12, 13
    f, b = (torch.randn(B, L, m, generator=g) * 16).half(), (torch.randn(B, L, m, generator=g) * 16).half()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(14)
    head = ResidualSwiGLUHead(m, V, hidden=16, bias=True).half()
    _within_float16_bound(f, b, tokens, head, go, lengths=torch.tensor([L, 3, 50]), reduction="sum")



def test_float16_overflowing_chunks_run_again_smaller():
    """First-layer activations in the thousands (f and b 2048 times larger) under reduction="mean":
    scaled for 1/sqrt(n) a pair (Chunk.half_scale), the last layer's weight gradient over a chunk of
    3081 pairs overflowed float16 (an independent review's case, at 1024) where the materialised
    run, at 1/|P| a pair, is finite; the window runs again at scales 2**8 times smaller and is
    finite and within the bound."""
    g = torch.Generator().manual_seed(8)
    B, L, m, V = 1, 80, 10, 30
    f, b = ((torch.randn(B, L, m, generator=g) * 2048).half() for _ in range(2))
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = TextHead(m, V, hidden=14)
    with torch.no_grad():
        for q in head.parameters():
            q.copy_(torch.randn(q.shape, generator=g))
        head.layers[-1].weight.mul_(2.0**-10)
    head = head.half()
    loss, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), 1.0, backend="torch")
    assert all(torch.isfinite(x).all() for x in grads.values())
    _within_float16_bound(f, b, tokens, head, 1.0)

class _MaskedHead(nn.Module):
    """A head whose per-pair work draws from the global RNG (a dropout of rows, drawn in float32 so
    that float16 and float32 copies draw the same mask) and records whether autocast was on."""

    def __init__(self, m, V, h=12, act=torch.tanh, keep=0.5):
        super().__init__()
        self.inp, self.out, self.autocast, self.rows = nn.Linear(2 * m, h), nn.Linear(h, 2 * V), [], []
        self.act, self.keep = act, keep

    def forward(self, x):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        self.rows.append(x.shape[0])
        keep = (torch.rand(x.shape[0], 1) < self.keep).to(x.dtype)
        return self.out(self.act(self.inp(x)) * keep)


def test_float16_backward_replays_the_forward(monkeypatch):
    """The float16 gradients are computed in the backward (at grad_output's scale): from the RNG
    state the forward started with, so that a head's random draws are the forward's (the gradients
    of the masks that made the loss, against a float32 run of the same draws, where fresh draws
    give errors of order 1), without moving the caller's RNG; and under the forward's autocast
    (a float32 head under float16 autocast, its backward called outside it)."""
    switch(monkeypatch, chunk_pairs=50)
    g = torch.Generator().manual_seed(3)
    B, L, m, V = 2, 20, 6, 7
    f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = _MaskedHead(m, V)
    runs = {}
    for dtype in (torch.float32, torch.float16):
        hh = copy.deepcopy(head).to(dtype)
        torch.manual_seed(7)
        loss, grads = loss_and_grads(f.to(dtype), b.to(dtype), tokens, hh, 1.0, backend="torch")
        runs[dtype] = loss, grads
    assert rel_err(runs[torch.float16][0], runs[torch.float32][0]) < 1e-2
    for name, g32 in runs[torch.float32][1].items():
        assert rel_err(runs[torch.float16][1][name], g32) < 2e-2, name
    # the caller's RNG: where the forward left it
    ff, bb = f.half().requires_grad_(), b.half().requires_grad_()
    hh = copy.deepcopy(head).half()
    loss = belief_state_loss(ff, bb, tokens, hh, backend="torch")
    state = torch.get_rng_state()
    loss.backward()
    assert torch.equal(torch.get_rng_state(), state)
    # autocast: the forward's, in the backward too
    hh = copy.deepcopy(head)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = belief_state_loss(f.requires_grad_(), b, tokens, hh, backend="torch")
    forward_calls = len(hh.autocast)
    loss.backward()
    assert len(hh.autocast) > forward_calls and all(hh.autocast), hh.autocast


def _float32_and_float16_runs(f, b, tokens, head, log, configure=lambda dtype: None):
    """{dtype: (loss, gradients of f, b and the head's parameters, the head's `log` list as the
    forward left it, what the backward added)} of a copy of `head` in float32 and in float16, each
    from the same RNG state (`configure(dtype)` first, e.g. to set switches)."""
    runs = {}
    for dtype in (torch.float32, torch.float16):
        configure(dtype)
        hh = copy.deepcopy(head).to(dtype)
        ff, bb = f.to(dtype).requires_grad_(), b.to(dtype).requires_grad_()
        torch.manual_seed(7)
        loss = belief_state_loss(ff, bb, tokens, hh, backend="torch")
        forward_log = list(getattr(hh, log))
        grads = torch.autograd.grad(loss, [ff, bb, *hh.parameters()])
        runs[dtype] = loss, grads, forward_log, getattr(hh, log)[len(forward_log):]
    return runs


def _float16_matches_float32(runs):
    (loss16, grads16, *_), (loss32, grads32, *_) = runs[torch.float16], runs[torch.float32]
    assert rel_err(loss16, loss32) < 1e-3
    for g16, g32 in zip(grads16, grads32):
        assert torch.isfinite(g16).all() and rel_err(g16, g32) < 2e-2


def test_float16_window_run_again_draws_what_the_forward_drew():
    """A float16 window that overflowed runs again (first-layer activations in the thousands, as in
    test_float16_overflowing_chunks_run_again_smaller) from the RNG state its first attempt started
    from: a head's dropout masks are the forward's in every attempt, and the gradients match a
    float32 run of the same draws (an independent review found the rerun drawing fresh masks:
    errors of 14% on f)."""
    g = torch.Generator().manual_seed(8)
    B, L, m, V = 1, 80, 10, 30
    f, b = (torch.randn(B, L, m, generator=g) * 2048 for _ in range(2))
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = _MaskedHead(m, V, h=14, act=torch.relu, keep=0.75)
    with torch.no_grad():
        for q in head.parameters():
            q.copy_(torch.randn(q.shape, generator=g))
        head.out.weight.mul_(2.0**-10)
    runs = _float32_and_float16_runs(f, b, tokens, head, "rows")
    forward_rows, backward_rows = runs[torch.float16][2:]
    forward_chunks = [n for n in forward_rows if n > 1]  # (not the one-pair probe of the head's shape)
    assert len(backward_rows) > len(forward_chunks)  # a window ran again
    _float16_matches_float32(runs)


class _DropoutParts(nn.Module):
    """A head that draws in pair_parts (a dropout of its prefix part), and logs each call's rows and
    zeros."""

    def __init__(self, m, V, h=8):
        super().__init__()
        self.p, self.q, self.out, self.m, self.calls = nn.Linear(m, h), nn.Linear(m, h, bias=False), nn.Linear(h, 2 * V), m, []

    def forward(self, x):  # (only the vocabulary probe: the loss reads pair_parts)
        return self.out(torch.relu(self.p(x[..., : self.m]) + self.q(x[..., self.m :])))

    def pair_parts(self, f, b, lengths):
        P = F.dropout(self.p(f), 0.5, True)
        self.calls.append((f.shape[0], int((P == 0).sum())))
        return PairParts([P], [self.q(b)], [P.dtype], lambda xs: self.out(torch.relu(xs[0])))


def test_float16_backward_runs_the_forward_windows(monkeypatch):
    """The deferred float16 forward makes the windows its backward makes (sized with the gradient
    sums the backward holds), so pair_parts is called for the same rows and draws the same masks:
    the loss and the gradients come from one set of draws, those of a float32 run with the same
    windows. An independent review found the forward's one window of 4 rows against the backward's
    windows of 1, 2, 2, 2 and 1 (gradient errors of 33-71%)."""
    g = torch.Generator().manual_seed(0)
    B, L, m, V = 4, 16, 6, 7
    f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = _DropoutParts(m, V)
    runs = _float32_and_float16_runs(f, b, tokens, head, "calls", lambda dtype: switch(
        monkeypatch, chunk_pairs=40, torch_chunk_bytes=16 * 3000, window_rows=None if dtype == torch.float16 else 1))
    forward16, backward16 = runs[torch.float16][2:]
    assert len(forward16) > 2 and backward16 == forward16  # windows of 1 or 2 rows, replayed
    assert runs[torch.float32][2] == forward16  # the float32 run drew the same masks
    _float16_matches_float32(runs)


def test_float16_pair_parts_reaching_another_tensor_is_refused_in_the_forward():
    """float16 computes its gradients in the backward, but a part that reads another tensor that
    requires grad is still refused where the loss is made (the first window's parts are built with
    their graph to check it)."""
    gain = torch.full((4,), 1.5, dtype=torch.float16, requires_grad=True)
    f, b, tokens, _ = make_inputs(B=2, L=9, m=4, V=5, seed=3, dtype=torch.float16)
    head = _GainHead(gain).half()
    with pytest.raises(ValueError, match="pair_parts uses a tensor that requires grad besides f, b"):
        belief_state_loss(f.requires_grad_(), b, tokens, head, backend="torch")

def _split_linear_by_autograd(linear, f, b, lengths):
    """split_linear as autograd would run it through F.linear of float32 copies (the definition the
    custom backward must equal)."""
    f, b = zero_padding(f, lengths), zero_padding(b, lengths)
    dtype = torch.float64 if f.dtype == torch.float64 else torch.float32
    m = f.shape[-1]
    return (F.linear(f.to(dtype), linear.weight[:, :m].to(dtype), None if linear.bias is None else linear.bias.to(dtype)),
            F.linear(b.to(dtype), linear.weight[:, m:].to(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("bias", [True, False])
def test_split_linear_backward_and_what_it_keeps(dtype, bias):
    """split_linear's own backward gives the values of autograd through F.linear of the padded float32
    copies, bitwise, with NaN at padding kept out of every gradient; and it keeps f and b themselves
    for the backward, no float32 copy of either (8 bytes a unit for bf16 states). (float32 operands:
    split_16bit off, whatever the environment says.)"""
    from bst_fast.backends import runtime as rt
    g = torch.Generator().manual_seed(81)
    lin = nn.Linear(14, 9, bias=bias).to(dtype)
    f, b = [torch.randn(3, 5, 7, generator=g).to(dtype).requires_grad_() for _ in range(2)]
    with torch.no_grad():
        f[1, 3:] = float("nan")
        b[2] = float("inf")
    lengths = torch.tensor([5, 3, 0])
    dA, dB = torch.randn(3, 5, 9, generator=g), torch.randn(3, 5, 9, generator=g)
    results = []
    for fn in (_split_linear_by_autograd, split_linear):
        saved = []
        with rt.switched(split_16bit=False), \
                torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            A, B = fn(lin, f, b, lengths)
        grads = torch.autograd.grad((A * dA.to(A.dtype)).sum() + (B * dB.to(B.dtype)).sum(), [f, b, *lin.parameters()])
        results.append(([A, B, *grads], saved))
    (want, _), (got, saved) = results
    for w, x in zip(want, got):
        assert torch.equal(w, x)
    assert all(torch.isfinite(x).all() for x in got[2:])
    big = [t for t in saved if t.numel() == f.numel()]
    assert {t.data_ptr() for t in big} == {f.data_ptr(), b.data_ptr()} and all(t.dtype == dtype for t in big)


def test_split_linear_second_derivative():
    """The custom backward is itself differentiable (gradgradcheck in float64), with and without lengths."""
    lin = nn.Linear(6, 4).double()
    f, b = [torch.randn(2, 3, 3, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    for lengths in (torch.tensor([3, 1]), None):
        fn = lambda f, b, w, c: split_linear(_Fixed(w, c), f, b, lengths)
        assert torch.autograd.gradcheck(fn, (f, b, lin.weight, lin.bias))
        assert torch.autograd.gradgradcheck(fn, (f, b, lin.weight, lin.bias))


class _Fixed:
    """A stand-in Linear whose weight and bias are the given tensors (for gradcheck)."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias


# ---- a TextHead that computes other than its weights say (review helper-36)

class _Scaled(TextHead):
    def forward(self, x):
        return 2.0 * super().forward(x)


class _LoRALinear(nn.Linear):
    def __init__(self, a, o):
        super().__init__(a, o)
        self.A, self.B = nn.Parameter(torch.randn(2, a)), nn.Parameter(torch.randn(o, 2))

    def forward(self, x):
        return super().forward(x) + x @ self.A.t() @ self.B.t()


def _changed_head(kind):
    torch.manual_seed(3)
    if kind == "subclass":
        return _Scaled(3, 5, hidden=4)
    h = TextHead(3, 5, hidden=4)
    if kind == "lora":
        h.layers[0], h.layers[1] = _LoRALinear(6, 4), _LoRALinear(4, 10)
    elif kind == "no bias":
        h.layers[1] = nn.Linear(4, 10, bias=False)
    elif kind == "hook":
        h.layers[1].register_forward_hook(lambda module, inputs, out: 3.0 * out)
    elif kind == "backward hook":  # zeroes the gradient reaching the last layer's input
        h.layers[1].register_full_backward_pre_hook(lambda module, grad_out: (torch.zeros_like(grad_out[0]),))
    elif kind == "object forward":  # bound methods: a deepcopy rebinds them to the copy
        h.layers[1].forward = types.MethodType(lambda self, x: 3.0 * F.linear(x, self.weight, self.bias), h.layers[1])
    else:
        h.forward = types.MethodType(lambda self, x: 3.0 * TextHead.forward(self, x), h)
    return h


@pytest.mark.parametrize("kind,why", [("subclass", "overrides TextHead.forward"), ("lora", "layers\\[0\\] is a _LoRALinear"),
                                      ("no bias", "layers\\[1\\] has no bias"), ("hook", "forward hook"),
                                      ("backward hook", "backward hook"),
                                      ("object forward", "layers\\[1\\].forward is replaced on the object"),
                                      ("head forward", "its forward is replaced on the object")])
def test_a_text_head_computing_other_than_its_weights_runs_whole(kind, why):
    """The fused backends read a TextHead's weights and biases: a subclass's forward, a wrapped or
    bias-less layer or a hook made them compute another loss silently (cpp/triton/auto, and torch's
    split). auto and torch now run the head itself; cpp and triton refuse, naming why."""
    from bst_fast.backends.pair_loss_op import fused_problem

    head = _changed_head(kind)
    torch.manual_seed(4)
    f, b = torch.randn(2, 7, 3, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 7))
    want, want_grads = loss_and_grads(f, b, tokens, copy.deepcopy(head).double(), 1.0, backend="reference")
    if kind == "backward hook":  # the torch backend makes the gradients in its forward: no hook can run there
        with pytest.raises(ValueError, match="backward hook registered on the head cannot run; use backend='reference'"):
            belief_state_loss(f.float(), b.float(), tokens, head, backend="torch")
    for backend in ("auto", "torch") if kind != "backward hook" else ("auto",):  # auto: the reference
        got, grads = loss_and_grads(f.float(), b.float(), tokens, copy.deepcopy(head), 1.0, backend=backend)
        assert abs(float(got) - float(want)) < 1e-5 * abs(float(want)), (backend, got, want)
        assert set(grads) == set(want_grads) and len(grads) == 2 + len(list(head.parameters()))
        for name, w in want_grads.items():
            assert grads[name] is not None and torch.allclose(grads[name].double(), w, rtol=1e-4, atol=1e-5), \
                (backend, name)
    # the advice names a backend that takes the head: torch computes a hooked head's gradients in its forward
    advice = "reference" if kind == "backward hook" else "torch"
    with pytest.raises(ValueError, match=f"backend='cpp' computes a TextHead.*{why}.*backend='{advice}'"):
        belief_state_loss(f.float(), b.float(), tokens, head, backend="cpp")
    assert why.replace("\\", "") in fused_problem("triton", head, torch.float32)


class _ScaledSwiGLU(ResidualSwiGLUHead):
    def forward(self, x):
        return super().forward(2.0 * x)


def _changed_swiglu_head(kind):
    torch.manual_seed(6)
    if kind == "subclass":
        h = _ScaledSwiGLU(3, 5, hidden=4, bias=True)
    else:
        h = ResidualSwiGLUHead(3, 5, hidden=4, bias=True)
    for p in h.parameters():  # away from the zero biases and unit norm of the initialisation
        nn.init.normal_(p, std=0.5)
    if kind == "lora":
        h.mlp[0].gate_up = _LoRALinear(6, 8)
    elif kind == "gate_up hook":
        h.mlp[0].gate_up.register_forward_hook(lambda module, inputs, out: 3.0 * out)
    elif kind == "head hook":
        h.register_forward_pre_hook(lambda module, inputs: (0.5 * inputs[0],))
    elif kind == "object forward":
        h.mlp[0].forward = types.MethodType(lambda self, x: 3.0 * swiglu(*self.gate_up(x).chunk(2, dim=-1)), h.mlp[0])
    return h


@pytest.mark.parametrize("kind,why", [("subclass", "overrides ResidualSwiGLUHead.forward"),
                                      ("lora", "mlp\\[0\\].gate_up is a _LoRALinear"),
                                      ("gate_up hook", "forward hook"), ("head hook", "forward hook"),
                                      ("object forward", "mlp\\[0\\].forward is replaced on the object")])
def test_a_swiglu_head_computing_other_than_its_weights_runs_whole(kind, why):
    """The torch backend's split of a ResidualSwiGLUHead reads gate_up's weights and calls neither the
    head's forward nor mlp[0]: a subclass's forward, an adapter on gate_up or a forward hook there or on
    the head was skipped silently (the loss of the plain head, no gradient for the adapter). auto and
    torch now run such a head whole, and agree with the reference."""
    from bst_fast.head import swiglu_head_changes

    head = _changed_swiglu_head(kind)
    assert swiglu_head_changes(_changed_swiglu_head("plain")) is None
    assert re.search(why, swiglu_head_changes(head))
    torch.manual_seed(7)
    f, b = torch.randn(2, 7, 3, dtype=torch.float64), torch.randn(2, 7, 3, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 7))
    want, want_grads = loss_and_grads(f, b, tokens, copy.deepcopy(head).double(), 1.0, backend="reference")
    plain, _ = loss_and_grads(f, b, tokens, _changed_swiglu_head("plain").double(), 1.0, backend="reference")
    assert abs(float(plain) - float(want)) > 1e-3  # the change changes the loss
    for backend in ("auto", "torch"):
        got, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head).double(), 1.0, backend=backend)
        assert abs(float(got) - float(want)) < 1e-10 * abs(float(want)), (backend, got, want)
        assert set(grads) == set(want_grads) and len(grads) == 2 + len(list(head.parameters()))
        for name, w in want_grads.items():
            assert grads[name] is not None and torch.allclose(grads[name], w, rtol=1e-9, atol=1e-12), (backend, name)


def test_a_head_whose_width_is_not_twice_its_vocabulary_is_refused_by_every_backend():
    """A head's 2V logits are split at vocab_size: one of another width was sliced silently by the
    reference (and cpp took V from the layer, so the two disagreed)."""
    torch.manual_seed(5)
    f, b, tokens = torch.randn(2, 7, 3), torch.randn(2, 7, 3), torch.randint(0, 5, (2, 7))
    head = TextHead(3, 5, hidden=4)
    head.layers[1] = nn.Linear(4, 12)
    for backend in ("reference", "torch", "auto"):
        with pytest.raises(ValueError, match=r"must map \(n, 2m\) to \(n, 2V\) = \(\d+, 10\), got \(\d+, 12\)"):
            belief_state_loss(f, b, tokens, head, backend=backend)
    with pytest.raises(ValueError, match="layers\\[-1\\] gives 12 logits, not 2 \\* vocab_size = 10"):
        belief_state_loss(f, b, tokens, head, backend="cpp")


@pytest.mark.parametrize("kind", ["text", "swiglu"])
def test_float16_torch_backend_under_saved_tensor_hooks(kind):
    """float16 runs the torch backend's computation again in the backward (its gradients deferred),
    which read the head's parameters from the saved tensors: under activation checkpointing
    (use_reentrant=False) or save_on_cpu those are copies the head's forward never reads, and the
    backward refused the head's own bias as a foreign leaf (review helper-73). The gradients equal
    the eager ones, and an in-place change of a parameter before the backward is still caught."""
    from torch.utils.checkpoint import checkpoint

    head, f0, b0, tokens = _float16_case(kind, seed=0)

    def grads(wrap):
        f, b = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        wrap(lambda x, y: belief_state_loss(x, y, tokens, head, backend="torch"), f, b).backward()
        return [f.grad, b.grad, *(p.grad for p in head.parameters())]

    eager = grads(lambda fn, f, b: fn(f, b))
    for wrap in (lambda fn, f, b: checkpoint(fn, f, b, use_reentrant=False),
                 lambda fn, f, b: _with_copying_hooks(fn, f, b)):
        got = grads(wrap)
        assert all(g is not None and torch.equal(g, e) for g, e in zip(got, eager))
    f, b = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    loss = belief_state_loss(f, b, tokens, head, backend="torch")
    with torch.no_grad():
        next(head.parameters()).add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _float16_case(kind, seed):
    """(head, f, b, tokens): a float16 TextHead or SwiGLU head and inputs for the torch backend."""
    torch.manual_seed(seed)
    B, L, m, V = 2, 7, 4, 5
    head = (TextHead(m, V, hidden=6) if kind == "text" else make_swiglu(m, V, hidden=8)).half()
    f = torch.randn(B, L, m, dtype=torch.float16)
    b = torch.randn(B, L, m, dtype=torch.float16)
    return head, f, b, torch.randint(0, V, (B, L))


def _with_copying_hooks(fn, f, b):
    """fn(f, b) with saved-tensor hooks that unpack a copy (as save_on_cpu does for CUDA tensors)."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        return fn(f, b)


@pytest.mark.parametrize("kind", ["text", "swiglu"])
def test_float16_torch_backend_under_functional_call(kind):
    """torch.func.functional_call swaps other tensors in for the forward and puts the head's own
    back before the backward, which in float16 runs the computation again: it reran with the own
    parameters and refused the swapped-in ones as foreign (review helper-75). The gradients now
    equal those of a head holding the swapped-in values."""
    from torch.func import functional_call

    head, f0, b0, tokens = _float16_case(kind, seed=1)
    values = {k: (v.detach() * 1.25).requires_grad_() for k, v in head.named_parameters()}
    f, b = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    wrap = _LossOf(head)
    functional_call(wrap, {"head." + k: v for k, v in values.items()}, (f, b, tokens)).backward()
    got = [f.grad, b.grad, *(values[k].grad for k, _ in head.named_parameters())]
    twin = copy.deepcopy(head)
    with torch.no_grad():
        for k, q in twin.named_parameters():
            q.copy_(values[k])
    f2, b2 = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    belief_state_loss(f2, b2, tokens, twin, backend="torch").backward()
    want = [f2.grad, b2.grad, *(q.grad for _, q in twin.named_parameters())]
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
    assert all(q.grad is None for q in head.parameters())


class _LossOf(nn.Module):
    """belief_state_loss on the torch backend as a module's forward (for functional_call)."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, f, b, tokens):
        return belief_state_loss(f, b, tokens, self.head, backend="torch")


class _TiedHead(nn.Module):
    """A head of any form (the torch backend runs it whole) with a tied pair of weights and a buffer."""

    def __init__(self, m, V):
        super().__init__()
        self.a, self.h1, self.h2, self.out = nn.Linear(2 * m, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2 * V)
        self.h2.weight = self.h1.weight
        self.register_buffer("gain", torch.ones(8))
        self.register_buffer("shift", None)  # named_buffers leaves it out; functional_call may set it

    def forward(self, x):
        x = F.gelu(self.h1(F.gelu(self.a(x)))) * self.gain
        return self.out(F.gelu(self.h2(x if self.shift is None else x + self.shift)))


@pytest.mark.parametrize("tie_weights", [True, False])
def test_float16_torch_backend_under_functional_call_with_tied_weights_and_buffers(tie_weights):
    """The float16 rerun put back the swapped-in parameters only: a tied name (h2.weight, which
    named_parameters leaves out) and a swapped buffer read the module's own tensors, and the
    gradients were silently those of another function (review helper-76). Every name is put back."""
    from torch.func import functional_call

    torch.manual_seed(2)
    B, L, m, V = 2, 6, 4, 5
    head = _TiedHead(m, V).half()
    f0, b0 = torch.randn(B, L, m, dtype=torch.float16), torch.randn(B, L, m, dtype=torch.float16)
    tokens = torch.randint(0, V, (B, L))
    values = {k: (v.detach() * 1.25).requires_grad_() for k, v in head.named_parameters()}
    values["gain"] = torch.full((8,), 3.0, dtype=torch.float16)
    values["shift"] = torch.full((8,), 0.5, dtype=torch.float16)  # a None buffer given a tensor (review helper-77)
    if not tie_weights:  # h2 keeps its own (the module's) weight, h1 reads the swapped-in one
        values["h2.weight"] = head.h1.weight
    f, b = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    functional_call(_LossOf(head), {"head." + k: v for k, v in values.items()}, (f, b, tokens),
                    tie_weights=tie_weights).backward()
    twin = copy.deepcopy(head)
    twin.h2.weight = nn.Parameter(twin.h1.weight.detach().clone()) if not tie_weights else twin.h2.weight
    with torch.no_grad():
        twin.h1.weight.copy_(values["h1.weight"])
        if not tie_weights:
            twin.h2.weight.copy_(head.h1.weight)
        for k in ("a.weight", "a.bias", "h1.bias", "h2.bias", "out.weight", "out.bias"):
            twin.get_parameter(k).copy_(values[k])
        twin.gain.copy_(values["gain"])
    twin.shift = values["shift"].clone()
    f2, b2 = f0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    belief_state_loss(f2, b2, tokens, twin, backend="torch").backward()
    assert torch.equal(f.grad, f2.grad) and torch.equal(b.grad, b2.grad)
    assert torch.equal(values["out.weight"].grad, twin.out.weight.grad)
    want_h1 = twin.h1.weight.grad
    assert torch.equal(values["h1.weight"].grad, want_h1)
