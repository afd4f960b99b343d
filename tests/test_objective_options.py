"""The objective options of the official implementation: min_gap=1 with meet_token (docs/contract.md §8)
and reduction="row_mean" (§9), on every backend, against a brute-force loop over pairs written from the
contract's definitions (not from reference.py), losses and gradients."""
import copy
import functools
import itertools
from collections import Counter

import pytest
import torch

from _helpers import TOL, brute_force, checked_draw, contract_weights, grads_of, make_head, random_grad_out, rel_err, switch
from bst_fast import BeliefStateLoss, belief_state_loss
from bst_fast import _pairs

B, L, m, V = 4, 11, 5, 7
MEET = 3  # an ordinary id of these random rows, so a wrong label rule shows
LENGTHS = [11, 6, 2, 1]  # ragged: full, short, (BOS, EOS) alone (one gap-1 pair), no pair at all
PREFIX_START = [0, 1, 0, 0]
# rows 0 and 1 only (rows 2 and 3 list none); gap-1 pairs, and one pair listed twice
EXPLICIT = ((0, 0, 1), (0, 3, 4), (0, 2, 7), (0, 2, 7), (0, 9, 10), (1, 1, 2), (1, 1, 5), (1, 3, 5))

CASES = {
    "meet": dict(min_gap=1, meet_token=MEET),
    "meet_max_gap_sum": dict(min_gap=1, meet_token=MEET, max_gap=3, next_weight=0.3, reduction="sum"),
    "row_mean": dict(reduction="row_mean"),
    "meet_row_mean": dict(min_gap=1, meet_token=MEET, reduction="row_mean", next_weight=0.7),
    "meet_explicit": dict(min_gap=1, meet_token=MEET, pairs=EXPLICIT),
    "meet_row_mean_explicit": dict(min_gap=1, meet_token=MEET, reduction="row_mean", pairs=EXPLICIT),
    "meet_row_mean_fraction": dict(min_gap=1, meet_token=MEET, reduction="row_mean", pairs=0.4, seed=5),
    "meet_count": dict(min_gap=1, meet_token=MEET, pairs=3, seed=6),
    "row_mean_count_max_gap": dict(reduction="row_mean", pairs=2, max_gap=5, seed=7),
}
# (name, belief_state_loss backend, dtype, torch backend's engine: Triton kernels or torch ops)
BACKENDS = [("reference", "reference", torch.float64, None), ("torch", "torch", torch.float64, None),
            ("torch_triton_ops", "torch", torch.float32, True), ("cpp", "cpp", torch.float32, None),
            ("triton", "triton", torch.float32, None)]


def inputs(seed=0):
    """(f, b, tokens, head) in float64 holding float32 values: the float32 backends get the same numbers."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, L, m, generator=g).double()
    b = torch.randn(B, L, m, generator=g).double()
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = make_head(m, V, hidden=[6, 5], n_layers=3, seed=seed).double()
    return f, b, tokens, head


def pair_set(r, min_gap, max_gap, lengths=LENGTHS, prefix_start=PREFIX_START):
    """P_r of docs/contract.md §2, enumerated."""
    top = L if max_gap is None else max_gap
    return [(i, j) for i in range(L) for j in range(L)
            if prefix_start[r] <= i and i + min_gap <= j <= min(i + top, lengths[r] - 1)]


def opts_of(case):
    """belief_state_loss's options of a case: explicit pairs as tensors, a fresh generator for a seed."""
    opts = dict(CASES[case])
    if isinstance(opts.get("pairs"), tuple):
        opts["pairs"] = tuple(torch.tensor(x) for x in zip(*opts["pairs"]))
    if "seed" in opts:
        opts["generator"] = torch.Generator().manual_seed(opts.pop("seed"))
    return dict(lengths=torch.tensor(LENGTHS), prefix_start=torch.tensor(PREFIX_START), **opts)


def chosen_pairs(case, f, b, tokens):
    """The case's pairs as (r, i, j) and their weights, from the contract: §4 (all pairs), §5 (explicit,
    and sampled: the draw is the sampler's, its size and every weight recomputed here), §9 (row_mean)."""
    spec = CASES[case]
    min_gap, max_gap, reduction = spec.get("min_gap", 2), spec.get("max_gap"), spec.get("reduction", "mean")
    full = [len(pair_set(r, min_gap, max_gap)) for r in range(B)]
    pairs = spec.get("pairs")
    if pairs is None:
        chosen = [(r, i, j) for r in range(B) for i, j in pair_set(r, min_gap, max_gap)]
    elif isinstance(pairs, tuple):
        chosen = list(pairs)
    else:  # the sampler's draw (same generator seed), checked against §5 here
        o = opts_of(case)
        p = _pairs.prepare(f, b, tokens, V, **{k: o.get(k) for k in ("lengths", "prefix_start", "max_gap", "generator")},
                           min_gap=min_gap, meet_token=spec.get("meet_token"), pairs=pairs, next_weight=0.5,
                           reduction=reduction)
        chosen = checked_draw(p, [pair_set(r, min_gap, max_gap) for r in range(B)], pairs)
    kind = "all" if pairs is None else "sampled" if isinstance(pairs, (int, float)) else "listed"
    weights = contract_weights(chosen, full, kind, reduction, B)
    return chosen, weights


@functools.lru_cache(maxsize=None)
def expected(case):
    """The brute-force loss and gradients (f, b, every head parameter) of a case, in float64."""
    f, b, tokens, head = inputs()
    chosen, weights = chosen_pairs(case, f, b, tokens)
    f, b = f.requires_grad_(), b.requires_grad_()
    spec = CASES[case]
    loss = brute_force(f, b, tokens, head, chosen, weights, spec.get("meet_token"), spec.get("next_weight", 0.5))
    return grads_of(loss, f, b, head, random_grad_out(len(case)))


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 13 pairs in the triton and torch backends: chunk boundaries inside rows."""
    switch(monkeypatch, chunk_pairs=13)


@pytest.mark.parametrize("name,backend,dtype,triton_ops", BACKENDS, ids=[x[0] for x in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_against_brute_force(case, name, backend, dtype, triton_ops, small_chunks, monkeypatch):
    if triton_ops or backend == "triton":
        pytest.importorskip("triton")
    switch(monkeypatch, triton_ops=triton_ops)
    f, b, tokens, head = inputs()
    f, b, head = f.to(dtype).requires_grad_(), b.to(dtype).requires_grad_(), copy.deepcopy(head).to(dtype)
    loss = belief_state_loss(f, b, tokens, head, backend=backend, **opts_of(case))
    got = grads_of(loss, f, b, head, random_grad_out(len(case)))
    want = expected(case)
    tol_loss, tol_grad = TOL[dtype]
    assert rel_err(got[0], want[0]) < tol_loss, (got[0], want[0])
    names = ["f", "b"] + [n for n, _ in head.named_parameters()]
    for n, g, w in zip(names, got[1:], want[1:]):
        assert g.dtype == dtype and rel_err(g, w) < tol_grad, (n, rel_err(g, w))


def test_cpp_many_tiles_and_threads():
    """Longer rows: the C++ engine's several tiles (256 pairs) over 2 threads, each pair's row scale and
    meet label, against the brute force."""
    g = torch.Generator().manual_seed(3)
    Bn, Ln = 3, 31
    lengths, start = [31, 24, 9], [0, 2, 1]
    f = torch.randn(Bn, Ln, m, generator=g)
    b = torch.randn(Bn, Ln, m, generator=g)
    tokens = torch.randint(0, V, (Bn, Ln), generator=g)
    head = make_head(m, V, hidden=8, n_layers=2, seed=3)
    chosen = [(r, i, j) for r in range(Bn) for i in range(Ln) for j in range(Ln)
              if start[r] <= i and i + 1 <= j <= lengths[r] - 1]
    n_r = Counter(r for r, _, _ in chosen)
    go = 0.8
    f64, b64, h64 = f.double().requires_grad_(), b.double().requires_grad_(), copy.deepcopy(head).double()
    want = grads_of(brute_force(f64, b64, tokens, h64, chosen, [1 / (n_r[r] * Bn) for r, _, _ in chosen], MEET, 0.5),
                    f64, b64, h64, go)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        f, b = f.requires_grad_(), b.requires_grad_()
        loss = belief_state_loss(f, b, tokens, head, lengths=torch.tensor(lengths), prefix_start=torch.tensor(start),
                                 min_gap=1, meet_token=MEET, reduction="row_mean", backend="cpp")
        got = grads_of(loss, f, b, head, go)
    finally:
        torch.set_num_threads(threads)
    assert len(chosen) > 2 * 256
    assert rel_err(got[0], want[0]) < 1e-5
    for g_, w in zip(got[1:], want[1:]):
        assert rel_err(g_, w) < 1e-4


def test_counts_include_meet_pairs():
    """pair_counts, prefix_counts and pair_mask with min_gap = 1 are the enumerated P_r (gap-1 pairs in),
    and with no limit |P_r| = len_r (len_r - 1) / 2 from prefix_start 0 (docs/contract.md §8)."""
    g = torch.Generator().manual_seed(11)
    for _ in range(4):
        lengths = torch.randint(0, L + 1, (B,), generator=g)
        start = torch.randint(0, 4, (B,), generator=g)
        for max_gap in (1, 3, L):
            counts = _pairs.pair_counts(lengths, start, 1, max_gap, L)
            per_prefix = _pairs.prefix_counts(lengths, start, 1, max_gap, L)
            mask = _pairs.pair_mask(lengths, start, 1, max_gap, L)
            for r in range(B):
                want = pair_set(r, 1, max_gap, lengths.tolist(), start.tolist())
                assert int(counts[r]) == len(want)
                assert sorted(map(tuple, mask[r].nonzero().tolist())) == want
                assert per_prefix[r].tolist() == [sum(1 for i, _ in want if i == a) for a in range(L)]
    lengths = torch.arange(L + 1)
    counts = _pairs.pair_counts(lengths, torch.zeros_like(lengths), 1, L, L)
    assert counts.tolist() == [n * (n - 1) // 2 for n in range(L + 1)]


def test_sampler_draws_meet_pairs_uniformly():
    """The C++ sampler with min_gap = 1: k_r distinct pairs of P_r (gap-1 pairs in), sorted, each pair
    drawn with probability k_r / |P_r| (5 standard deviations over 3000 draws)."""
    lengths, start, k = torch.tensor([7, 4, 2, 1]), torch.tensor([0, 1, 0, 0]), torch.tensor([4, 2, 1, 0])
    sets = [pair_set(r, 1, None, lengths.tolist(), start.tolist()) for r in range(4)]
    hits, n = Counter(), 3000
    for seed in range(n):
        row, i, j = torch.ops.bst_fast.sample_pairs(lengths, start, 1, L, k, seed)
        drawn = list(zip(row.tolist(), i.tolist(), j.tolist()))
        assert drawn == sorted(set(drawn))
        for r in range(4):
            got = [(a, c) for rr, a, c in drawn if rr == r]
            assert len(got) == int(k[r]) and set(got) <= set(sets[r])
        hits.update(drawn)
    for r in range(3):
        p = int(k[r]) / len(sets[r])
        for i, j in sets[r]:
            sd = (n * p * (1 - p)) ** 0.5
            assert abs(hits[(r, i, j)] - n * p) <= 5 * sd + 1e-9, (r, i, j, hits[(r, i, j)], n * p)


def test_row_mean_subsample_is_exactly_unbiased():
    """docs/contract.md §9: with the weights the library gives sampled pairs (1 / (k_r B)), the average
    of the estimate over every possible draw (all k_r-subsets of each row) is row_mean, exactly."""
    f, b, tokens, head = inputs(seed=4)
    lengths, start = [6, 5, 2, 1], [0, 1, 0, 0]
    k = 3
    with torch.no_grad():
        def l(r, i, j):
            return brute_force(f, b, tokens, head, [(r, i, j)], [1.0], MEET, 0.5).item()
        sets = [pair_set(r, 1, None, lengths, start) for r in range(B)]
        row_mean = sum(sum(l(r, i, j) for i, j in s) / len(s) for r, s in enumerate(sets) if s) / B
        p = _pairs.prepare(f, b, tokens, V, lengths=torch.tensor(lengths), prefix_start=torch.tensor(start),
                           min_gap=1, max_gap=None, meet_token=MEET, pairs=k, next_weight=0.5,
                           reduction="row_mean", generator=torch.Generator().manual_seed(0))
        expectation = 0.0
        for r, s in enumerate(sets):
            w = set(p.weight[p.row == r].tolist())
            assert len(w) == (1 if s else 0)  # one weight for all of a row's sampled pairs
            if s:
                subsets = list(itertools.combinations(s, min(k, len(s))))
                expectation += w.pop() * sum(l(r, i, j) for sub in subsets for i, j in sub) / len(subsets)
        assert expectation == pytest.approx(row_mean, rel=1e-12)


def test_meet_token_without_gap_one_pairs_changes_nothing():
    """With min_gap >= 2 no pair has gap 1: a meet_token is checked, then every backend runs as without it
    (bitwise), the pair set carrying no token."""
    f, b, tokens, head = inputs(seed=2)
    f, b, head = f.float(), b.float(), copy.deepcopy(head).float()
    p = _pairs.prepare(f, b, tokens, V, lengths=None, prefix_start=0, min_gap=2, max_gap=None, meet_token=MEET,
                       pairs=None, next_weight=0.5, reduction="mean", generator=None)
    assert p.meet_token is None and _pairs.pair_list(p, B, L, 10).meet_token is None
    for backend in ("cpp", "torch", "reference"):
        assert torch.equal(belief_state_loss(f, b, tokens, head, meet_token=MEET, backend=backend),
                           belief_state_loss(f, b, tokens, head, backend=backend))


def test_module_form_takes_the_options():
    f, b, tokens, head = inputs(seed=1)
    opts = dict(min_gap=1, meet_token=MEET, reduction="row_mean", lengths=torch.tensor(LENGTHS), backend="torch")
    assert torch.equal(BeliefStateLoss(head, **opts)(f, b, tokens), belief_state_loss(f, b, tokens, head, **opts))


@pytest.mark.parametrize("backend", ["reference", "torch", "cpp", "triton"])
@pytest.mark.parametrize("bad,error", [
    (dict(min_gap=1), "min_gap=1 needs meet_token"),
    (dict(min_gap=0, meet_token=MEET), r"min_gap must be an int >= 2 \(or 1 with meet_token"),
    (dict(min_gap=1, meet_token=V), r"meet_token must lie in \[0, vocab_size=7\), got 7"),
    (dict(min_gap=1, meet_token=-1), r"meet_token must lie in \[0, vocab_size=7\), got -1"),
    (dict(min_gap=1, meet_token=2**70), r"meet_token must lie in \[0, vocab_size=7\)"),
    (dict(meet_token=V + 5), r"meet_token must lie in \[0, vocab_size=7\)"),  # checked with min_gap >= 2 too
    (dict(min_gap=1, meet_token=3.0), "meet_token must be None or an int token id, got float"),
    (dict(min_gap=1, meet_token="eos"), "meet_token must be None or an int token id, got str"),
    (dict(min_gap=1, meet_token=torch.tensor(3)), "meet_token must be None or an int token id, got Tensor"),
    (dict(min_gap=1, meet_token=True), "meet_token must be None or an int token id, got bool"),
    (dict(meet_token=False), "meet_token must be None or an int token id, got bool"),
    (dict(reduction="rowmean"), r"reduction must be one of \('mean', 'sum', 'row_mean'\), got 'rowmean'"),
    (dict(reduction=None), "reduction must be one of"),
    (dict(meet_token=MEET, pairs=(torch.tensor([0]), torch.tensor([2]), torch.tensor([3]))), r"pairs\[0\]"),
], ids=["min_gap_1_no_meet", "min_gap_0", "meet_V", "meet_negative", "meet_huge", "meet_V_min_gap_2",
        "meet_float", "meet_str", "meet_tensor", "meet_true", "meet_false", "reduction_unknown", "reduction_none",
        "gap_1_pair_with_min_gap_2"])
def test_bad_input(bad, error, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    f, b, tokens, head = inputs()
    f, b, head = f.float(), b.float(), copy.deepcopy(head).float()
    with pytest.raises(ValueError, match=error):
        belief_state_loss(f, b, tokens, head, backend=backend, **bad)


def test_ops_check_meet_token():
    """The fused ops repeat the checks (a compiled graph skips belief_state_loss's): min_gap = 1 needs
    meet_token, which must be a vocabulary id; a per-row weight must have one entry per row."""
    g = torch.Generator().manual_seed(5)
    A, Bm = torch.randn(2, 6, 4, generator=g), torch.randn(2, 6, 4, generator=g)
    W, c = [torch.randn(10, 4, generator=g)], [torch.randn(10, generator=g)]  # V = 5
    common = (torch.randint(0, 5, (2, 6), generator=g), torch.tensor([6, 6]), torch.zeros(2, dtype=torch.long))
    one = torch.tensor(1.0, dtype=torch.float64)
    cpp = torch.ops.bst_fast.pair_loss
    with pytest.raises(RuntimeError, match="min_gap must be >= 2 unless meet_token is given"):
        cpp(A, Bm, W, c, *common, 1, 6, None, None, None, one, 0.5, "gelu", True)
    with pytest.raises(RuntimeError, match=r"meet_token must lie in \[0, vocab_size=5\), got 5"):
        cpp(A, Bm, W, c, *common, 1, 6, None, None, None, one, 0.5, "gelu", True, meet_token=5)
    with pytest.raises(RuntimeError, match=r"one scale per row \(2,\), got \[3\]"):
        cpp(A, Bm, W, c, *common, 2, 6, None, None, None, torch.ones(3, dtype=torch.float64), 0.5, "gelu", True)
    assert torch.isfinite(cpp(A, Bm, W, c, *common, 1, 6, None, None, None, torch.ones(2, dtype=torch.float64),
                              0.5, "gelu", True, meet_token=4)[0])
    pytest.importorskip("triton")
    from bst_fast.backends import triton_backend  # noqa: F401  (registers the op)
    tri = torch.ops.bst_fast.triton_pair_loss
    # the triton op takes the whole head: f, b (B, L, m = 3) and the first layer's (4, 6) weight first
    f, b = torch.randn(2, 6, 3, generator=g), torch.randn(2, 6, 3, generator=g)
    W, c = [torch.randn(4, 6, generator=g)] + W, [torch.randn(4, generator=g)] + c
    with pytest.raises(ValueError, match="min_gap=1 needs meet_token"):
        tri(f, b, W, c, *common, 1, 6, None, None, None, one, 0.5, "gelu", True)
    with pytest.raises(ValueError, match=r"meet_token must lie in \[0, vocab_size=5\), got 5"):
        tri(f, b, W, c, *common, 1, 6, None, None, None, one, 0.5, "gelu", True, meet_token=5)
    with pytest.raises(ValueError, match="weight must have shape"):
        tri(f, b, W, c, *common, 2, 6, None, None, None, torch.ones(3, dtype=torch.float64), 0.5, "gelu", True)


def test_row_mean_of_a_batch_with_one_row_is_its_mean():
    """One row: row_mean is mean; rows with no pair add 0 to row_mean but count among the B rows."""
    f, b, tokens, head = inputs(seed=6)
    one = dict(min_gap=1, meet_token=MEET, backend="torch")
    assert torch.allclose(belief_state_loss(f[:1], b[:1], tokens[:1], head, reduction="row_mean", **one),
                          belief_state_loss(f[:1], b[:1], tokens[:1], head, **one), rtol=1e-14)
    lengths = torch.tensor([L, 1, 0, L])
    full = belief_state_loss(f, b, tokens, head, lengths=lengths, reduction="row_mean", **one)
    rows = [belief_state_loss(f[r:r + 1], b[r:r + 1], tokens[r:r + 1], head, **one) for r in (0, 3)]
    assert torch.allclose(full, sum(rows) / B, rtol=1e-14)


def test_compiles_as_one_graph():
    """min_gap=1 with meet_token and row_mean through the cpp op trace as one graph (fullgraph) and match eager."""
    f, b, tokens, head = inputs(seed=8)
    f, b, head = f.float().requires_grad_(), b.float().requires_grad_(), copy.deepcopy(head).float()
    opts = dict(lengths=torch.tensor(LENGTHS), min_gap=1, meet_token=MEET, reduction="row_mean", backend="cpp")

    def fn(f, b):
        return belief_state_loss(f, b, tokens, head, **opts)
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = grads_of(compiled(f, b), f, b, head, 0.7), grads_of(fn(f, b), f, b, head, 0.7)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-6, atol=1e-7)
