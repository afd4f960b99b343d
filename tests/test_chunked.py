"""backend="chunked" against the float64 reference (SPEC §6) through TRITON_INTERPRET=1 on the CPU:
chunk boundaries everywhere (a chunk of 1 pair, prime sizes, one chunk), every activation, deep
heads, ragged rows, explicit and subsampled pairs, bf16/fp16, autocast, reproducibility."""
import copy

import pytest
import torch

from bst_fast import TextHead, belief_state_loss
from bst_fast.backends import chunked, configs

pytest.importorskip("triton")
if not torch.cuda.is_available():
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


@pytest.fixture
def chunk_pairs(monkeypatch):
    def set_(n):
        monkeypatch.setattr(configs, "CHUNK_PAIRS", n)
    return set_


def _inputs(B, L, m, V, hidden=12, n_layers=2, activation="gelu", seed=0):
    g = torch.Generator().manual_seed(seed)
    head = TextHead(m, V, hidden=hidden, n_layers=n_layers, activation=activation)
    with torch.no_grad():
        for q in head.parameters():  # larger than nn.Linear's default so the softmax is peaked
            q.copy_(torch.randn(q.shape, generator=g) * 0.7)
    f = torch.randn(B, L, m, generator=g)
    b = torch.randn(B, L, m, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    scale = 1.5 + torch.rand((), generator=g).item()  # a grad_output that is not 1
    return f.to(DEV), b.to(DEV), tokens.to(DEV), head.to(DEV), scale


def _run(f, b, tokens, head, dtype, scale, backend, **opts):
    if "seed" in opts:  # the same subsample in every run: a fresh generator each time
        opts["generator"] = torch.Generator().manual_seed(opts.pop("seed"))
    h = copy.deepcopy(head).to(dtype)
    f = f.detach().to(dtype).requires_grad_()
    b = b.detach().to(dtype).requires_grad_()
    loss = belief_state_loss(f, b, tokens, h, backend=backend, **opts)
    return loss.detach(), torch.autograd.grad(loss * scale, [f, b, *h.parameters()])


def _check(f, b, tokens, head, scale, dtype=torch.float32, **opts):
    ref_loss, ref_g = _run(f, b, tokens, head, torch.float64, scale, "reference", **opts)
    loss, g = _run(f, b, tokens, head, dtype, scale, "chunked", **opts)
    assert loss.dtype == torch.float32
    assert all(x.dtype == dtype for x in g)
    if dtype == torch.float32:
        assert _rel(loss, ref_loss) < 1e-5
        for x, y in zip(g, ref_g):
            assert _rel(x, y) < 1e-4
    else:  # at most 2x the error of the materialised computation in the same dtype, plus 1e-3
        mat_loss, mat_g = _run(f, b, tokens, head, dtype, scale, "reference", **opts)
        assert _rel(loss, ref_loss) <= 2 * _rel(mat_loss, ref_loss) + 1e-3
        for x, y, z in zip(g, ref_g, mat_g):
            assert _rel(x, y) <= 2 * _rel(z, y) + 1e-3


@pytest.mark.parametrize("chunk", [1, 7, 23, None])
def test_chunk_boundaries(chunk, chunk_pairs):
    chunk_pairs(chunk)
    f, b, tokens, head, scale = _inputs(2, 9, 5, 7, seed=chunk or 0)
    _check(f, b, tokens, head, scale)


@pytest.mark.parametrize("activation", ["relu", "leaky_relu", "gelu", "gelu_tanh", "silu"])
def test_activations(activation, chunk_pairs):
    chunk_pairs(11)
    f, b, tokens, head, scale = _inputs(2, 8, 4, 6, activation=activation, seed=3)
    _check(f, b, tokens, head, scale)


def test_deep_head_ragged_rows(chunk_pairs):
    chunk_pairs(13)
    f, b, tokens, head, scale = _inputs(3, 11, 6, 13, hidden=[10, 7, 9], n_layers=4, activation="silu", seed=4)
    _check(f, b, tokens, head, scale, lengths=torch.tensor([11, 5, 8], device=DEV),
           prefix_start=torch.tensor([0, 2, 1], device=DEV), max_gap=4, min_gap=3, next_weight=0.3)


def test_padding_holds_nan(chunk_pairs):
    """Positions past a row's length are in no pair: NaN there must not reach the loss or gradients."""
    chunk_pairs(5)
    f, b, tokens, head, scale = _inputs(2, 9, 5, 7, seed=5)
    lengths = torch.tensor([9, 6], device=DEV)
    f[1, 6:] = float("nan")
    b[1, 6:] = float("nan")
    loss, g = _run(f, b, tokens, head, torch.float32, scale, "chunked", lengths=lengths)
    assert torch.isfinite(loss) and all(torch.isfinite(x).all() for x in g)
    _check(f.nan_to_num(0.0), b.nan_to_num(0.0), tokens, head, scale, lengths=lengths)


def test_explicit_pairs_any_order_with_repeats(chunk_pairs):
    chunk_pairs(4)
    f, b, tokens, head, scale = _inputs(2, 10, 4, 6, seed=6)
    row = torch.tensor([1, 0, 1, 0, 0, 1], device=DEV)
    i = torch.tensor([3, 0, 2, 1, 0, 3], device=DEV)
    j = torch.tensor([9, 5, 6, 3, 5, 9], device=DEV)  # (0, 0, 5) and (1, 3, 9) twice
    _check(f, b, tokens, head, scale, pairs=(row, i, j), reduction="sum")


def test_subsampled_pairs(chunk_pairs):
    chunk_pairs(6)
    f, b, tokens, head, scale = _inputs(2, 10, 4, 6, seed=7)
    _check(f, b, tokens, head, scale, pairs=0.4, seed=1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, chunk_pairs):
    chunk_pairs(17)
    f, b, tokens, head, scale = _inputs(2, 12, 6, 9, hidden=16, seed=8)
    _check(f, b, tokens, head, scale, dtype=dtype)


def test_fp16_mean_gradients_do_not_underflow(chunk_pairs):
    """With reduction="mean" a pair's weight is 1/|P|; in fp16 w * (softmax - onehot) would be
    subnormal. The kernels work in units of the largest weight, so the gradient keeps its digits."""
    chunk_pairs(64)
    f, b, tokens, head, scale = _inputs(2, 40, 4, 6, hidden=8, seed=9)
    _check(f, b, tokens, head, scale, dtype=torch.float16)


def test_bitwise_reproducible(chunk_pairs):
    chunk_pairs(9)
    f, b, tokens, head, scale = _inputs(2, 10, 4, 6, seed=10)
    l1, g1 = _run(f, b, tokens, head, torch.float32, scale, "chunked")
    l2, g2 = _run(f, b, tokens, head, torch.float32, scale, "chunked")
    assert torch.equal(l1, l2) and all(torch.equal(x, y) for x, y in zip(g1, g2))


def test_no_grad_forward_only(chunk_pairs):
    chunk_pairs(5)
    f, b, tokens, head, _ = _inputs(2, 9, 5, 7, seed=11)
    with torch.no_grad():
        loss = belief_state_loss(f, b, tokens, head, backend="chunked")
        ref = belief_state_loss(f.double(), b.double(), tokens, copy.deepcopy(head).double(), backend="reference")
    assert not loss.requires_grad
    assert _rel(loss, ref) < 1e-5


def test_pair_list_schedule():
    """The sorted pair list, its segments and the chunk table describe exactly the pair set."""
    from bst_fast import _pairs
    f, b, tokens, head, _ = _inputs(3, 9, 4, 5, seed=12)
    lengths = torch.tensor([9, 4, 7], device=DEV)
    p = _pairs.prepare(f, b, tokens, 5, lengths=lengths, prefix_start=torch.tensor([1, 0, 2], device=DEV),
                       min_gap=2, max_gap=5, pairs=None, next_weight=0.5, reduction="mean", generator=None)
    pl = chunked.pair_list(p, 3, 9, chunk=5)
    mask = _pairs.pair_mask(p.lengths, p.prefix_start, p.min_gap, p.max_gap, 9)
    r, i, j = mask.nonzero(as_tuple=True)
    assert torch.equal(pl.ia.long(), r * 9 + i) and torch.equal(pl.ib.long(), r * 9 + j)
    n = pl.ia.numel()
    assert [c[0] for c in pl.chunks] == list(range(0, n, 5)) and sum(c[1] for c in pl.chunks) == n
    assert torch.equal(pl.ib[pl.perm.long()], pl.ib.sort(stable=True).values)
    for s0, k, pre_lo, pre_hi, suf_lo, suf_hi in pl.chunks:
        assert pre_lo <= pl.ia[s0].item() and pl.ia[s0 + k - 1].item() < pre_hi
        assert suf_lo == pl.ib[s0 : s0 + k].min().item() and suf_hi == pl.ib[s0 : s0 + k].max().item() + 1


def test_auto_picks_chunked_on_cuda_only():
    from bst_fast.backends import pick
    f, b, tokens, head, _ = _inputs(1, 5, 4, 5)
    assert pick("auto", head, f).name == ("chunked" if DEV == "cuda" else "cpp")
    assert pick("auto", torch.nn.Linear(8, 10), f).name == ("chunked" if False else "torch")
