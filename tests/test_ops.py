"""The registered ops (opcheck), float64 gradcheck of the differentiable backends, and torch.compile."""
import pytest
import torch
import torch._dynamo

import bst_fast.backends.cpp_backend  # noqa: F401  (registers the fake and autograd rules)
from bst_fast import belief_state_loss

from _helpers import make_head, make_inputs, rel_err


def op_args(listed, seed=0, requires_grad=True, n_hidden=2):
    """Arguments of torch.ops.bst_fast.pair_loss at odd sizes: B=2, L=9, h1=5, hidden 6 (x n_hidden-1), V=7."""
    g = torch.Generator().manual_seed(seed)
    B, L, h1, V = 2, 9, 5, 7
    widths = [h1] + [6] * (n_hidden - 1) + [2 * V]
    A = torch.randn(B, L, h1, generator=g)
    Bm = torch.randn(B, L, h1, generator=g)
    weights = [torch.randn(o, i, generator=g) * 0.5 for i, o in zip(widths[:-1], widths[1:])]
    biases = [torch.randn(o, generator=g) * 0.5 for o in widths[1:]]
    for t in (A, Bm, *weights, *biases):
        t.requires_grad_(requires_grad)
    tokens = torch.randint(0, V, (B, L), generator=g)
    lengths = torch.tensor([9, 6])
    prefix_start = torch.tensor([0, 1])
    if listed:
        row, i, j = torch.tensor([0, 0, 1, 1, 0]), torch.tensor([0, 2, 1, 2, 6]), torch.tensor([2, 8, 5, 4, 8])
        weight = torch.rand(5, generator=g, dtype=torch.float64)
    else:
        row = i = j = None
        weight = torch.tensor(0.05, dtype=torch.float64)
    return (A, Bm, weights, biases, tokens, lengths, prefix_start, 2, 6, row, i, j, weight, 0.3, "gelu",
            requires_grad)


@pytest.mark.parametrize("listed", [False, True], ids=["all_pairs", "pair_list"])
def test_opcheck_pair_loss(listed):
    torch.library.opcheck(torch.ops.bst_fast.pair_loss.default, op_args(listed, seed=int(listed)))


def test_opcheck_pair_loss_no_grad_and_three_layers():
    torch.library.opcheck(torch.ops.bst_fast.pair_loss.default, op_args(True, seed=2, requires_grad=False, n_hidden=3))


def whole_head_args(listed, seed=0, requires_grad=True, n_hidden=2):
    """The triton op's form of op_args: f, b (B, L, m=3) and the first layer's own (h1, 2m) weight
    and bias first in the lists (the op splits it itself), at the same odd sizes."""
    g = torch.Generator().manual_seed(100 + seed)
    args = list(op_args(listed, seed, requires_grad, n_hidden))
    B, L, h1 = args[0].shape
    f, b = torch.randn(B, L, 3, generator=g), torch.randn(B, L, 3, generator=g)
    W1, c1 = torch.randn(h1, 6, generator=g) * 0.5, torch.randn(h1, generator=g) * 0.5
    for t in (f, b, W1, c1):
        t.requires_grad_(requires_grad)
    args[:4] = [f, b, [W1] + args[2], [c1] + args[3]]
    return tuple(args)


def _on_device(args):
    """op_args on the device the triton op runs on: the GPU, or the CPU under TRITON_INTERPRET=1."""
    if not torch.cuda.is_available():
        return args
    move = lambda x: x.detach().cuda().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x
    return tuple([move(y) for y in x] if isinstance(x, list) else move(x) for x in args)


@pytest.mark.parametrize("listed", [False, True], ids=["all_pairs", "pair_list"])
def test_opcheck_triton_pair_loss(listed):
    """The GPU op shares the C++ op's schema, fake and autograd rules, and passes the same checks."""
    pytest.importorskip("triton")
    import bst_fast.backends.triton_backend  # noqa: F401  (defines the op)
    torch.library.opcheck(torch.ops.bst_fast.triton_pair_loss.default, _on_device(whole_head_args(listed, seed=4 + listed)))
    torch.library.opcheck(torch.ops.bst_fast.triton_pair_loss.default,
                          _on_device(whole_head_args(True, seed=6, requires_grad=False, n_hidden=3)))


@pytest.mark.parametrize("listed", [False, True], ids=["all_pairs", "pair_list"])
def test_triton_op_matches_cpp_op(listed):
    """The same numbers from both engines (float32): the triton op on the whole head, the C++ op on
    its first layer split by hand, whose dA, dB map to the gradients of f, b, W1 and c1."""
    pytest.importorskip("triton")
    import bst_fast.backends.triton_backend  # noqa: F401
    args = whole_head_args(listed, seed=7)
    f, b, (W1, *weights), (c1, *biases) = args[:4]
    A, Bm = (f @ W1[:, :3].T + c1).detach(), (b @ W1[:, 3:].T).detach()
    loss, dA, dB, dW, dc = torch.ops.bst_fast.pair_loss(A, Bm, weights, biases, *args[4:])
    two = lambda d, x: d.reshape(-1, d.shape[-1]).T @ x.reshape(-1, 3)
    want = [loss, dA @ W1[:, :3], dB @ W1[:, 3:], torch.cat([two(dA, f), two(dB, b)], 1), *dW, dA.sum((0, 1)), *dc]
    tri = torch.ops.bst_fast.triton_pair_loss(*_on_device(args))
    got = [tri[0], tri[1], tri[2], *tri[3], *tri[4]]
    for x, y in zip(got, want):
        assert x.dtype == torch.float32 and rel_err(x.detach().cpu(), y.detach()) < 1e-5


def test_triton_op_checks_values():
    """Called directly (as a compiled graph calls it), the op still rejects an invalid pair."""
    pytest.importorskip("triton")
    import bst_fast.backends.triton_backend  # noqa: F401
    args = list(whole_head_args(True, seed=8))
    args[11] = torch.tensor([2, 8, 5, 4, 9])  # j = 9 is past the row
    with pytest.raises(ValueError, match="not a valid pair"):
        torch.ops.bst_fast.triton_pair_loss(*_on_device(tuple(args)))


def test_opcheck_sample_pairs():
    args = (torch.tensor([9, 6, 0]), torch.tensor([0, 1, 0]), 2, 5, torch.tensor([4, 2, 0]), 123)
    torch.library.opcheck(torch.ops.bst_fast.sample_pairs.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_op_gradients_are_exact():
    """The op's stored gradients, scaled by grad_output, against autograd through the same math in float64."""
    args = op_args(True, seed=3)
    A, Bm, weights, biases, tokens, lengths, ps, gmin, gmax, row, i, j, weight, lam, act, _ = args
    loss = torch.ops.bst_fast.pair_loss(*args)[0]
    go = torch.tensor(-1.7)
    got = torch.autograd.grad(loss, [A, Bm, *weights, *biases], grad_outputs=go)

    leaves = [t.detach().double().requires_grad_() for t in (A, Bm, *weights, *biases)]
    A64, B64 = leaves[:2]
    n = len(weights)
    W64, c64 = leaves[2 : 2 + n], leaves[2 + n :]
    x = A64[row, i] + B64[row, j]
    for W, c in zip(W64, c64):
        x = torch.nn.functional.linear(torch.nn.functional.gelu(x), W, c)
    V = x.shape[1] // 2
    ce = torch.nn.functional.cross_entropy
    per = lam * ce(x[:, :V], tokens[row, i + 1], reduction="none") + (1 - lam) * ce(x[:, V:], tokens[row, j - 1], reduction="none")
    ref = (weight * per).sum()
    want = torch.autograd.grad(ref, leaves, grad_outputs=go.double())
    assert rel_err(loss, ref) < 1e-5
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == torch.float32
        assert rel_err(g, w) < 1e-4, k


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("opts", [dict(), dict(lengths=torch.tensor([7, 4]), prefix_start=1, min_gap=3, next_weight=0.3,
                                                reduction="sum"),
                                  dict(pairs=(torch.tensor([0, 1, 0]), torch.tensor([0, 1, 3]), torch.tensor([4, 3, 6])))],
                         ids=["default", "options", "explicit"])
def test_gradcheck_float64(backend, opts, one_thread):
    f, b, tokens, _ = make_inputs(B=2, L=7, m=3, V=4, seed=10, dtype=torch.float64)
    head = make_head(3, 4, hidden=[4, 3], n_layers=3, activation="silu", seed=10).double()
    params = list(head.parameters())

    def fn(f, b, *_params):  # the params are perturbed in place by gradcheck; the head reads them
        return belief_state_loss(f, b, tokens, head, backend=backend, **opts)

    assert torch.autograd.gradcheck(fn, (f.requires_grad_(), b.requires_grad_(), *params), eps=1e-6, atol=1e-7, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# torch.compile


def _loss_and_grads(fn, f, b, head):
    f = f.detach().requires_grad_()
    b = b.detach().requires_grad_()
    loss = fn(f, b)
    params = list(head.parameters())
    grads = torch.autograd.grad(loss, [f, b, *params], grad_outputs=torch.tensor(0.7))
    return loss.detach(), grads


@pytest.mark.parametrize("backend", ["cpp", "triton"])
@pytest.mark.parametrize("explicit", [False, True], ids=["all_pairs", "explicit_pairs"])
def test_compile_fullgraph(explicit, backend):
    """belief_state_loss with a fused backend traces as one graph (fullgraph=True) and matches eager."""
    if backend == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the CPU inputs below run the triton op through the interpreter only")
    torch._dynamo.reset()
    f, b, tokens, head = make_inputs(B=3, L=13, m=7, V=13, hidden=[11, 6], n_layers=3, seed=20)
    lengths = torch.tensor([13, 8, 11])
    opts = dict(lengths=lengths, prefix_start=1, next_weight=0.3, backend=backend)
    if explicit:
        opts["pairs"] = (torch.tensor([0, 2, 1, 0]), torch.tensor([1, 3, 2, 5]), torch.tensor([4, 10, 7, 12]))

    def fn(f, b):
        return belief_state_loss(f, b, tokens, head, **opts)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager_loss, eager_grads = _loss_and_grads(fn, f, b, head)
    loss, grads = _loss_and_grads(compiled, f, b, head)
    assert rel_err(loss, eager_loss) < 1e-6
    for g, e in zip(grads, eager_grads):
        assert rel_err(g, e) < 1e-5
    # A second call with new values reuses the graph and still agrees.
    f2, b2 = f + 0.1, b - 0.2
    loss2, _ = _loss_and_grads(compiled, f2, b2, head)
    assert rel_err(loss2, fn(f2, b2)) < 1e-6
    assert rel_err(loss2, loss) > 1e-4  # it did recompute


def test_compile_op_directly_inductor():
    """The op under inductor, its fake rule supplying the output shapes."""
    torch._dynamo.reset()
    args = op_args(False, seed=30, requires_grad=False)

    def fn(A, Bm):
        return torch.ops.bst_fast.pair_loss(A, Bm, *args[2:])[0] * 2

    compiled = torch.compile(fn, fullgraph=True)
    assert torch.allclose(compiled(args[0], args[1]), fn(args[0], args[1]))


_SUBNORMALS_AFTER = """
import torch
import bst_fast.backends.cpp_backend  # noqa: F401
from bst_fast import belief_state_loss
from bst_fast.head import TextHead
torch.manual_seed(0)
f, b, tok = torch.randn(2, 8, 3, requires_grad=True), torch.randn(2, 8, 3), torch.randint(0, 4, (2, 8))
head = TextHead(3, 4, 5)
if {big}:  # the op first in a fresh process, one tile run inline: its own ops open the intra-op pool
    A, Bm, W = torch.randn(1, 4096, 16), torch.randn(1, 4096, 16), [torch.randn(8, 16)]  # (no op that opens it)
    torch.ops.bst_fast.pair_loss(A, Bm, W, [torch.zeros(8)], torch.randint(0, 4, (1, 4096)), torch.tensor([10]),
                                 torch.tensor([0]), 2, 4096, None, None, None, torch.tensor(1.0, dtype=torch.float64),
                                 0.5, "gelu", True)
else:  # one intra-op thread, then two: the second call's ops start the pool anew
    torch.set_num_threads(1)
    belief_state_loss(f, b, tok, head, backend="cpp").backward()
    torch.set_num_threads(2)
    belief_state_loss(f, b, tok, head, backend="cpp").backward()
torch.set_num_threads(2)
print(int((torch.full((100000,), 1e-40) * 1.0 == 0).sum()))  # split over two threads
"""


@pytest.mark.parametrize("big", [False, True])
def test_flushing_subnormals_does_not_leak_into_torch_threads(big):
    """The engine flushes subnormals inside its tiles; a pool thread started meanwhile would copy
    the mode for good and flush every later op's subnormals (half of this product became 0)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SUBNORMALS_AFTER.format(big=big)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "0"
