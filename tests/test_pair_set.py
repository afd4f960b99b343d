"""The pair set (docs/contract.md §2) and the subsampler (docs/contract.md §5) against a brute-force enumeration written from
the definition, never through `_pairs.prepare`, `pair_mask` or `pair_counts`.

Every backend reads its pairs from `prepare`, so an error in `prepare` (the gap clipping, the scale,
the weights) moves all of them together and comparisons between backends cannot see it. Here the
pair set comes from nested loops over (i, j) with each rule of docs/contract.md §2 spelled out."""
import copy
import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from bst_fast import _pairs, belief_state_loss
from bst_fast.loss import BACKENDS

from _helpers import make_inputs, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")


def enumerate_pairs(lengths, prefix_start, min_gap, max_gap, L):
    """P = [(r, i, j), ...] in (r, i, j) order, from docs/contract.md §2 read literally:

    - i and j are positions of the (B, L) batch: 0 <= i < L, 0 <= j < L;
    - the prefix starts at or after the row's prefix_start: i >= s_r;
    - the suffix starts at a valid position of the row: j <= len_r - 1;
    - at least min_gap apart: j - i >= min_gap;
    - at most max_gap apart, when there is a max_gap: j - i <= max_gap.
    """
    out = []
    for r in range(len(lengths)):
        n, s = int(lengths[r]), int(prefix_start[r])
        for i in range(L):
            if i < s:
                continue
            for j in range(L):
                if j > n - 1:
                    continue
                if j - i < min_gap:
                    continue
                if max_gap is not None and j - i > max_gap:
                    continue
                out.append((r, i, j))
    return out


MAX_GAP_KINDS = ("none", "small", "L-1", "L", "beyond_L")


def random_spec(seed, B, L):
    """(lengths, prefix_start, min_gap, max_gap) of one seed. Row 0 is full length from position 0,
    so that the batch has pairs and, for a small max_gap, pairs with j - i == max_gap; the other rows
    draw a length in [0, L] and a prefix_start in [0, L + 1] (past the end included)."""
    g = torch.Generator().manual_seed(9100 + seed)
    lengths = torch.randint(0, L + 1, (B,), generator=g)
    prefix_start = torch.randint(0, L + 2, (B,), generator=g)
    lengths[0], prefix_start[0] = L, 0
    min_gap = int(torch.randint(2, min(5, L - 1) + 1, (), generator=g))
    kind = MAX_GAP_KINDS[seed % len(MAX_GAP_KINDS)]
    if kind == "none":
        max_gap = None
    elif kind == "small":  # below L - 1: the clipping at max_gap removes pairs
        max_gap = min_gap + int(torch.randint(0, max(L - 2 - min_gap, 1), (), generator=g))
    elif kind == "L-1":
        max_gap = L - 1
    elif kind == "L":
        max_gap = L
    else:
        max_gap = L + 1 + int(torch.randint(0, 2**40, (), generator=g))
    max_gap = None if max_gap is None else max(max_gap, min_gap)
    return lengths, prefix_start, min_gap, max_gap


def _prepare(lengths, prefix_start, min_gap, max_gap, L, pairs=None, reduction="mean", generator=None):
    B = len(lengths)
    f = torch.zeros(B, L, 1)
    tokens = torch.zeros(B, L, dtype=torch.int64)
    return _pairs.prepare(f, f, tokens, 1, lengths=lengths, prefix_start=prefix_start, min_gap=min_gap,
                          max_gap=max_gap, pairs=pairs, next_weight=0.5, reduction=reduction,
                          generator=generator)


SPEC_SEEDS = range(20)


@pytest.mark.parametrize("seed", SPEC_SEEDS)
def test_prepare_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    B, L = int(torch.randint(1, 5, (), generator=g)), int(torch.randint(4, 19, (), generator=g))
    lengths, prefix_start, min_gap, max_gap = random_spec(seed, B, L)
    want = enumerate_pairs(lengths, prefix_start, min_gap, max_gap, L)
    n = len(want)
    assert n > 0
    if MAX_GAP_KINDS[seed % len(MAX_GAP_KINDS)] == "small":  # the case a max_gap clipping error hits
        assert any(j - i == max_gap for _, i, j in want)
    per_row = [sum(1 for r, _, _ in want if r == row) for row in range(B)]

    # All pairs: the scale is 1 / |P| (mean) or 1 (sum).
    p = _prepare(lengths, prefix_start, min_gap, max_gap, L)
    assert p.row is None and p.scale.dtype == torch.float64
    assert float(p.scale) == pytest.approx(1.0 / n, rel=1e-15)
    assert float(_prepare(lengths, prefix_start, min_gap, max_gap, L, reduction="sum").scale) == 1.0
    # The per-row counts the trainer divides by, with the gaps prepare resolved.
    counts = _pairs.pair_counts(lengths, p.prefix_start, p.min_gap, p.max_gap, L)
    assert counts.tolist() == per_row

    # A full subsample lists exactly the pair set, each pair weighted 1 / |P| (|P_r| / k_r = 1).
    for full in (1.0, 10**6):
        p = _prepare(lengths, prefix_start, min_gap, max_gap, L, pairs=full,
                     generator=torch.Generator().manual_seed(seed))
        got = list(zip(p.row.tolist(), p.i.tolist(), p.j.tolist()))
        assert got == want
        assert torch.allclose(p.weight, torch.full((n,), 1.0 / n, dtype=torch.float64), rtol=1e-14, atol=0)

    # The brute-force list is accepted as explicit pairs (every pair valid), as a plain mean.
    row, i, j = (torch.tensor(x) for x in zip(*want))
    p = _prepare(lengths, prefix_start, min_gap, max_gap, L, pairs=(row, i, j))
    assert torch.allclose(p.weight, torch.full((n,), 1.0 / n, dtype=torch.float64), rtol=1e-14, atol=0)


def _hand_sum_loss(f, b, tokens, head, pairs, next_weight, V):
    """sum over the listed pairs of lambda CE_next + (1 - lambda) CE_prev, in float64, by hand."""
    row, i, j = (torch.tensor(x) for x in zip(*pairs))
    logits = head(torch.cat([f[row, i], b[row, j]], dim=-1))
    ce_next = F.cross_entropy(logits[:, :V], tokens[row, i + 1], reduction="none")
    ce_prev = F.cross_entropy(logits[:, V:], tokens[row, j - 1], reduction="none")
    return (next_weight * ce_next + (1 - next_weight) * ce_prev).sum()


# Tiny sizes: the Triton backends run through the interpreter on the CPU.
LOSS_B, LOSS_L, LOSS_M, LOSS_V, LOSS_H = 2, 10, 6, 11, 12
LOSS_SEEDS = range(5)  # one of each max_gap kind
ALL_BACKENDS = [name for name in BACKENDS if name != "auto"]


@pytest.fixture(scope="module")
def loss_cases():
    """Per seed: inputs, the pair spec, the brute-force list and its float64 sum loss by hand."""
    cases = {}
    for seed in LOSS_SEEDS:
        lengths, prefix_start, min_gap, max_gap = random_spec(seed, LOSS_B, LOSS_L)
        want = enumerate_pairs(lengths, prefix_start, min_gap, max_gap, LOSS_L)
        f, b, tokens, head = make_inputs(B=LOSS_B, L=LOSS_L, m=LOSS_M, V=LOSS_V, hidden=LOSS_H, seed=9200 + seed)
        nw = (0.5, 0.3, 1.0, 0.0, 0.7)[seed % 5]
        h64 = copy.deepcopy(head).double()
        with torch.no_grad():
            hand = _hand_sum_loss(f.double(), b.double(), tokens, h64, want, nw, LOSS_V)
            row, i, j = (torch.tensor(x) for x in zip(*want))
            explicit = belief_state_loss(f.double(), b.double(), tokens, h64, pairs=(row, i, j),
                                         reduction="sum", next_weight=nw, backend="reference")
        # The explicit-pairs reference is the brute-force loss itself.
        assert rel_err(explicit, hand) < 1e-12
        opts = dict(lengths=lengths, prefix_start=prefix_start, min_gap=min_gap, max_gap=max_gap,
                    next_weight=nw, reduction="sum")
        cases[seed] = (f, b, tokens, head, opts, explicit)
    return cases


@pytest.mark.parametrize("seed", LOSS_SEEDS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_all_pairs_sum_equals_brute_force_explicit_pairs(backend, seed, loss_cases):
    """Every backend's all-pairs reduction="sum" loss equals the float64 loss over the brute-force
    list passed as explicit pairs (docs/contract.md §6: float32 within 1e-5)."""
    f, b, tokens, head, opts, want = loss_cases[seed]
    if backend == "triton":  # skipped only where it cannot run at all; any other error fails
        if importlib.util.find_spec("triton") is None:
            pytest.skip("triton is not installed")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the triton backend needs CUDA or TRITON_INTERPRET=1")
    with torch.no_grad():
        got = belief_state_loss(f, b, tokens, head, backend=backend, **opts)
    assert rel_err(got, want) < 1e-5, f"{backend}: {float(got)} vs brute force {float(want)}"


# --------------------------------------------------------------------------------------------
# The subsampler's bias (docs/contract.md §5)

# Row kinds (length, prefix_start), each repeated N times in one batch: every row draws its own
# subsample, so the repeats are independent draws.
SAMPLER_KINDS = [(10, 0), (9, 3), (7, 1), (8, 2)]
SAMPLER_L, SAMPLER_MIN_GAP, SAMPLER_MAX_GAP, SAMPLER_K, SAMPLER_N = 10, 2, 5, 3, 3000


def test_sampler_inclusion_frequencies_are_k_over_P():
    """Each pair of P_r, j = len_r - 1, i = prefix_start and j - i == max_gap included, is drawn in
    a fraction k_r / |P_r| of the rows (within 5 standard errors), and each drawn pair carries the
    weight |P_r| / k_r / |P| of the estimator, with |P_r| from the brute force."""
    kinds, N = SAMPLER_KINDS, SAMPLER_N
    lengths = torch.tensor([n for n, _ in kinds]).repeat_interleave(N)
    prefix_start = torch.tensor([s for _, s in kinds]).repeat_interleave(N)
    p = _prepare(lengths, prefix_start, SAMPLER_MIN_GAP, SAMPLER_MAX_GAP, SAMPLER_L, pairs=SAMPLER_K,
                 generator=torch.Generator().manual_seed(1234))
    total = 0
    expect = {}
    for kind, (n, s) in enumerate(kinds):
        P = [(i, j) for _, i, j in enumerate_pairs([n], [s], SAMPLER_MIN_GAP, SAMPLER_MAX_GAP, SAMPLER_L)]
        assert any(j == n - 1 for _, j in P) and any(i == s for i, _ in P)
        assert any(j - i == SAMPLER_MAX_GAP for i, j in P) or n - 1 - s < SAMPLER_MAX_GAP
        expect[kind] = P
        total += N * len(P)
    row, i, j, w = p.row, p.i, p.j, p.weight
    kind = row // N
    assert torch.bincount(row, minlength=len(lengths)).eq(SAMPLER_K).all()
    for k, P in expect.items():
        sel = kind == k
        ws = w[sel]
        assert torch.allclose(ws, torch.full_like(ws, len(P) / SAMPLER_K / total), rtol=1e-12, atol=0)
        drawn = {}
        for a, c in zip(i[sel].tolist(), j[sel].tolist()):
            drawn[(a, c)] = drawn.get((a, c), 0) + 1
        assert set(drawn) <= set(P), f"kind {k}: drew pairs outside P_r: {sorted(set(drawn) - set(P))}"
        q = SAMPLER_K / len(P)
        se = (q * (1 - q) / N) ** 0.5
        for pair in P:
            freq = drawn.get(pair, 0) / N
            assert abs(freq - q) < 5 * se, \
                f"row kind {kinds[k]}: pair {pair} drawn in {freq:.4f} of the rows, expected {q:.4f} +- {se:.4f}"



# Long rows, few pairs: k < |P_r| / 64 takes the C++ sampler's other branch (a hash set of Floyd's
# draws, then sorted), which the small rows above never reach.
LONG_L, LONG_K, LONG_N = 60, 2, 200_000
# a chi-square over the 29 groups of 59 consecutive pairs (28 degrees of freedom: the counts sum
# to N k) above this has a probability below 1e-6 (scipy.stats.chi2.isf(1e-6, 28))
LONG_GROUP_LIMIT = 78.8


def inclusion_failures(counts, rows, k):
    """What is wrong with `counts` (each pair's inclusion count over `rows` draws of k pairs of one
    P_r, in (i, j) order) for a uniform sampler: the first, a middle, the next to last and the last
    pair more than 4.5 standard errors from rows k / |P_r| (a bias in one named place), any pair
    more than 5.5 (1711 pairs: below 1e-4 for an exact sampler), or a chi-square over groups of 59
    consecutive pairs above LONG_GROUP_LIMIT (a bias spread over a region)."""
    n = len(counts)
    q = k / n
    mean, sd = rows * q, (rows * q * (1 - q)) ** 0.5
    z = [(c - mean) / sd for c in counts]
    bad = [f"pair {x}: {counts[x]} draws, expected {mean:.1f} +- {sd:.1f}"
           for x in (0, n // 2, n - 2, n - 1) if abs(z[x]) > 4.5]
    bad += [f"pair {x}: {counts[x]} draws, {z[x]:.1f} standard errors off" for x in range(n) if abs(z[x]) > 5.5]
    g = 59
    groups = [sum(counts[a:a + g]) for a in range(0, n, g)]
    chi2 = sum((c - g * mean) ** 2 / (g * mean * (1 - q)) for c in groups)
    if chi2 > LONG_GROUP_LIMIT:
        bad.append(f"chi-square over groups of {g} pairs {chi2:.1f} > {LONG_GROUP_LIMIT}")
    return bad


def test_sampler_is_uniform_on_long_rows_with_few_pairs():
    """Rows of 60 (|P_r| = 1711) drawing k = 2 pairs each: every pair, the last (i = L - 3, j = L - 1)
    included, is drawn in a fraction k / |P_r| of the rows (inclusion_failures)."""
    L, k, N = LONG_L, LONG_K, LONG_N
    P = [(i, j) for _, i, j in enumerate_pairs([L], [0], 2, L, L)]
    assert len(P) == 1711 and k < len(P) / 64 and P[-1] == (L - 3, L - 1)
    row, i, j = _pairs.sample_pairs(torch.full((N,), L), torch.zeros(N, dtype=torch.long), 2, L,
                                    torch.full((N,), k), torch.Generator().manual_seed(17))
    assert torch.bincount(row, minlength=N).eq(k).all()
    index = torch.full((L, L), -1)
    index[tuple(torch.tensor(P).t())] = torch.arange(len(P))
    flat = index[i, j]
    assert (flat >= 0).all(), "a drawn pair is not in P_r"
    counts = torch.bincount(flat, minlength=len(P)).tolist()
    assert inclusion_failures(counts, N, k) == []
    # the check has the power to see the last pair alone drawn at 0.58 of its rate (a broken sampler's)
    assert inclusion_failures(counts[:-1] + [round(0.58 * N * k / len(P))], N, k)


def test_fractional_subsample_sizes_from_brute_force():
    """pairs=rho keeps k_r = max(1, round(rho |P_r|)) pairs of each row, |P_r| by brute force."""
    lengths, prefix_start, min_gap, max_gap = random_spec(1, 6, 17)
    want = enumerate_pairs(lengths, prefix_start, min_gap, max_gap, 17)
    per_row = [sum(1 for r, _, _ in want if r == row) for row in range(6)]
    for rho in (0.05, 0.3, 0.77):
        p = _prepare(lengths, prefix_start, min_gap, max_gap, 17, pairs=rho, reduction="sum",
                     generator=torch.Generator().manual_seed(5))
        k = [min(max(1, round(rho * c)), c) for c in per_row]
        assert torch.bincount(p.row, minlength=6).tolist() == k
        assert set(zip(p.row.tolist(), p.i.tolist(), p.j.tolist())) <= set(want)
        expect_w = torch.tensor([per_row[r] / k[r] for r in p.row.tolist()], dtype=torch.float64)
        assert torch.allclose(p.weight, expect_w, rtol=1e-14, atol=0)
