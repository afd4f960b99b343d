"""Pins for four bugs a mutation audit planted that the rest of the suite did not catch:
the backward encoder's reading order (docs/contract.md §1), TextData.held_out_lengths, the segment
kernels' launch shape (gather_config's seg_BK) and Floyd's collision rule in the C++ sampler's
sparse branch (docs/contract.md §5)."""
import copy

import numpy as np
import pytest
import torch

import bst_fast
from bst_fast.data import TextData
from bst_fast.model import BeliefStateTransformer, ModelConfig

from _helpers import switch

PAD, BOS, EOS = 0, 1, 2


# --------------------------------------------------------------------------------------------
# 1. b's alignment (docs/contract.md §1): b[r, j] has read tokens[r, j .. len_r - 1], backwards.


def _ragged_batch(g, lengths, L, V):
    """(B, L) rows [BOS, content, EOS, PAD ...] with content ids in [3, V)."""
    tokens = torch.full((len(lengths), L), PAD, dtype=torch.long)
    for r, n in enumerate(lengths):
        tokens[r, 0] = BOS
        tokens[r, 1:n - 1] = torch.randint(3, V, (n - 2,), generator=g)
        tokens[r, n - 1] = EOS
    return tokens


def _backward_reader(model):
    """The encoder that reads suffixes (the shared one with its backward segment when shared)."""
    if getattr(model, "backward_encoder", None) is not None:
        return lambda x: model.backward_encoder(x)
    return lambda x: model.forward_encoder(x, segment=1)


@pytest.mark.parametrize("shared", [False, True])
def test_suffix_states_read_the_suffix_backwards(shared):
    """b[r, j] is the backward encoder's state after reading tokens[r, j:len_r] reversed (contract §1)."""
    V, L = 17, 11
    cfg = ModelConfig(vocab_size=V, max_len=16, n_layer=2, d_model=16, n_head=2, head_hidden=16,
                      shared_encoders=shared)
    torch.manual_seed(0)
    model = BeliefStateTransformer(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    lengths = [11, 7, 4, 9]
    tokens = _ragged_batch(g, lengths, L, V)
    len_t = torch.tensor(lengths)
    read = _backward_reader(model)
    with torch.no_grad():
        b = model.suffix_states(tokens, len_t)
        assert b.shape == (len(lengths), L, cfg.d_model) and b.dtype == torch.float64
        for r, n in enumerate(lengths):
            for j in range(n):
                suffix = tokens[r, j:n].flip(0)[None]          # read from the end back to j
                want = read(suffix)[0, -1]
                torch.testing.assert_close(b[r, j], want, rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"b[{r}, {j}] (len {n}) is not the suffix read backwards: {m}")
            # the empty suffix: the state of EOS alone (contract §7's B(∅))
            torch.testing.assert_close(b[r, n - 1], model.empty_suffix(EOS), rtol=1e-10, atol=1e-12)


def test_suffix_states_ignore_the_prefix_and_the_padding():
    """Changing tokens[:, :j] or the padding leaves b[:, j:len] unchanged; a suffix alone gives the same b (contract §1)."""
    V, L = 17, 12
    cfg = ModelConfig(vocab_size=V, max_len=16, n_layer=2, d_model=16, n_head=2, head_hidden=16)
    torch.manual_seed(2)
    model = BeliefStateTransformer(cfg).double().eval()
    g = torch.Generator().manual_seed(3)
    lengths = [12, 8, 5]
    tokens = _ragged_batch(g, lengths, L, V)
    len_t = torch.tensor(lengths)
    with torch.no_grad():
        b = model.suffix_states(tokens, len_t)
        for j in (1, 3, 4):
            other = tokens.clone()
            other[:, :j] = torch.randint(3, V, (len(lengths), j), generator=g)  # BOS included
            for r, n in enumerate(lengths):
                if n > j and n < L:  # the padding changes too
                    other[r, n:] = torch.randint(3, V, (L - n,), generator=g)
            b2 = model.suffix_states(other, len_t)
            for r, n in enumerate(lengths):
                torch.testing.assert_close(b2[r, j:n], b[r, j:n], rtol=1e-12, atol=1e-13,
                                           msg=lambda m: f"b[{r}, {j}:] changed with tokens[{r}, :{j}]: {m}")
        # each suffix as a row of its own: its b at position 0 is the batch's b at j
        for r, n in enumerate(lengths):
            for j in range(n):
                alone = model.suffix_states(tokens[r:r + 1, j:n])[0, 0]
                torch.testing.assert_close(alone, b[r, j], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 2. TextData.held_out_lengths


def test_held_out_lengths_are_the_held_out_rows_lengths():
    """held_out_lengths[k] is held-out row k's length with BOS and EOS, as held_out_batches yields and as the documents give."""
    max_len = 9                     # content of 7 ids a row: longer documents are chunked
    doc_sizes = [1, 2, 3, 5, 7, 8, 11, 14, 15, 20, 4, 6, 9, 13, 22, 1, 7, 30]
    docs, nxt = [], 3
    for n in doc_sizes:             # every id once in the corpus: a row's first id tells where it came from
        docs.append(list(range(nxt, nxt + n)))
        nxt += n
    where = {tok: (d, k) for d, doc in enumerate(docs) for k, tok in enumerate(doc)}
    content = max_len - 2
    for seed, held_out in ((0, 0.2), (1, 0.35), (5, 0.1)):
        data = TextData.from_ids(docs, vocab_size=nxt, max_len=max_len, held_out=held_out, seed=seed,
                                 pad_id=PAD, bos_id=BOS, eos_id=EOS)
        assert data.n_held_out > 2
        lengths = data.held_out_lengths
        assert lengths.dtype == torch.int64 and lengths.shape == (data.n_held_out,)
        rows = [(t, n) for tokens, lens in data.held_out_batches(4) for t, n in zip(tokens, lens)]
        assert len(rows) == data.n_held_out
        expected = []
        for t, n in rows:
            t = t.tolist()
            eos_at = t.index(EOS)   # content ids are >= 3: the first EOS ends the row
            assert int(n) == eos_at + 1, "a batch's length is not its row's EOS position + 1"
            d, k = where[t[1]]      # the row's first content id: document d, offset k
            assert k % content == 0, "a held-out row does not start at a chunk boundary"
            size = min(content, len(docs[d]) - k)
            assert t[1:eos_at] == docs[d][k:k + size], "a held-out row is not a chunk of its document"
            expected.append(size + 2)
        assert lengths.tolist() == expected, (lengths.tolist(), expected)


# --------------------------------------------------------------------------------------------
# 3. The segment kernels launch with gather_config's seg_BK (not the gather's BK)

def _cuda_like_config(device_type, width, kind):
    """CUDA-like launch shapes with the gather's BK twice the segment sums' seg_BK (the interpreter's own are equal)."""
    return dict(BM=16, BK=32, hidden_warps=4, BS=8, seg_BK=16, seg_warps=2)


def _rel(x, y):
    x, y = x.detach().double(), y.detach().double()
    return ((x - y).norm() / y.norm().clamp_min(1e-300)).item()


def _grads(f, b, tokens, head, dtype, **opts):
    h = copy.deepcopy(head).to(dtype)
    f = f.detach().to(dtype).requires_grad_()
    b = b.detach().to(dtype).requires_grad_()
    loss = bst_fast.belief_state_loss(f, b, tokens, h, **opts)
    return [loss.detach(), *torch.autograd.grad(loss * 1.3, [f, b, *h.parameters()])]


def _spy_segment_kernels(monkeypatch):
    """Record (kernel, h, grid, BK, BS, num_warps) of every prefix/suffix segment-kernel launch."""
    from bst_fast.kernels import pair_hidden

    launches = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def launch(*args, **kw):
                h = args[0].shape[1]  # dH (n, h)
                launches.append((self.name, h, tuple(grid), kw["BK"], kw["BS"], kw.get("num_warps")))
                return self.kernel[grid](*args, **kw)
            return launch

    for name in ("prefix_grad_kernel", "suffix_grad_kernel"):
        monkeypatch.setattr(pair_hidden, name, Spy(name, getattr(pair_hidden, name)))
    return launches


def _segment_case(hidden=37):
    """A small float32 problem whose first hidden layer is `hidden` wide (odd, > 32)."""
    g = torch.Generator().manual_seed(11)
    B, L, m, V = 2, 7, 6, 5
    head = bst_fast.TextHead(m, V, hidden=hidden, n_layers=2, activation="gelu")
    with torch.no_grad():
        for q in head.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * 0.6)
    f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    return f, b, tokens, head, torch.tensor([7, 6])


@pytest.mark.parametrize("engine", ["triton", "torch_triton_ops"])
def test_segment_grads_with_cuda_like_block_shapes(engine, monkeypatch):
    """With the gather's BK != seg_BK (as on CUDA) the triton kernels' gradients still match the reference (contract §6)."""
    pytest.importorskip("triton")
    from bst_fast.backends import launch

    monkeypatch.setattr(launch, "gather_config", _cuda_like_config)
    switch(monkeypatch, triton_ops=True)
    launches = _spy_segment_kernels(monkeypatch)
    f, b, tokens, head, lengths = _segment_case()
    want = _grads(f, b, tokens, head, torch.float64, lengths=lengths, backend="reference")
    got = _grads(f, b, tokens, head, torch.float32, lengths=lengths,
                 backend="triton" if engine == "triton" else "torch")
    names = ["loss", "f", "b"] + [n for n, _ in head.named_parameters()]
    errors = {n: _rel(x, y) for n, x, y in zip(names, got, want)}
    assert {name for name, *_ in launches} == {"prefix_grad_kernel", "suffix_grad_kernel"}, "the kernels did not run"
    assert errors["loss"] < 1e-5, errors
    assert all(e < 1e-4 for e in errors.values()), errors


@pytest.mark.parametrize("engine", ["triton", "torch_triton_ops"])
def test_segment_kernels_launch_with_seg_bk(engine, monkeypatch):
    """segment_grads launches its prefix/suffix kernels with gather_config's BS, seg_BK and seg_warps, over cdiv(h, seg_BK) blocks."""
    pytest.importorskip("triton")
    from bst_fast.backends import launch

    monkeypatch.setattr(launch, "gather_config", _cuda_like_config)
    switch(monkeypatch, triton_ops=True)
    launches = _spy_segment_kernels(monkeypatch)
    f, b, tokens, head, lengths = _segment_case()
    _grads(f, b, tokens, head, torch.float32, lengths=lengths,
           backend="triton" if engine == "triton" else "torch")
    cfg = _cuda_like_config("cuda", 37, "act")
    assert {name for name, *_ in launches} == {"prefix_grad_kernel", "suffix_grad_kernel"}
    for name, h, grid, BK, BS, warps in launches:
        assert (BK, BS, warps) == (cfg["seg_BK"], cfg["BS"], cfg["seg_warps"]), (name, BK, BS, warps)
        assert grid[1] == -(-h // cfg["seg_BK"]), (name, h, grid)


# --------------------------------------------------------------------------------------------
# 4. The C++ sampler's sparse branch (Floyd's algorithm with a hash set)


@pytest.mark.parametrize("min_gap,max_gap,start", [(2, 1 << 40, 0), (3, 120, 17)])
def test_sampler_sparse_branch_draws_exactly_k_distinct_valid_pairs(min_gap, max_gap, start):
    """Every row gets exactly k distinct pairs of P_r when k < |P_r| / 64 (contract §5, Floyd's collision rule)."""
    from bst_fast.backends import cpp_backend  # noqa: F401  (registers the sampler op)

    B, n_tok, k = 50, 200, 150
    lengths = torch.full((B,), n_tok, dtype=torch.long)
    prefix_start = torch.full((B,), start, dtype=torch.long)
    i_all = torch.arange(n_tok)[:, None]
    j_all = torch.arange(n_tok)[None, :]
    valid = (i_all >= start) & (j_all - i_all >= min_gap) & (j_all - i_all <= max_gap) & (j_all <= n_tok - 1)
    n_pairs = int(valid.sum())
    assert k < n_pairs // 64, "these sizes must take the sampler's sparse (hash-set) branch"
    for seed in (0, 12345):
        ks = torch.full((B,), k, dtype=torch.long)
        row, i, j = torch.ops.bst_fast.sample_pairs(lengths, prefix_start, min_gap, max_gap, ks, seed)
        assert torch.bincount(row, minlength=B).tolist() == [k] * B, "not exactly k pairs in every row"
        assert bool(valid[i, j].all()), "a sampled pair is outside P_r (range or gap rule)"
        key = (row * n_tok + i) * n_tok + j
        assert key.unique().numel() == key.numel(), "a row holds the same pair twice"
        assert torch.equal(key, key.sort().values), "pairs are not sorted by (row, i, j)"
