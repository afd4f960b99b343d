"""The device sampler `_device_sampler.sample_on_device` (docs/contract.md §5) against the pair set of §2
enumerated by brute force: valid, distinct, sorted, k_r pairs a row; exactly uniform (chi-square over
the k-subsets of a small row, on the first round of draws and on the rare further rounds); reproducible;
and the loss through the runtime switch `device_sampler` equal to the brute-force sum over the pairs it
drew, unbiased."""
import copy
import itertools
import math
import random
from collections import Counter

import pytest
import torch

from _helpers import brute_force, contract_weights, make_inputs, rel_err, switch
from bst_fast import _device_sampler, _pairs, belief_state_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def pair_sets(lengths, prefix_start, min_gap, max_gap):
    """P_r of every row, read literally from docs/contract.md §2 (in (i, j) order)."""
    return [[(i, j) for i in range(max(n, 0)) for j in range(max(n, 0))
             if s <= i and i + min_gap <= j <= min(i + max_gap, n - 1)]
            for n, s in zip(lengths, prefix_start)]


def checked(out, sets, k):
    """The draw (row, i, j) as a list of (r, i, j), checked: int64, sorted by (row, i, j), distinct,
    every pair in its row's set, exactly k[r] of row r."""
    row, i, j = out
    assert row.dtype == i.dtype == j.dtype == torch.int64
    got = list(zip(row.tolist(), i.tolist(), j.tolist()))
    assert got == sorted(set(got)), "not sorted by (row, i, j), or not distinct"
    per_row = Counter(r for r, _, _ in got)
    for r, s in enumerate(sets):
        assert per_row[r] == k[r], f"row {r}: {per_row[r]} pairs, k = {k[r]}"
    valid = {(r, i, j) for r, s in enumerate(sets) for i, j in s}
    assert all(p in valid for p in got), "a drawn pair is not in P_r"
    return got


def draw(lengths, prefix_start, min_gap, max_gap, k, seed):
    return _device_sampler.sample_on_device(torch.tensor(lengths), torch.tensor(prefix_start), min_gap, max_gap,
                                   torch.tensor(k), torch.Generator().manual_seed(seed))


def k_of_kind(kind, n, rng):
    """The k's the sampler treats apart: none, one, all, just below, at and just above |P_r| / 2
    (the complement side starts above it), any."""
    return min(n, max(0, [0, 1, n, n // 2 - 1, n // 2, n // 2 + 1, (n + 1) // 2, rng.randint(0, n)][kind]))


@pytest.mark.parametrize("seed", range(12))
def test_valid_distinct_sorted_exact_count(seed):
    rng = random.Random(seed)
    for rep in range(6):
        B, L = rng.randint(1, 7), rng.choice([1, 3, 5, 9, 13, 17, 23, 31])
        lengths = [rng.choice([0, 1, 2, 3, L, rng.randint(0, L)]) for _ in range(B)]
        prefix_start = [rng.choice([0, 0, 1, 2, 5, L + 1]) for _ in range(B)]
        min_gap = rng.randint(1, 3)
        max_gap = max(min_gap, rng.choice([min_gap, min_gap + 1, min_gap + 4, L - 1, L, 2**40]))
        sets = pair_sets(lengths, prefix_start, min_gap, max_gap)
        k = [k_of_kind((r + rep + seed) % 8, len(s), rng) for r, s in enumerate(sets)]
        got = checked(draw(lengths, prefix_start, min_gap, max_gap, k, 100 * seed + rep), sets, k)
        for r, s in enumerate(sets):  # k_r = |P_r| takes every pair
            if k[r] == len(s):
                assert [(i, j) for rr, i, j in got if rr == r] == s


def test_no_pairs_and_empty_batch():
    got = checked(draw([0, 1, 2, 5], [0, 0, 0, 9], 2, 8, [0, 0, 0, 0], 0), [[]] * 4, [0] * 4)
    assert got == []
    row, i, j = draw([], [], 2, 8, [], 0)
    assert row.numel() == i.numel() == j.numel() == 0 and row.dtype == torch.int64


# --------------------------------------------------------------------------------------------
# Exact uniformity: every k-subset of a row equally likely

UNIFORM_ROWS = 3000
# a chi-square above these has a probability below 1e-6 for an exact sampler: over the 120 subsets
# (119 degrees of freedom), and over the 10 pairs' inclusion counts (about 10/9 chi2(9): they sum to n k)
SUBSET_LIMIT, PAIR_LIMIT = 207.0, 50.0
# (lengths, min_gap, max_gap): |P_r| = 10 as a triangle (no limit) and as a band (one gap)
TEN_PAIRS = {"triangle": (6, 2, 6), "band": (12, 2, 2)}


def uniformity(subsets, n_pairs, k):
    """(chi-square over the k-subsets of range(n_pairs), chi-square over each index's inclusion count
    scaled by the binomial variance), from a list of drawn subsets (tuples of sorted indices)."""
    n = len(subsets)
    cells = list(itertools.combinations(range(n_pairs), k))
    e = n / len(cells)
    count = Counter(subsets)
    assert set(count) <= set(cells)
    subset_chi2 = sum((count[c] - e) ** 2 / e for c in cells)
    p = k / n_pairs
    hits = Counter(x for s in subsets for x in s)
    pair_chi2 = sum((hits[x] - n * p) ** 2 / (n * p * (1 - p)) for x in range(n_pairs))
    return subset_chi2, pair_chi2


def drawn_subsets(length, min_gap, max_gap, k, seed, rows=UNIFORM_ROWS):
    """`rows` rows of one shape drawn in one call (each row its own draw): each row's k pairs as
    indices into the row's P_r."""
    P = pair_sets([length], [0], min_gap, max_gap)[0]
    assert len(P) == 10
    out = draw([length] * rows, [0] * rows, min_gap, max_gap, [k] * rows, seed)
    got = checked(out, [P] * rows, [k] * rows)
    index = {pq: x for x, pq in enumerate(P)}
    by_row = [[] for _ in range(rows)]
    for r, i, j in got:
        by_row[r].append(index[(i, j)])
    return [tuple(s) for s in by_row]


@pytest.mark.parametrize("shape", sorted(TEN_PAIRS))
@pytest.mark.parametrize("k", [3, 7])  # drawn directly, and as the complement of 3 drawn
def test_exactly_uniform(shape, k):
    length, min_gap, max_gap = TEN_PAIRS[shape]
    subsets = drawn_subsets(length, min_gap, max_gap, k, seed=20 + k + 100 * (shape == "band"))
    subset_chi2, pair_chi2 = uniformity(subsets, 10, k)
    assert subset_chi2 < SUBSET_LIMIT and pair_chi2 < PAIR_LIMIT, (subset_chi2, pair_chi2)


def test_uniformity_limits_reject_broken_samplers():
    """The limits above have the power to fail a sampler that is subtly wrong: the first k distinct
    values of the sorted draws (not in draw order), a collision moved to the next free index, a
    random run of k consecutive indices (each pair's inclusion still exactly k / |P_r|)."""
    rng = random.Random(5)

    def smallest_distinct(k):  # draws as sample_on_device does, keeps the wrong ones
        s = set()
        while len(s) < k:
            s |= {rng.randrange(10) for _ in range(k + 8)}
        return tuple(sorted(s)[:k])

    def probing(k):
        s = set()
        for _ in range(k):
            x = rng.randrange(10)
            while x in s:
                x = (x + 1) % 10
            s.add(x)
        return tuple(sorted(s))

    def run(k):
        x = rng.randrange(10)
        return tuple(sorted((x + d) % 10 for d in range(k)))

    for broken in (smallest_distinct, probing, run):
        for k in (3, 7):
            subset_chi2, pair_chi2 = uniformity([broken(k) for _ in range(UNIFORM_ROWS)], 10, k)
            assert subset_chi2 > SUBSET_LIMIT or pair_chi2 > PAIR_LIMIT, (broken.__name__, k, subset_chi2, pair_chi2)


# --------------------------------------------------------------------------------------------
# Further rounds of draws: a row short of t distinct values after its first draws


def count_draw_rounds(monkeypatch, first_draws):
    """_first_draws replaced (how many draws each row takes first); returns a list that counts the
    calls of _draw (one per round)."""
    calls = []
    inner = _device_sampler._draw

    def counted(*args):
        calls.append(int(args[1]))
        return inner(*args)

    monkeypatch.setattr(_device_sampler, "_first_draws", first_draws)
    monkeypatch.setattr(_device_sampler, "_draw", counted)
    return calls


@pytest.mark.parametrize("first", ["t", "one"])
def test_further_rounds_are_exact(monkeypatch, first):
    """With as few first draws as t (or one), almost every row lacks distinct values and draws on:
    the draw is still valid, distinct, sorted, k_r a row, reproducible, and exactly uniform."""
    calls = count_draw_rounds(monkeypatch, (lambda t, N: t.clone()) if first == "t" else
                              (lambda t, N: (t > 0).long()))
    rng = random.Random(3)
    for rep in range(8):
        B, L = rng.randint(2, 6), rng.choice([9, 14, 21])
        lengths = [rng.randint(0, L) for _ in range(B)]
        prefix_start = [rng.choice([0, 1, 3]) for _ in range(B)]
        min_gap, max_gap = rng.randint(1, 3), rng.choice([4, 6, L])
        sets = pair_sets(lengths, prefix_start, min_gap, max_gap)
        k = [k_of_kind((r + rep) % 8, len(s), rng) for r, s in enumerate(sets)]
        out = draw(lengths, prefix_start, min_gap, max_gap, k, rep)
        checked(out, sets, k)
        again = draw(lengths, prefix_start, min_gap, max_gap, k, rep)
        assert all(torch.equal(x, y) for x, y in zip(out, again))
    assert len(calls) > 2 * 8, f"the draws took {len(calls)} rounds in 16 calls: the loop did not run"
    del calls[:]
    for k in (3, 7):
        subset_chi2, pair_chi2 = uniformity(drawn_subsets(*TEN_PAIRS["triangle"], k, seed=40 + k), 10, k)
        assert subset_chi2 < SUBSET_LIMIT and pair_chi2 < PAIR_LIMIT, (subset_chi2, pair_chi2)
    assert len(calls) > 2 * 2


def test_first_round_usually_suffices(monkeypatch):
    """The first draws' count leaves the further rounds rare: one round for 3000 rows at k = |P_r| / 2
    (the most draws per distinct value) and for a batch at 2 %."""
    calls = count_draw_rounds(monkeypatch, _device_sampler._first_draws)
    drawn_subsets(*TEN_PAIRS["band"], 5, seed=1)
    lengths = torch.full((32,), 258)
    N = _pairs.pair_counts(lengths, torch.zeros_like(lengths), 2, 258, 258)
    k = torch.round(0.02 * N.double()).long()
    _device_sampler.sample_on_device(lengths, torch.zeros_like(lengths), 2, 258, k, torch.Generator().manual_seed(0))
    assert len(calls) == 2


# --------------------------------------------------------------------------------------------
# Reproducibility


def test_reproducible():
    args = (torch.tensor([40, 31, 0, 25, 17]), torch.tensor([0, 3, 0, 1, 0]), 2, 9, torch.tensor([30, 150, 0, 10, 40]))
    a = _device_sampler.sample_on_device(*args, torch.Generator().manual_seed(99))
    b = _device_sampler.sample_on_device(*args, torch.Generator().manual_seed(99))
    c = _device_sampler.sample_on_device(*args, torch.Generator().manual_seed(100))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    # one generator draws on: its next draw differs, a generator restored to its state repeats it
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    first, second = (_device_sampler.sample_on_device(*args, g) for _ in range(2))
    assert not all(torch.equal(x, y) for x, y in zip(first, second))
    g.set_state(state)
    assert all(torch.equal(x, y) for x, y in zip(first, _device_sampler.sample_on_device(*args, g)))
    # without a generator: the default generator of the tensors' device
    torch.manual_seed(5)
    d = _device_sampler.sample_on_device(*args)
    torch.manual_seed(5)
    assert all(torch.equal(x, y) for x, y in zip(d, _device_sampler.sample_on_device(*args)))


# --------------------------------------------------------------------------------------------
# Exact arithmetic: the 53-bit product and the closed-form map at large rows


def test_below_is_the_exact_product():
    """floor(bits n / 2**53) and the low bits' acceptance, against Python's integers."""
    rng = random.Random(0)
    edges_n = [1, 2, 3, 10, 2**26 - 1, 2**27 - 1, 2**27, 2**27 + 1, 2**52 - 1, 2**52 + 1, 2**53 - 1, 2**53]
    ns = edges_n + [rng.randrange(1, 2**53 + 1) for _ in range(200)] + [rng.randrange(1, 2**30) for _ in range(200)]
    bits = [0, 1, 2**27 - 1, 2**27, 2**53 - 1] + [rng.randrange(2**53) for _ in range(len(ns) - 5)]
    bits_t, n_t = torch.tensor(bits), torch.tensor(ns)
    high, ok = _device_sampler._below(bits_t, n_t, torch.tensor([2**53 % n for n in ns]))
    assert high.tolist() == [(x * n) >> 53 for x, n in zip(bits, ns)]
    assert ok.tolist() == [((x * n) & (2**53 - 1)) >= 2**53 % n for x, n in zip(bits, ns)]
    assert all(0 <= h < n for h, n in zip(high.tolist(), ns))


def flat_to_pair(f, n, s, g, G):
    """The f-th pair of a row in (i, j) order, by binary search on the count of pairs before
    prefix i (Python integers, every prefix's count min(i + G, n - 1) - (i + g) + 1)."""
    def before(i):  # pairs with a prefix in [s, i)
        lo, hi = s, min(i, n - g)  # prefixes s .. n - 1 - g have pairs
        if hi <= lo:
            return 0
        full_end = min(hi, max(lo, n - G))  # prefixes below n - G have all G - g + 1 suffixes
        band = (full_end - lo) * (G - g + 1)
        a, b = n - g - full_end, n - g - hi + 1  # counts from a down to b of the triangle part
        return band + (a + b) * (a - b + 1) // 2 if hi > full_end else band
    lo, hi = s, n - g
    while lo < hi:  # the largest i with before(i) <= f
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if before(mid) <= f else (lo, mid - 1)
    return lo, lo + g + (f - before(lo))


def test_closed_form_map_at_large_rows():
    """Rows of up to 2**27 tokens (|P_r| near 2**53): the flat index -> (i, j) map, band and
    triangle, against an exact binary search, and a few pairs drawn from such rows valid."""
    rng = random.Random(1)
    rows = [(2**27 - 5, 0, 2, 2**27), (2**27, 7, 3, 2**20), (2**26 + 3, 2**25, 1, 2**27), (10**6, 0, 2, 999_999),
            (2**27 + 1, 0, 2, 2**28)]
    for n, s, g, G in rows:
        N, shape = _device_sampler._row_shape(torch.tensor([n]), torch.tensor([s]), g, G)
        N = int(N)
        band = int(shape[0, 3] * shape[0, 2])
        fs = sorted({0, 1, N - 1, N - 2, max(band - 1, 0), min(band, N - 1), min(band + 1, N - 1)}
                    | {rng.randrange(N) for _ in range(300)})
        i, j = _device_sampler._pair_of_flat(torch.tensor(fs), shape.expand(len(fs), 6))
        assert list(zip(i.tolist(), j.tolist())) == [flat_to_pair(f, n, s, g, G) for f in fs], (n, s, g, G)
        k = torch.tensor([5])
        row, i, j = _device_sampler.sample_on_device(torch.tensor([n]), torch.tensor([s]), g, G, k,
                                            torch.Generator().manual_seed(n))
        got = list(zip(i.tolist(), j.tolist()))
        assert got == sorted(set(got)) and len(got) == 5
        assert all(s <= a and a + g <= b <= min(a + G, n - 1) for a, b in got)


def test_checks():
    gen = torch.Generator().manual_seed(0)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match=r"at most 2\*\*53"):  # |P_r| = (n - 1)(n - 2) / 2 > 2**53
        _device_sampler.sample_on_device(torch.tensor([2**27 + 3]), one, 2, 2**28, torch.tensor([1]), gen)
    with pytest.raises(ValueError, match=r"k\[1\] must lie in \[0, \|P_r\| = 3\], got 4"):
        _device_sampler.sample_on_device(torch.tensor([5, 4]), torch.tensor([0, 0]), 2, 9, torch.tensor([1, 4]), gen)
    with pytest.raises(ValueError, match=r"prefix_start\[0\] must be >= 0"):
        _device_sampler.sample_on_device(torch.tensor([5]), torch.tensor([-1]), 2, 9, torch.tensor([1]), gen)
    with pytest.raises(ValueError, match=r"lengths\[0\] must lie in \[0, 2\*\*31\]"):
        _device_sampler.sample_on_device(torch.tensor([2**31 + 1]), one, 2, 9, torch.tensor([1]), gen)
    with pytest.raises(ValueError, match="max_gap"):
        _device_sampler.sample_on_device(torch.tensor([5]), one, 3, 2, torch.tensor([1]), gen)


# --------------------------------------------------------------------------------------------
# The loss through the runtime switch

B_, L_, M_, V_ = 4, 13, 5, 7
LOSS_SPEC = dict(lengths=[13, 9, 2, 11], prefix_start=[0, 2, 0, 1], min_gap=2, max_gap=7)


def loss_inputs():
    f, b, tokens, head = make_inputs(B=B_, L=L_, m=M_, V=V_, seed=31)
    return f.double(), b.double(), tokens, head.double()


def opts(seed, **extra):
    spec = dict(LOSS_SPEC)
    return dict(lengths=torch.tensor(spec["lengths"]), prefix_start=torch.tensor(spec["prefix_start"]),
                min_gap=spec["min_gap"], max_gap=spec["max_gap"], generator=torch.Generator().manual_seed(seed),
                **extra)


@pytest.mark.parametrize("backend, dtype", [("cpp", torch.float32), ("torch", torch.float64)])
@pytest.mark.parametrize("reduction", ["mean", "row_mean"])
def test_switch_draws_on_device_and_loss_is_the_drawn_sum(monkeypatch, backend, dtype, reduction):
    """With device_sampler on, prepare draws through sample_on_device (the C++ sampler is not called):
    the loss is the brute-force sum over the pairs sample_on_device draws from a generator of the same
    seed, each weighted as docs/contract.md §5 and §9 say."""
    switch(monkeypatch, device_sampler=True)

    def no_host_sampler(*args):
        raise AssertionError("the C++ sampler ran with device_sampler on")

    monkeypatch.setattr(_pairs, "sample_pairs", no_host_sampler)
    f, b, tokens, head = loss_inputs()
    sets = pair_sets(LOSS_SPEC["lengths"], LOSS_SPEC["prefix_start"], LOSS_SPEC["min_gap"], LOSS_SPEC["max_gap"])
    full = [len(s) for s in sets]
    k = [min(n, max(1, round(0.3 * n))) for n in full]
    for seed in range(3):
        with torch.no_grad():
            got = belief_state_loss(f.to(dtype), b.to(dtype), tokens, copy.deepcopy(head).to(dtype), pairs=0.3,
                                    backend=backend, reduction=reduction, **opts(seed))
        again = draw(LOSS_SPEC["lengths"], LOSS_SPEC["prefix_start"], LOSS_SPEC["min_gap"], LOSS_SPEC["max_gap"],
                     k, seed)
        chosen = checked(again, sets, k)
        with torch.no_grad():
            want = brute_force(f, b, tokens, head, chosen, contract_weights(chosen, full, "sampled", reduction, B_),
                               None, 0.5)
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-12), (seed, float(got), float(want))


def test_switch_estimate_is_unbiased(monkeypatch):
    """The mean of the estimate over many device draws is the all-pairs loss (float64, within 4
    standard errors), and with the switch off the C++ sampler draws (other pairs, the same mean)."""
    switch(monkeypatch, device_sampler=True)
    f, b, tokens, head = loss_inputs()
    with torch.no_grad():
        exact = float(belief_state_loss(f, b, tokens, head, backend="torch", **opts(0)))
        g = torch.Generator().manual_seed(11)
        o = opts(0)
        o["generator"] = g
        est = torch.tensor([float(belief_state_loss(f, b, tokens, head, pairs=0.3, backend="torch", **o))
                            for _ in range(300)], dtype=torch.float64)
    se = float(est.std()) / math.sqrt(est.numel())
    assert se > 0 and abs(float(est.mean()) - exact) < 4 * se, (float(est.mean()), exact, se)
    switch(monkeypatch, device_sampler=False)
    with torch.no_grad():
        host = belief_state_loss(f, b, tokens, head, pairs=0.3, backend="torch", **opts(0))
        switch(monkeypatch, device_sampler=True)
        device = belief_state_loss(f, b, tokens, head, pairs=0.3, backend="torch", **opts(0))
    assert not torch.equal(host, device)


def test_switch_from_the_environment(monkeypatch):
    from bst_fast.backends import runtime

    monkeypatch.delenv("BST_FAST_DEVICE_SAMPLER", raising=False)
    assert runtime.Switches.from_environment().device_sampler is False
    monkeypatch.setenv("BST_FAST_DEVICE_SAMPLER", "1")
    assert runtime.Switches.from_environment().device_sampler is True
    monkeypatch.setenv("BST_FAST_DEVICE_SAMPLER", "yes")
    with pytest.raises(ValueError, match="BST_FAST_DEVICE_SAMPLER must be 0 or 1"):
        runtime.Switches.from_environment()
