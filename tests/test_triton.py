"""backend="triton" against the float64 reference (SPEC §6): CPU tensors through TRITON_INTERPRET=1,
realistic sizes on a GPU (marked cuda)."""
import copy

import pytest
import torch

from bst_fast import TextHead, belief_state_loss
from bst_fast import _pairs, reference

triton = pytest.importorskip("triton")
from bst_fast import _triton  # noqa: E402

CPU = torch.device("cpu")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


def _inputs(B, L, m, V, dtype, device, hidden=20, n_layers=2, activation="gelu", seed=0):
    g = torch.Generator().manual_seed(seed)
    head = TextHead(m, V, hidden=hidden, n_layers=n_layers, activation=activation)
    with torch.no_grad():
        for q in head.parameters():  # larger than nn.Linear's default so the softmax is peaked
            q.copy_(torch.randn(q.shape, generator=g) * 0.7)
    f = torch.randn(B, L, m, generator=g)
    b = torch.randn(B, L, m, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    return f.to(device), b.to(device), tokens.to(device), head.to(device)


def _run(f, b, tokens, head, dtype, grad_scale, **opts):
    """loss and grads of (f, b, every head parameter) of grad_scale * loss, inputs cast to dtype."""
    h = copy.deepcopy(head).to(dtype)
    f = f.detach().to(dtype).requires_grad_()
    b = b.detach().to(dtype).requires_grad_()
    loss = belief_state_loss(f, b, tokens, h, **opts)
    grads = torch.autograd.grad(loss * grad_scale, [f, b, *h.parameters()])
    return loss.detach(), grads


def _check(f, b, tokens, head, dtype=torch.float32, **opts):
    scale = torch.randn(()).item() + 2.0  # a random grad_output, not 1
    ref_loss, ref_g = _run(f, b, tokens, head, torch.float64, scale, backend="reference", **opts)
    loss, g = _run(f, b, tokens, head, dtype, scale, backend="triton", **opts)
    assert loss.dtype == torch.float32
    assert all(x.dtype == dtype for x in g)
    if dtype == torch.float32:
        assert _rel(loss, ref_loss) < 1e-5
        for x, y in zip(g, ref_g):
            assert _rel(x, y) < 1e-4
    else:  # at most 2x the error of the materialised computation in the same dtype, plus 1e-3
        mat_loss, mat_g = _run(f, b, tokens, head, dtype, scale, backend="reference", **opts)
        assert _rel(loss, ref_loss) <= 2 * _rel(mat_loss, ref_loss) + 1e-3
        for x, y, z in zip(g, ref_g, mat_g):
            assert _rel(x, y) <= 2 * _rel(z, y) + 1e-3


@pytest.mark.parametrize("activation", _pairs.ACTIVATIONS)
def test_activations_two_layers(activation):
    _check(*_inputs(2, 9, 5, 19, torch.float32, CPU, activation=activation))


@pytest.mark.parametrize("activation", ["gelu_tanh", "leaky_relu"])
def test_three_layers_mixed_widths(activation):
    # widths 20 and 13 pad to 32: two K blocks, zero-padded units; V=19 spans two V blocks
    _check(*_inputs(2, 8, 5, 19, torch.float32, CPU, hidden=[20, 13], n_layers=3, activation=activation))


def test_four_layers_odd_sizes():
    _check(*_inputs(1, 7, 3, 7, torch.float32, CPU, hidden=[9, 17, 5], n_layers=4, activation="silu"))


def test_lengths_prefix_gaps_sum():
    f, b, tokens, head = _inputs(2, 13, 5, 11, torch.float32, CPU)
    _check(f, b, tokens, head, lengths=torch.tensor([13, 8]), prefix_start=torch.tensor([2, 1]),
           min_gap=3, max_gap=6, next_weight=0.3, reduction="sum")


def test_next_weight_extremes():
    f, b, tokens, head = _inputs(2, 7, 5, 11, torch.float32, CPU)
    _check(f, b, tokens, head, next_weight=1.0, lengths=torch.tensor([7, 5]))
    _check(f, b, tokens, head, next_weight=0.0, prefix_start=2)


def test_explicit_pairs():
    f, b, tokens, head = _inputs(2, 10, 5, 13, torch.float32, CPU)
    lengths = torch.tensor([10, 7])
    mask = _pairs.pair_mask(lengths, torch.zeros(2, dtype=torch.long), 2, 10, 10)
    row, i, j = mask.nonzero(as_tuple=True)
    keep = torch.randperm(row.numel(), generator=torch.Generator().manual_seed(1))[:21]
    pairs = (row[keep], i[keep], j[keep])
    _check(f, b, tokens, head, lengths=lengths, pairs=pairs)
    _check(f, b, tokens, head, lengths=lengths, pairs=pairs, reduction="sum", next_weight=0.8)


def test_weighted_pair_list_direct():
    # the list path with unequal per-pair weights (what the subsampling estimator produces),
    # driven through _triton.pair_loss directly so it does not need the C++ sampler
    f, b, tokens, head = _inputs(2, 9, 5, 13, torch.float32, CPU, n_layers=3, activation="relu")
    lengths = torch.tensor([9, 9])
    p = _pairs.prepare(f, b, tokens, 13, lengths=lengths, prefix_start=0, min_gap=2, max_gap=None,
                       pairs=(torch.tensor([0, 1, 1, 0, 1]), torch.tensor([0, 2, 0, 3, 1]),
                              torch.tensor([5, 8, 2, 5, 4])), next_weight=0.5, reduction="mean", generator=None)
    p.weight = torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 3
    h64 = copy.deepcopy(head).double()
    f64, b64 = f.double().requires_grad_(), b.double().requires_grad_()
    ref = reference.pair_loss(f64, b64, tokens, h64, p, 0.6, 13)
    ref_g = torch.autograd.grad(ref * 1.3, [f64, b64, *h64.parameters()])
    f32, b32 = f.clone().requires_grad_(), b.clone().requires_grad_()
    out = _triton.pair_loss(f32, b32, tokens, head, p, 0.6)
    g = torch.autograd.grad(out * 1.3, [f32, b32, *head.parameters()])
    assert _rel(out, ref) < 1e-5
    for x, y in zip(g, ref_g):
        assert _rel(x, y) < 1e-4


def test_float16_tiny_weights():
    # a mean over a million pairs weighs each by 1e-6: w * (softmax - onehot) must not underflow
    # to zero as a float16 dot operand
    f, b, tokens, head = _inputs(1, 9, 5, 13, torch.float32, CPU)
    p = _pairs.prepare(f, b, tokens, 13, lengths=None, prefix_start=0, min_gap=2, max_gap=None,
                       pairs=None, next_weight=0.5, reduction="sum", generator=None)
    p.scale = torch.tensor(2e-5, dtype=torch.float64)  # gradients stay normal float16 numbers
    h64 = copy.deepcopy(head).double()
    f64, b64 = f.double().requires_grad_(), b.double().requires_grad_()
    ref = reference.pair_loss(f64, b64, tokens, h64, p, 0.5, 13)
    ref_g = torch.autograd.grad(ref, [f64, b64, *h64.parameters()])
    h16 = copy.deepcopy(head).half()
    f16, b16 = f.half().requires_grad_(), b.half().requires_grad_()
    out = _triton.pair_loss(f16, b16, tokens, h16, p, 0.5)
    g = torch.autograd.grad(out, [f16, b16, *h16.parameters()])
    assert _rel(out, ref) < 1e-2
    for x, y in zip(g, ref_g):
        assert _rel(x, y) < 2e-2


def test_subsampled_pairs():
    pytest.importorskip("bst_fast._ops")  # the sampler is the C++ extension's
    f, b, tokens, head = _inputs(2, 12, 5, 11, torch.float32, CPU)
    for pairs in (0.3, 4):
        scale = 1.7
        ref = _run(f, b, tokens, head, torch.float64, scale, backend="reference", pairs=pairs,
                   generator=torch.Generator().manual_seed(5))
        out = _run(f, b, tokens, head, torch.float32, scale, backend="triton", pairs=pairs,
                   generator=torch.Generator().manual_seed(5))
        assert _rel(out[0], ref[0]) < 1e-5
        for x, y in zip(out[1], ref[1]):
            assert _rel(x, y) < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _check(*_inputs(2, 9, 5, 19, dtype, CPU, n_layers=3, activation="gelu"), dtype=dtype)


def test_no_grad_and_partial_grad():
    f, b, tokens, head = _inputs(1, 8, 5, 11, torch.float32, CPU)
    with torch.no_grad():
        out = belief_state_loss(f, b, tokens, head, backend="triton")
    ref = belief_state_loss(f.double(), b.double(), tokens, copy.deepcopy(head).double(), backend="reference")
    assert not out.requires_grad and _rel(out, ref) < 1e-5
    # only f needs a gradient: the head is frozen and b is a constant
    head.requires_grad_(False)
    fr = f.clone().requires_grad_()
    (gf,) = torch.autograd.grad(belief_state_loss(fr, b, tokens, head, backend="triton"), [fr])
    f64 = f.double().requires_grad_()
    (gr,) = torch.autograd.grad(belief_state_loss(f64, b.double(), tokens, copy.deepcopy(head).double(),
                                                  backend="reference"), [f64])
    assert _rel(gf, gr) < 1e-4


@pytest.mark.parametrize("explicit", [False, True])
def test_deterministic(explicit):
    f, b, tokens, head = _inputs(2, 9, 5, 13, torch.float32, CPU, n_layers=3)
    dev = f.device
    p = _pairs.prepare(f, b, tokens, 13, lengths=torch.tensor([9, 8]), prefix_start=1, min_gap=2, max_gap=None,
                       pairs=None, next_weight=0.5, reduction="mean", generator=None)
    if explicit:
        row, i, j = _pairs.pair_mask(p.lengths, p.prefix_start, 2, 9, 9).nonzero(as_tuple=True)
        p = _pairs.prepare(f, b, tokens, 13, lengths=p.lengths, prefix_start=1, min_gap=2, max_gap=None,
                           pairs=(row, i, j), next_weight=0.5, reduction="mean", generator=None)
    runs = []
    for _ in range(2):
        fr, br = f.clone().requires_grad_(), b.clone().requires_grad_()
        out = _triton.pair_loss(fr, br, tokens, head, p, 0.4, deterministic=True)
        runs.append([out.detach(), *torch.autograd.grad(out, [fr, br, *head.parameters()])])
    assert all(torch.equal(x, y) for x, y in zip(*runs))
    h64 = copy.deepcopy(head).double()
    f64, b64 = f.double().requires_grad_(), b.double().requires_grad_()
    ref = reference.pair_loss(f64, b64, tokens, h64, p, 0.4, 13)
    ref_g = torch.autograd.grad(ref, [f64, b64, *h64.parameters()])
    assert _rel(runs[0][0], ref) < 1e-5
    for x, y in zip(runs[0][1:], ref_g):
        assert _rel(x, y) < 1e-4


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_layers,V", [(2, 1000), (3, 517)])
def test_cuda_realistic(dtype, n_layers, V):
    dev = torch.device("cuda")
    f, b, tokens, head = _inputs(4, 67, 96, V, dtype, dev, hidden=160, n_layers=n_layers, activation="gelu")
    with torch.no_grad():
        for q in head.parameters():
            q.mul_(0.3)
    lengths = torch.tensor([67, 50, 33, 64], device=dev)
    _check(f, b, tokens, head, dtype=dtype, lengths=lengths, prefix_start=torch.tensor([0, 3, 1, 5], device=dev))
    _check(f, b, tokens, head, dtype=dtype, max_gap=20, next_weight=0.25, reduction="sum")


@pytest.mark.cuda
@cuda
def test_cuda_explicit_pairs():
    dev = torch.device("cuda")
    f, b, tokens, head = _inputs(3, 40, 64, 333, torch.float32, dev, hidden=[128, 72], n_layers=3)
    mask = _pairs.pair_mask(torch.full((3,), 40, device=dev), torch.zeros(3, dtype=torch.long, device=dev), 2, 40, 40)
    row, i, j = mask.nonzero(as_tuple=True)
    keep = torch.randperm(row.numel(), device=dev)[:1000]
    _check(f, b, tokens, head, pairs=(row[keep], i[keep], j[keep]))


_COMPILE = r'''
import inspect, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bst_fast._triton import _pair_kernel, CONFIG

const = ("NH", "HP", "BI", "BJ", "BK", "BV", "ACT", "MODE", "NEED_GRAD", "PREC", "UP", "DET")
ptr = dict(tok="*i64", lengths="*i64", pstart="*i64", tiles="*i32", prow="*i64", pi="*i64", pj="*i64",
           Wh="W", WL="W", cL="W", Hs="W")
cfg = CONFIG["cuda"]
for wdt, prec, NH, MODE, ACT, HP in (("*bf16", "tf32", 1, 0, 2, 512), ("*fp16", "tf32", 3, 1, 3, 32),
                                     ("*fp32", "ieee", 2, 0, 4, 32)):
    sig = {}
    for n in inspect.signature(_pair_kernel.fn).parameters:
        if n in const:
            sig[n] = "constexpr"
        elif n == "lam":
            sig[n] = "fp32"
        elif n in ("n_tiles", "n_pairs", "L", "H1", "HL", "V", "min_gap", "max_gap"):
            sig[n] = "i32"
        else:
            sig[n] = wdt if ptr.get(n) == "W" else ptr.get(n, "*fp32")
    c = dict(NH=NH, HP=HP, BI=cfg["BI"], BJ=cfg["BJ"], BK=min(cfg["BK"], HP), BV=cfg["BV"], ACT=ACT,
             MODE=MODE, NEED_GRAD=True, PREC=prec, UP=False, DET=MODE == 1)
    k = triton.compile(ASTSource(fn=_pair_kernel, signature=sig, constexprs=c),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"]))
    assert k.asm["cubin"], "no cubin"
print("compiled")
'''


def test_compiles_for_cuda_sm90():
    """The kernel must be CUDA Triton, not only interpretable: compile it for sm_90 with Triton's own ptxas."""
    import os
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the cuda tests compile and run the kernel for real")
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_bf16_compute_for_an_fp32_model():
    """What CUDA autocast selects: fp32 f, b and head, bf16 dot operands, fp32 accumulation. The
    error is that of bf16 rounding of the hidden states and the last layer, not worse."""
    f, b, tokens, head = _inputs(2, 9, 5, 19, torch.float32, CPU, n_layers=3)
    p = _pairs.prepare(f, b, tokens, 19, lengths=None, prefix_start=0, min_gap=2, max_gap=None,
                       pairs=None, next_weight=0.5, reduction="mean", generator=None)
    fr, br = f.clone().requires_grad_(), b.clone().requires_grad_()
    out = _triton.pair_loss(fr, br, tokens, head, p, 0.5, compute_dtype=torch.bfloat16)
    grads = torch.autograd.grad(out, [fr, br, *head.parameters()])
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    h64 = copy.deepcopy(head).double()
    f64, b64 = f.double().requires_grad_(), b.double().requires_grad_()
    ref = reference.pair_loss(f64, b64, tokens, h64, p, 0.5, 19)
    ref_g = torch.autograd.grad(ref, [f64, b64, *h64.parameters()])
    assert _rel(out, ref) < 2e-2
    assert 1e-7 < _rel(out, ref)  # it really computed in bf16
    for x, y in zip(grads, ref_g):
        assert _rel(x, y) < 5e-2
