"""Every CPU backend against the float64 reference (docs/contract.md §2-§6), and the pair set and subsampler
(docs/contract.md §2, §5). Sizes are odd on purpose; each test draws fresh random inputs from its own seed."""
import copy
import math

import numpy as np
import pytest
import torch

from bst_fast import BeliefStateLoss, TextHead, belief_state_loss
from bst_fast import _pairs

from _helpers import (SwiGLUHead, check_against_reference, errors, loss_and_grads, make_head,
                      make_inputs, random_grad_out, reference64, rel_err, switch)


def explicit_pairs():
    # Valid for B=3 and L=13 with the defaults; unsorted, with one pair repeated (it counts twice).
    row = torch.tensor([2, 0, 0, 1, 2, 2, 1, 0])
    i = torch.tensor([5, 0, 3, 1, 0, 10, 1, 0])
    j = torch.tensor([9, 2, 12, 4, 11, 12, 4, 7])
    return row, i, j


CASES = {
    "default": {},
    "lengths": dict(lengths=torch.tensor([13, 2, 9])),  # row 1 too short for any pair
    "lengths_int": dict(lengths=11),
    "lengths_int32": dict(lengths=torch.tensor([12, 13, 5], dtype=torch.int32), prefix_start=torch.tensor([1, 0, 0], dtype=torch.int32)),
    "lengths_0_1_3": dict(L=17, lengths=torch.tensor([0, 3, 1])),  # only row 1 has a pair: (0, 2)
    "prefix_start_int": dict(prefix_start=4),
    "prefix_start_tensor": dict(prefix_start=torch.tensor([0, 5, 11])),  # row 2 has no pair
    "gaps": dict(min_gap=3, max_gap=6),
    "max_gap_eq_min_gap": dict(max_gap=2),
    "min_gap_5": dict(L=17, min_gap=5),
    "max_gap_beyond_L": dict(max_gap=1000),
    "max_gap_int64_max": dict(max_gap=2**63 - 1, prefix_start=torch.tensor([0, 2**63 - 1, 3])),
    "next_weight_0": dict(next_weight=0.0),
    "next_weight_0.3": dict(next_weight=0.3),
    "next_weight_1": dict(next_weight=1.0),
    "sum": dict(reduction="sum"),
    "explicit": dict(pairs=explicit_pairs()),
    "explicit_sum": dict(pairs=explicit_pairs(), reduction="sum", next_weight=0.3),
    "fraction": dict(pairs=0.3, generator_seed=5),
    "count": dict(pairs=5, generator_seed=6),
    "fraction_sum": dict(pairs=0.2, reduction="sum", generator_seed=7),
    "everything": dict(L=17, lengths=torch.tensor([17, 9, 4]), prefix_start=torch.tensor([1, 2, 0]),
                       min_gap=3, max_gap=8, next_weight=0.3, reduction="sum", pairs=0.5, generator_seed=8),
}
RUNS = [("torch", torch.float32), ("cpp", torch.float32), ("torch", torch.float64)]


@pytest.mark.parametrize("backend,dtype", RUNS, ids=[f"{b}-{str(d)[6:]}" for b, d in RUNS])
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(case, backend, dtype):
    opts = dict(CASES[case])
    L = opts.pop("L", 13)
    seed = list(CASES).index(case)
    f, b, tokens, head = make_inputs(B=3, L=L, m=7, V=13, hidden=9, seed=seed)
    check_against_reference(f, b, tokens, head, backend=backend, dtype=dtype, seed=seed, **opts)


HEADS = [(9, 2), ([11, 6], 3), ([5, 8, 6], 4)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("hidden,n_layers", HEADS, ids=["2layers", "3layers", "4layers"])
@pytest.mark.parametrize("activation", _pairs.ACTIVATIONS)
def test_activations_and_depth(activation, hidden, n_layers, backend):
    seed = 100 + n_layers * 10 + _pairs.ACTIVATIONS.index(activation)
    f, b, tokens, head = make_inputs(B=3, L=17, m=7, V=13, seed=seed, hidden=hidden, n_layers=n_layers,
                                     activation=activation)
    check_against_reference(f, b, tokens, head, backend=backend, seed=seed,
                            lengths=torch.tensor([17, 12, 5]), next_weight=0.3)


@pytest.mark.parametrize("activation", _pairs.ACTIVATIONS)
def test_activations_float64_torch(activation):
    f, b, tokens, head = make_inputs(B=2, L=11, m=5, V=7, seed=3, hidden=[11, 6], n_layers=3,
                                     activation=activation)
    check_against_reference(f, b, tokens, head, backend="torch", dtype=torch.float64, seed=3)


HALF_CASES = {
    "default": dict(),
    "lengths_gaps": dict(lengths=torch.tensor([13, 6, 11]), min_gap=3, max_gap=7, next_weight=0.3),
    "explicit": dict(pairs=explicit_pairs()),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(HALF_CASES))
def test_half_precision_cpp(case, dtype):
    """docs/contract.md §6: error at most 2x that of the materialised run in the same dtype, plus 1e-3, both
    against the float64 reference on the same (rounded) values."""
    seed = 200 + list(HALF_CASES).index(case)
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    f, b, head = f.to(dtype), b.to(dtype), head.to(dtype)
    opts = HALF_CASES[case]
    go = random_grad_out(seed)
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **opts)
    mat_loss, mat_grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="reference", **opts)
    loss, grads = loss_and_grads(f, b, tokens, copy.deepcopy(head), go, backend="cpp", **opts)
    assert loss.dtype == torch.float32  # accumulation and the loss are float32
    for name, g in grads.items():
        assert g.dtype == dtype, name  # gradients come back in the inputs' dtype
    err = errors(loss, grads, ref_loss, ref_grads)
    mat_err = errors(mat_loss, mat_grads, ref_loss, ref_grads)
    for name in err:
        assert err[name] <= 2 * mat_err[name] + 1e-3, (name, err[name], mat_err[name])



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_reference_upcasts_the_heads_logits(dtype):
    """The materialised run of 16-bit inputs (the yardstick of test_half_precision_cpp) is the head's
    16-bit logits upcast to float32, then the cross-entropies in float32: written here from the pairs
    of §2 by loops (cross-entropies in 16-bit were 1e-5 to 6e-5 off, 100x what this allows)."""
    B, L, m, V = 4, 40, 16, 50
    f, b, tokens, head = make_inputs(B=B, L=L, m=m, V=V, hidden=32, seed=1, dtype=dtype)
    with torch.no_grad():
        got = belief_state_loss(f, b, tokens, head, backend="reference")
        r, i, j = (torch.tensor(x) for x in zip(*[(r, i, j) for r in range(B) for i in range(L) for j in range(i + 2, L)]))
        logits = head(torch.cat([f[r, i], b[r, j]], -1))
        assert logits.dtype == dtype
        logits = logits.float()
        ce = (torch.nn.functional.cross_entropy(logits[:, :V], tokens[r, i + 1], reduction="none")
              + torch.nn.functional.cross_entropy(logits[:, V:], tokens[r, j - 1], reduction="none"))
        want = 0.5 * ce.sum() / len(r)
    assert got.dtype == torch.float32 and rel_err(got, want) < 1e-6, (float(got), float(want))


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_non_contiguous_inputs(backend):
    B, L, m, V = 3, 13, 7, 13
    g = torch.Generator().manual_seed(300)
    f = torch.randn(B, m, L, generator=g).transpose(1, 2)  # (B, L, m), strides permuted
    b = torch.randn(B, 2 * L, m + 3, generator=g)[:, ::2, 1 : m + 1]  # strided slice
    tokens = torch.randint(0, V, (L, B), generator=g).t()
    lengths = torch.tensor([13, 0, 5, 9, 11, 7])[::2]  # a strided (3,) view: [13, 5, 11]
    assert not (f.is_contiguous() or b.is_contiguous() or tokens.is_contiguous() or lengths.is_contiguous())
    head = make_head(m, V, hidden=9, seed=300)
    check_against_reference(f, b, tokens, head, backend=backend, seed=300, lengths=lengths,
                            prefix_start=torch.tensor([0, 1, 2, 3, 4, 5])[::2])


@pytest.mark.parametrize("backend, triton_ops", [("torch", False), ("torch", True), ("cpp", False), ("triton", False)])
def test_a_confident_model_keeps_its_small_loss_in_float32(backend, triton_ops, monkeypatch):
    """Logits near 50 and a loss of 1e-5, as late in training: the logsumexp is kept as the top
    logit and log1p of the rest, so float32 meets docs/contract.md §6 (mx + log(se) - zy lost 6% of
    the loss and of every gradient; plain float32 torch, F.cross_entropy, is off by 1e-4 here)."""
    switch(monkeypatch, triton_ops=triton_ops)
    g = torch.Generator().manual_seed(5)
    B, L, m, V = 2, 8, 4, 3
    f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
    tokens = torch.zeros(B, L, dtype=torch.long)
    head = make_head(m, V, hidden=6, activation="relu", seed=5)
    with torch.no_grad():
        head.layers[1].weight.mul_(0.1)
        head.layers[1].bias.copy_(torch.tensor([52.0, 40.0, 40.0, 52.0, 40.0, 40.0]))  # the label on top by 12
    ref = belief_state_loss(f.double(), b.double(), tokens, copy.deepcopy(head).double(), backend="reference")
    assert 1e-6 < float(ref) < 1e-4
    check_against_reference(f, b, tokens, head, backend=backend, seed=5)


WRT = [("f",), ("b",), ("head",), ("f", "b"), ("b", "head"), ("f", "head")]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("wrt", WRT, ids=["+".join(w) for w in WRT])
def test_only_some_inputs_require_grad(wrt, backend):
    seed = 400 + WRT.index(wrt)
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=seed)
    check_against_reference(f, b, tokens, head, backend=backend, seed=seed, wrt=wrt,
                            lengths=torch.tensor([13, 4, 10]))


# (for the reference only the frozen layer's missing .grad is a check: it is the oracle of the rest)
@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_partly_frozen_head_backward(backend):
    """.backward() with the first layer frozen: it gets no .grad; the rest match the reference."""
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=450)
    go = random_grad_out(450)
    _, ref = reference64(f, b, tokens, head, go)
    for q in head.layers[0].parameters():
        q.requires_grad_(False)
    f.requires_grad_()
    loss = belief_state_loss(f, b, tokens, head, backend=backend)
    (go * loss).backward()
    assert head.layers[0].weight.grad is None and head.layers[0].bias.grad is None
    assert b.grad is None
    assert rel_err(f.grad, ref["f"]) < 1e-4
    for name, q in head.named_parameters():
        if q.requires_grad:
            assert rel_err(q.grad, ref[name]) < 1e-4, name


@pytest.mark.parametrize("backend", ["torch", "cpp", "reference", "triton"])
def test_nothing_requires_grad(backend):
    f, b, tokens, head = make_inputs(seed=460)
    head.requires_grad_(False)
    loss = belief_state_loss(f, b, tokens, head, backend=backend)
    assert not loss.requires_grad and loss.grad_fn is None
    ref, _ = reference64(f, b, tokens, head, 1.0)
    assert rel_err(loss, ref) < 1e-5


NO_PAIR = {  # batches of B = 3, L = 13 with no valid pair (docs/contract.md §2)
    "short_rows": dict(lengths=torch.tensor([2, 1, 0])),
    "prefix_start": dict(prefix_start=12),
    "min_gap": dict(min_gap=13),
    "fraction": dict(lengths=torch.tensor([2, 2, 2]), pairs=0.5, generator_seed=3),
    "count": dict(prefix_start=11, pairs=4, generator_seed=4),
    "empty_triple": dict(pairs=tuple(torch.zeros(0, dtype=torch.int64) for _ in range(3))),
}


@pytest.mark.parametrize("backend,dtype", RUNS + [("reference", torch.float64)],
                         ids=[f"{b}-{str(d)[6:]}" for b, d in RUNS + [("reference", torch.float64)]])
@pytest.mark.parametrize("case", list(NO_PAIR))
def test_a_sum_over_no_pair_is_zero_and_a_mean_raises(case, backend, dtype):
    """A trainer's micro-batch of short rows is summed and divided by the whole batch's count: it
    adds an exact 0, and every input that requires a gradient gets zeros (DDP waits for each
    parameter's); a mean over no pair stays an error."""
    opts = dict(NO_PAIR[case])
    seed = opts.pop("generator_seed", 0)
    f, b, tokens, head = make_inputs(seed=480, dtype=dtype)
    head.layers[0].weight.requires_grad_(False)  # a frozen layer stays without a gradient
    f.requires_grad_()
    with pytest.raises(ValueError, match="no valid pair at all"):
        belief_state_loss(f, b, tokens, head, backend=backend, generator=torch.Generator().manual_seed(seed), **opts)
    for reduction in ("sum", "row_mean"):
        loss = belief_state_loss(f, b, tokens, head, backend=backend, reduction=reduction,
                                 generator=torch.Generator().manual_seed(seed), **opts)
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and loss.dim() == 0
        assert float(loss.detach()) == 0.0
        wrt = [f] + [q for q in head.parameters() if q.requires_grad]
        grads = torch.autograd.grad(loss, wrt)
        assert all(g is not None and g.shape == t.shape and not g.any() for g, t in zip(grads, wrt))
    assert head.layers[0].weight.grad is None and b.grad is None


def test_no_grad_computes_no_gradient(monkeypatch):
    """Under torch.no_grad the torch backend must not differentiate its chunks (evaluation cost)."""
    f, b, tokens, head = make_inputs(seed=471)
    f.requires_grad_()
    calls = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        belief_state_loss(f, b, tokens, head, backend="torch")
    assert calls == []
    belief_state_loss(f, b, tokens, head, backend="torch")
    assert calls  # and with grad enabled it does


def test_no_grad_asks_the_cpp_engine_for_no_gradient(monkeypatch):
    """Under torch.no_grad the C++ engine is told need_grad=False (it then skips every gradient)."""
    import types

    from bst_fast.backends import cpp_backend

    f, b, tokens, head = make_inputs(seed=472)
    f.requires_grad_()
    asked = []

    class Torch:  # cpp_backend's `torch`, its op spied on (the op itself cannot be replaced)
        ops = types.SimpleNamespace(bst_fast=types.SimpleNamespace(
            pair_loss=lambda *a, **kw: asked.append(a[-1]) or torch.ops.bst_fast.pair_loss(*a, **kw)))

        def __getattr__(self, name):
            return getattr(torch, name)
    monkeypatch.setattr(cpp_backend, "torch", Torch())
    with torch.no_grad():
        belief_state_loss(f, b, tokens, head, backend="cpp")
    belief_state_loss(f, b, tokens, head, backend="cpp")
    assert asked == [False, True]



@pytest.mark.parametrize("backend", ["torch", "cpp", "reference", "triton"])
def test_no_grad(backend):
    f, b, tokens, head = make_inputs(seed=470, hidden=[11, 6], n_layers=3)
    f.requires_grad_()
    b.requires_grad_()
    opts = dict(lengths=torch.tensor([13, 7, 10]), pairs=0.4)
    with_grad = belief_state_loss(f, b, tokens, head, backend=backend, generator=torch.Generator().manual_seed(1), **opts)
    with torch.no_grad():
        loss = belief_state_loss(f, b, tokens, head, backend=backend, generator=torch.Generator().manual_seed(1), **opts)
    assert loss.grad_fn is None and not loss.requires_grad
    assert torch.allclose(loss, with_grad.detach(), rtol=1e-6, atol=0)
    assert f.grad is None and all(q.grad is None for q in head.parameters())


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_padding_is_ignored(backend):
    """Positions beyond lengths[r] are never read: changing them (even to NaN) changes nothing,
    and their gradients are zero."""
    f, b, tokens, head = make_inputs(seed=480)
    lengths = torch.tensor([13, 6, 9])
    pad = torch.arange(13)[None, :] >= lengths[:, None]  # (B, L)
    go = random_grad_out(480)
    loss, grads = loss_and_grads(f, b, tokens, head, go, backend=backend, lengths=lengths)
    f2, b2, tok2 = f.clone(), b.clone(), tokens.clone()
    f2[pad] = float("nan")
    b2[pad] = float("inf")
    tok2[pad] = -7  # padding token ids are not checked
    loss2, grads2 = loss_and_grads(f2, b2, tok2, head, go, backend=backend, lengths=lengths)
    assert torch.isfinite(loss2)
    assert rel_err(loss2, loss) < 1e-6
    assert (grads["f"][pad] == 0).all() and (grads["b"][pad] == 0).all()
    for name in grads:
        assert torch.isfinite(grads2[name]).all(), name
        on_rows = name in ("f", "b")
        assert rel_err(grads2[name][~pad] if on_rows else grads2[name],
                       grads[name][~pad] if on_rows else grads[name]) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_any_head_module(backend, dtype):
    """The torch backend (and auto, which falls back to it) takes any head nn.Module."""
    torch_head = SwiGLUHead(7, 13, h=10, seed=500)
    f, b, tokens, _ = make_inputs(B=3, L=13, m=7, V=13, seed=500)
    check_against_reference(f, b, tokens, torch_head, backend=backend, dtype=dtype, seed=500,
                            lengths=torch.tensor([13, 5, 11]), next_weight=0.3)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_probing_a_heads_vocabulary_keeps_each_submodules_mode(backend):
    """A head without vocab_size is probed once in eval mode; afterwards every submodule is back in
    its own mode (a Dropout the caller switched off inside a training head stays off)."""
    head = torch.nn.Sequential(torch.nn.Linear(14, 26), torch.nn.Dropout(0.5), torch.nn.Linear(26, 26))
    head.train()
    head[1].eval()
    f, b, tokens, _ = make_inputs(B=2, L=9, m=7, V=13, seed=7)
    first = belief_state_loss(f, b, tokens, head, backend=backend)
    assert [m.training for m in head.modules()] == [True, True, False, True]
    assert torch.equal(first, belief_state_loss(f, b, tokens, head, backend=backend))  # no dropout drawn


def _spy(monkeypatch):
    """Records which backend module computed the loss."""
    from bst_fast import reference
    from bst_fast.backends import cpp_backend as _ops, torch_backend as _torch

    calls = []
    for name, mod in (("cpp", _ops), ("torch", _torch), ("reference", reference)):
        real = mod.run

        def spy(*args, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(mod, "run", spy)
    return calls


def test_auto_picks_cpp_for_text_head_on_cpu(monkeypatch):
    calls = _spy(monkeypatch)
    f, b, tokens, head = make_inputs(seed=510)
    f.requires_grad_()
    auto = belief_state_loss(f, b, tokens, head)  # backend="auto" is the default
    assert calls == ["cpp"]
    explicit = belief_state_loss(f, b, tokens, head, backend="cpp")
    assert calls == ["cpp", "cpp"]
    assert torch.equal(auto, explicit)


def test_auto_falls_back_to_torch(monkeypatch):
    calls = _spy(monkeypatch)
    f, b, tokens, head = make_inputs(seed=520)
    belief_state_loss(f, b, tokens, SwiGLUHead(7, 13, seed=520))
    assert calls == ["torch"]
    belief_state_loss(f.double(), b.double(), tokens, head.double())  # the fused engines take no float64
    assert calls == ["torch", "torch"]


def test_torch_func_transforms_take_the_reference(monkeypatch):
    """Inside torch.func (grad, vmap) the fused backends' autograd.Functions had no functorch rule
    and failed with torch's own message naming nothing of ours (review helper-73): auto takes the
    reference there (its gradients equal eager autograd's), a fused backend asked for by name is a
    ValueError naming the way out; functional_call, not a transform, keeps the fused backend."""
    from torch.func import functional_call, grad

    calls = _spy(monkeypatch)
    f, b, tokens, head = make_inputs(seed=525, dtype=torch.float64)
    params = {k: v.detach() for k, v in head.named_parameters()}
    wrap = BeliefStateLoss(head)

    def loss(p, f_, b_):
        return functional_call(wrap, {"head." + k: v for k, v in p.items()}, (f_, b_, tokens))

    got = grad(loss, argnums=(0, 1, 2))(params, f, b)
    assert calls == ["reference"]
    want = loss_and_grads(f.clone(), b.clone(), tokens, head, 1.0)[1]
    want = [want["f"], want["b"], *(want[k] for k, _ in head.named_parameters())]
    got = [got[1], got[2], *(got[0][k] for k, _ in head.named_parameters())]
    assert max(rel_err(g, w) for g, w in zip(got, want)) < 1e-12
    f32, b32, _, head32 = make_inputs(seed=525)
    with pytest.raises(ValueError, match=r"backend 'cpp' cannot run inside a torch.func transform .*backend='reference'"):
        grad(lambda x: belief_state_loss(x, b32, tokens, head32, backend="cpp"))(f32)
    calls.clear()
    belief_state_loss(f32.requires_grad_(), b32, tokens, head32).backward()
    assert calls == ["cpp"]


def test_cpp_rejects_other_heads_and_float64():
    f, b, tokens, head = make_inputs(seed=530)
    with pytest.raises(ValueError, match="TextHead"):
        belief_state_loss(f, b, tokens, SwiGLUHead(7, 13), backend="cpp")
    with pytest.raises(ValueError, match="float64"):
        belief_state_loss(f.double(), b.double(), tokens, head.double(), backend="cpp")


def test_module_form():
    f, b, tokens, head = make_inputs(seed=540)
    opts = dict(lengths=torch.tensor([13, 9, 4]), prefix_start=1, min_gap=3, next_weight=0.3, backend="cpp")
    crit = BeliefStateLoss(head, **opts)
    assert list(crit.parameters()) == list(head.parameters())  # the head is a submodule
    assert torch.equal(crit(f, b, tokens), belief_state_loss(f, b, tokens, head, **opts))
    # Per-call overrides win over the stored options.
    assert torch.equal(crit(f, b, tokens, reduction="sum", backend="torch"),
                       belief_state_loss(f, b, tokens, head, **{**opts, "reduction": "sum", "backend": "torch"}))
    with pytest.raises(ValueError, match="lenghts"):
        BeliefStateLoss(head, lenghts=3)


def test_module_form_backward():
    f, b, tokens, head = make_inputs(seed=550)
    crit = BeliefStateLoss(head, backend="cpp", pairs=explicit_pairs())
    crit(f, b, tokens).backward()
    _, ref = reference64(f, b, tokens, head, 1.0, pairs=explicit_pairs())
    for name, q in crit.head.named_parameters():
        assert rel_err(q.grad, ref[name]) < 1e-4, name


def test_explicit_pairs_are_a_plain_mean():
    """pairs=(row, i, j) is the plain mean over the listed pairs: the sum over single-pair losses / n."""
    f, b, tokens, head = make_inputs(seed=560)
    row, i, j = explicit_pairs()
    total = belief_state_loss(f, b, tokens, head, pairs=(row, i, j), backend="cpp")
    singles = [belief_state_loss(f, b, tokens, head, pairs=(row[k : k + 1], i[k : k + 1], j[k : k + 1]), backend="cpp")
               for k in range(row.numel())]
    assert torch.allclose(total, torch.stack(singles).mean(), rtol=1e-5)
    summed = belief_state_loss(f, b, tokens, head, pairs=(row, i, j), backend="cpp", reduction="sum")
    assert torch.allclose(summed, total * row.numel(), rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpp", "reference"])
def test_token_dtypes(backend):
    f, b, tokens, head = make_inputs(seed=570)
    want = belief_state_loss(f, b, tokens, head, backend=backend)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        assert torch.equal(belief_state_loss(f, b, tokens.to(dtype), head, backend=backend), want), dtype


def test_cpp_is_deterministic():
    """Many tiles (about 2000 pairs, 256 a tile) over the threads: the same inputs give bitwise the
    same loss and gradients, which match the reference, for all pairs and a long pair list."""
    f, b, tokens, head = make_inputs(B=3, L=41, m=6, V=9, hidden=[10, 7], n_layers=3, seed=580)
    runs = [loss_and_grads(f, b, tokens, head, 0.9, backend="cpp", lengths=torch.tensor([41, 30, 37]))
            for _ in range(3)]
    for loss, grads in runs[1:]:
        assert torch.equal(loss, runs[0][0])
        assert all(torch.equal(grads[k], runs[0][1][k]) for k in grads)
    check_against_reference(f, b, tokens, head, backend="cpp", seed=580, lengths=torch.tensor([41, 30, 37]))
    check_against_reference(f, b, tokens, head, backend="cpp", seed=581, lengths=torch.tensor([41, 30, 37]),
                            pairs=0.6, generator_seed=3, reduction="sum", next_weight=0.3)


# --------------------------------------------------------------------------------------------
# The pair set (docs/contract.md §2)


def brute_force_pairs(lengths, prefix_start, min_gap, max_gap):
    """docs/contract.md §2 read literally."""
    out = []
    for r, (n, s) in enumerate(zip(lengths.tolist(), prefix_start.tolist())):
        for i in range(n):
            for j in range(n):
                if s <= i and i + min_gap <= j <= min(i + (max_gap if max_gap is not None else 10**9), n - 1):
                    out.append((r, i, j))
    return out


def test_pair_count_default():
    L = 20
    lengths = torch.arange(0, L + 1)  # every length 0..20 once
    counts = _pairs.pair_counts(lengths, torch.zeros_like(lengths), 2, L, L)
    expect = [max(0, (n - 1) * (n - 2) // 2) if n >= 2 else 0 for n in range(L + 1)]
    assert counts.tolist() == expect
    mask = _pairs.pair_mask(lengths, torch.zeros_like(lengths), 2, L, L)
    assert mask.sum((1, 2)).tolist() == expect


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_pair_count_through_reductions(backend):
    """sum / mean = |P| = sum_r (len_r - 1)(len_r - 2) / 2 with the defaults."""
    f, b, tokens, head = make_inputs(B=4, L=17, seed=600)
    lengths = torch.tensor([17, 2, 8, 3])
    mean = belief_state_loss(f, b, tokens, head, lengths=lengths, backend=backend)
    total = belief_state_loss(f, b, tokens, head, lengths=lengths, backend=backend, reduction="sum")
    n_pairs = sum((n - 1) * (n - 2) // 2 for n in lengths.tolist())
    assert abs(total.item() / mean.item() - n_pairs) < 1e-3 * n_pairs


def random_pair_spec(g, B, L, max_start, max_min_gap):
    """Random lengths in [0, L], prefix_start in [0, max_start], min_gap in [2, max_min_gap]."""
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    prefix_start = torch.randint(0, max_start + 1, (B,), generator=g)
    return lengths, prefix_start, int(torch.randint(2, max_min_gap + 1, (), generator=g))


@pytest.mark.parametrize("seed", range(6))
def test_pair_set_matches_spec(seed):
    g = torch.Generator().manual_seed(610 + seed)
    B, L = 5, 15
    lengths, prefix_start, min_gap = random_pair_spec(g, B, L, max_start=5, max_min_gap=4)
    max_gap = None if seed % 2 else min_gap + int(torch.randint(0, 6, (), generator=g))
    gmax = L if max_gap is None else min(max_gap, L)
    mask = _pairs.pair_mask(lengths, prefix_start, min_gap, gmax, L)
    got = [tuple(x) for x in mask.nonzero().tolist()]
    assert got == brute_force_pairs(lengths, prefix_start, min_gap, max_gap)
    counts = _pairs.pair_counts(lengths, prefix_start, min_gap, gmax, L)
    assert counts.tolist() == mask.sum((1, 2)).tolist()


# --------------------------------------------------------------------------------------------
# The subsampler (docs/contract.md §5)


def _sample(lengths, prefix_start, min_gap, max_gap, k, seed):
    return torch.ops.bst_fast.sample_pairs(lengths, prefix_start, min_gap, max_gap, k, seed)


def test_sampler_draw_does_not_depend_on_thread_count():
    """Rows are drawn in parallel (at::parallel_for), each from its own (seed, row) stream into its own
    slice: one thread and several give the same pairs, both branches (dense byte set, sparse hash set)."""
    g = torch.Generator().manual_seed(77)
    B, L = 61, 300
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    prefix_start = torch.randint(0, 5, (B,), generator=g)
    counts = _pairs.pair_counts(lengths, prefix_start, 2, L, L)
    dense = (counts.double() * 0.3).long()  # k >= |P_r| / 64: the byte set
    sparse = (counts // 200).clamp(max=counts)  # k < |P_r| / 64: the hash set
    before = torch.get_num_threads()
    try:
        for k in (dense, sparse):
            torch.set_num_threads(1)
            one = _sample(lengths, prefix_start, 2, L, k, 99)
            torch.set_num_threads(max(2, before))
            many = _sample(lengths, prefix_start, 2, L, k, 99)
            assert one[0].numel() == int(k.sum()) > 0
            assert all(torch.equal(x, y) for x, y in zip(one, many)), "the draw changed with the thread count"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("seed", range(5))
def test_sampler_valid_distinct_sorted_exact_count(seed):
    g = torch.Generator().manual_seed(700 + seed)
    B, L = 6, 23
    lengths, prefix_start, min_gap = random_pair_spec(g, B, L, max_start=4, max_min_gap=3)
    max_gap = L if seed % 2 else min_gap + 5
    counts = _pairs.pair_counts(lengths, prefix_start, min_gap, max_gap, L)
    k = (torch.rand(B, generator=g) * (counts + 1).double()).long().clamp(max=counts)
    k[0] = counts[0]  # one row takes every pair
    row, i, j = _sample(lengths, prefix_start, min_gap, max_gap, k, 12345 + seed)
    assert row.dtype == i.dtype == j.dtype == torch.int64
    valid = set(brute_force_pairs(lengths, prefix_start, min_gap, max_gap))
    got = list(zip(row.tolist(), i.tolist(), j.tolist()))
    assert all(p in valid for p in got), "a sampled pair is not in P_r"
    assert len(set(got)) == len(got), "pairs are not distinct"
    assert got == sorted(got), "pairs are not sorted by (row, i, j)"
    assert torch.bincount(row, minlength=B).tolist() == k.tolist(), "not exactly k_r pairs per row"
    assert [p for p in got if p[0] == 0] == [p for p in sorted(valid) if p[0] == 0]  # k_0 = |P_0|


def test_sampler_reproducible():
    lengths = torch.tensor([40, 31, 0, 25])
    ps = torch.tensor([0, 3, 0, 1])
    k = torch.tensor([30, 20, 0, 10])
    a = _sample(lengths, ps, 2, 40, k, 99)
    b = _sample(lengths, ps, 2, 40, k, 99)
    c = _sample(lengths, ps, 2, 40, k, 100)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # Through the public path: the same generator seed, the same subsample, hence the same loss.
    f, b_, tokens, head = make_inputs(B=4, L=40, m=5, V=7, seed=710)
    opts = dict(lengths=lengths, prefix_start=ps, pairs=0.1, backend="cpp")
    l1 = belief_state_loss(f, b_, tokens, head, generator=torch.Generator().manual_seed(3), **opts)
    l2 = belief_state_loss(f, b_, tokens, head, generator=torch.Generator().manual_seed(3), **opts)
    l3 = belief_state_loss(f, b_, tokens, head, generator=torch.Generator().manual_seed(4), **opts)
    assert torch.equal(l1, l2) and not torch.equal(l1, l3)


def test_subsample_sizes_and_weights():
    """k_r = max(1, round(rho |P_r|)) (0 for rows without pairs), k_r = min(k, |P_r|) for an int,
    and each sampled pair of row r weighs |P_r| / (k_r |P|)."""
    f, b, tokens, _ = make_inputs(B=4, L=17, seed=720)
    lengths = torch.tensor([17, 4, 2, 9])
    counts = torch.tensor([(n - 1) * (n - 2) // 2 for n in lengths.tolist()])
    common = dict(lengths=lengths, prefix_start=0, min_gap=2, max_gap=None, next_weight=0.5,
                  generator=torch.Generator().manual_seed(0))
    for pairs, k in ((0.3, [max(1, round(0.3 * c)) if c else 0 for c in counts.tolist()]),
                     (0.01, [1, 1, 0, 1]),
                     (5, [min(5, c) for c in counts.tolist()])):
        for reduction in ("mean", "sum"):
            p = _pairs.prepare(f, b, tokens, 13, pairs=pairs, reduction=reduction, **common)
            assert torch.bincount(p.row, minlength=4).tolist() == k
            kk = torch.tensor(k)
            w = counts[p.row].double() / kk[p.row].double()
            if reduction == "mean":
                w = w / counts.sum()
            assert torch.allclose(p.weight.double(), w)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_full_subsample_is_all_pairs(backend):
    """pairs=1.0, or a count at least every |P_r|, keeps every pair: the estimate is the exact loss."""
    f, b, tokens, head = make_inputs(seed=730)
    opts = dict(lengths=torch.tensor([13, 6, 9]), prefix_start=1, backend=backend)
    exact = belief_state_loss(f, b, tokens, head, **opts)
    assert torch.allclose(belief_state_loss(f, b, tokens, head, pairs=1.0, **opts), exact, rtol=1e-5)
    assert torch.allclose(belief_state_loss(f, b, tokens, head, pairs=10_000, **opts), exact, rtol=1e-5)


def test_subsampled_estimate_is_unbiased(one_thread):
    """The mean of many pairs=0.2 estimates matches the all-pairs loss within 5 standard errors
    (seeded: deterministic), so does the mean gradient, and every pair is drawn with frequency
    k_r / |P_r|. Rows of unequal sizes, |P_r| = (28, 3, 1) and k_r = (6, 1, 1): a plain mean over the
    sampled pairs would be off by about 25 standard errors here."""
    f, b, tokens, head = make_inputs(B=3, L=9, m=4, V=5, hidden=6, seed=741, scale=1.0)
    lengths = torch.tensor([9, 4, 3])
    opts = dict(lengths=lengths, next_weight=0.3, backend="cpp")
    gen = torch.Generator().manual_seed(2024)
    with torch.no_grad():
        exact = belief_state_loss(f, b, tokens, head, **opts).item()
        draws = torch.tensor([belief_state_loss(f, b, tokens, head, pairs=0.2, generator=gen, **opts).item()
                              for _ in range(1000)], dtype=torch.float64)
    stderr = draws.std().item() / math.sqrt(draws.numel())
    assert draws.std() > 0.01 * abs(exact), "the estimates do not vary: not a subsample"
    assert abs(draws.mean().item() - exact) < 5 * stderr, (draws.mean().item(), exact, stderr)

    # The gradient estimate is unbiased too (checked on f and the output bias, component by component).
    f.requires_grad_()
    bias = head.layers[-1].bias
    exact_g = torch.autograd.grad(belief_state_loss(f, b, tokens, head, **opts), [f, bias])
    gs = [torch.autograd.grad(belief_state_loss(f, b, tokens, head, pairs=0.2, generator=gen, **opts), [f, bias])
          for _ in range(400)]
    for k, exact_k in enumerate(exact_g):
        samples = torch.stack([g[k] for g in gs]).double()
        err = (samples.mean(0) - exact_k.double()).abs()
        se = samples.std(0) / math.sqrt(len(gs))
        assert (err <= 5 * se + 1e-6).all(), (k, (err / se).max())

    # Inclusion frequencies, straight from the sampler.
    ps = torch.zeros(3, dtype=torch.long)
    k = torch.tensor([6, 1, 1])
    hits = torch.zeros(3, 9, 9)
    N = 3000
    for s in range(N):
        row, i, j = _sample(lengths, ps, 2, 9, k, s)
        hits[row, i, j] += 1
    mask = _pairs.pair_mask(lengths, ps, 2, 9, 9)
    assert (hits[~mask] == 0).all()
    counts = mask.sum((1, 2))
    assert counts.tolist() == [28, 3, 1]
    for r in range(3):
        p = k[r].item() / counts[r].item()
        freq = hits[r][mask[r]] / N
        sd = math.sqrt(p * (1 - p) / N)
        assert (freq - p).abs().max() <= 5 * sd + 1e-12, (r, freq, p)


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    """A config read through numpy passes np.int64 / np.float32: they were refused ("must be an int"),
    though the decoders and the data take them. Same loss as the Python numbers; a numpy bool is still
    no int."""
    torch.manual_seed(8)
    f, b = torch.randn(2, 9, 4, dtype=torch.float64), torch.randn(2, 9, 4, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 9))
    head = TextHead(4, 5, hidden=6).double().requires_grad_(False)
    plain = dict(lengths=7, prefix_start=1, min_gap=1, max_gap=5, meet_token=3, pairs=4, next_weight=0.25)
    as_numpy = dict(lengths=np.int64(7), prefix_start=np.int32(1), min_gap=np.int64(1), max_gap=np.uint8(5),
                    meet_token=np.int16(3), pairs=np.int64(4), next_weight=np.float64(0.25))
    want = belief_state_loss(f, b, tokens, head, generator=torch.Generator().manual_seed(1), **plain)
    got = belief_state_loss(f, b, tokens, head, generator=torch.Generator().manual_seed(1), **as_numpy)
    assert float(got) == float(want)
    frac = belief_state_loss(f, b, tokens, head, pairs=np.float32(0.5), generator=torch.Generator().manual_seed(1))
    assert float(frac) == float(belief_state_loss(f, b, tokens, head, pairs=float(np.float32(0.5)),
                                                  generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="min_gap must be an int"):
        belief_state_loss(f, b, tokens, head, min_gap=np.bool_(True))


@pytest.mark.parametrize("backend", ["cpp", "torch", "reference"])
def test_a_summed_loss_past_float32s_range_is_inf_on_every_backend(backend):
    """The cpp engine sums in double and raised "value cannot be converted to type float without
    overflow" for a sum past float32's range (review helper-103): a diverging run's summed loss must
    reach the trainer as inf, which stops the run naming its last good checkpoint."""
    torch.manual_seed(0)
    head = TextHead(8, 6, 8)
    with torch.no_grad():
        head.layers[-1].weight.zero_()
        head.layers[-1].bias.zero_()
        head.layers[-1].bias[0] = 1e38  # each pair's loss about 1e38, far more than 3.4e38 summed
    f = torch.randn(2, 12, 8)
    tokens = torch.randint(1, 6, (2, 12))
    loss = belief_state_loss(f, f.clone(), tokens, head, reduction="sum", backend=backend)
    assert loss.dtype == torch.float32 and loss.item() == float("inf")
