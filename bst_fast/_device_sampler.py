"""The device sampler: docs/contract.md §5's subsample of rows without documents, drawn on the
tensors' device with work growing with the pairs drawn (sample_on_device), the GPU's alternative to
the C++ sampler on the host (_pairs.sample_pairs). Runs where Switches.device_sampler is on
(BST_FAST_DEVICE_SAMPLER=1), off until bench/levers.py has timed it on a GPU.
"""
from __future__ import annotations

import torch

# The device sampler (sample_on_device) draws 53-bit integers: every flat index of a row with at most
# 2**53 pairs is reachable, and floor(bits * N / 2**53) is computed exactly in int64 (_below).
_BITS = 53


def _row_shape(lengths, prefix_start, min_gap, max_gap):
    """Each row's pair set P_r (docs/contract.md §2, no documents) in closed form: N = |P_r|, (B,)
    int64, and the (B, 6) table (a, g, W, nf, t0, nt) that _pair_of_flat reads. Prefixes
    a .. a + nf - 1 have W suffixes each (j - i in [g, g + W - 1]); prefixes t0 .. t0 + nt - 1 have
    nt, nt - 1, .., 1 (cut by the row's length); N = nf W + nt (nt + 1) / 2. The gaps are clipped to
    max(len, 2) as the C++ sampler does (the same pairs, no overflow); a row's length must lie in
    [0, 2**31] (checked by the caller)."""
    two = lengths.clamp(min=2)
    g = two.clamp(max=min_gap)
    G = two.clamp(max=max_gap)
    a = torch.minimum(prefix_start, lengths)
    last = lengths - 1 - g  # the last prefix with a suffix
    full = lengths - 1 - G  # the last prefix whose band is not cut by the length
    W = G - g + 1
    nf = (torch.minimum(last, full) - a + 1).clamp(min=0)
    t0 = torch.maximum(a, full + 1)
    nt = (last - t0 + 1).clamp(min=0)
    return nf * W + (nt * (nt + 1) >> 1), torch.stack([a, g, W, nf, t0, nt], 1)


def _pair_of_flat(f, shape):
    """(i, j) of the f-th pair of a row in (i, j) order, f in [0, N) with N <= 2**53; `shape` the
    (n, 6) rows of _row_shape's table, one per f. The band by a division, the triangle by an
    integer square root: the float64 root of 8x + 1 < 2**56 is within 2**-24 of the true one
    (x exact, 8x + 1 and the root each correctly rounded), so its floor m is off by at most one,
    which one step down and one up correct."""
    a, g, W, nf, t0, nt = shape.unbind(1)
    band = nf * W
    q = f // W
    i1 = a + q
    j1 = i1 + g + (f - q * W)
    # the triangle read backwards: rows of 1, 2, .., nt pairs; x lies in row m when
    # m (m + 1) / 2 <= x < (m + 1) (m + 2) / 2
    x = ((nt * (nt + 1) >> 1) - 1 - (f - band)).clamp(min=0)
    m = torch.floor((torch.sqrt(8.0 * x.double() + 1.0) - 1.0) / 2.0).long()
    m = m - ((m * (m + 1) >> 1) > x).long()
    m = m + (((m + 1) * (m + 2) >> 1) <= x).long()
    i2 = t0 + (nt - 1 - m)
    j2 = i2 + g + (m - (x - (m * (m + 1) >> 1)))
    in_band = f < band
    return torch.where(in_band, i1, i2), torch.where(in_band, j1, j2)


def _below(bits, n, threshold):
    """(floor(bits n / 2**53), accepted): bits uniform in [0, 2**53), n in [1, 2**53], threshold
    2**53 mod n. The product is formed exactly from 27- and 26-bit limbs in int64; keeping only
    the accepted draws (the low 53 bits of bits n at least the threshold: Lemire's rejection, of a
    fraction below n / 2**53) leaves values exactly uniform in [0, n)."""
    k1, k0 = bits >> 27, bits & (2**27 - 1)
    n1, n0 = n >> 27, n & (2**27 - 1)
    c0 = k0 * n0  # < 2**54
    s = k1 * n0 + k0 * n1 + (c0 >> 27)  # < 2**54 + 2**27
    high = 2 * k1 * n1 + (s >> 26)
    low = ((s & (2**26 - 1)) << 27) + (c0 & (2**27 - 1))
    return high, low >= threshold


def _first_draws(t, N):
    """(B,) int64: how many i.i.d. draws a row takes at first to meet t distinct values of [0, N)
    (t <= N / 2): the expected number, at most -N log(1 - t/N), plus 6 of its standard deviations
    (its variance is at most N (1 / (1 - t/N) + log(1 - t/N) - 1)) plus 8; 0 where t = 0. A row
    short of t distinct values after them draws more (sample_on_device): rare."""
    x = t.double() / N.clamp(min=1).double()
    lg = torch.log1p(-x)
    mean = -N.double() * lg
    sd = (N.double() * (1.0 / (1.0 - x) + lg - 1.0)).clamp(min=0).sqrt()
    return torch.where(t > 0, torch.ceil(mean + 6.0 * sd).long() + 8, 0)


def _draw(counts, total, N, threshold, generator):
    """counts[r] i.i.d. draws for each row r, rows in order: (row, value in [0, N_r), accepted)."""
    dev = counts.device
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=total)
    bits = torch.randint(0, 2**_BITS, (total,), generator=generator, device=dev)
    value, ok = _below(bits, N.index_select(0, row), threshold.index_select(0, row))
    return row, value, ok


def _exclusive(x):
    return x.cumsum(0) - x


def sample_on_device(lengths, prefix_start, min_gap, max_gap, k, generator=None):
    """k[r] pairs of row r, uniform without replacement (docs/contract.md §5), sorted by (row, i, j):
    the draw of sample_pairs, on lengths' device, its work and memory growing with the pairs drawn,
    not with |P|, and no per-pair data copied to the host.

    Each row draws t_r = min(k_r, |P_r| - k_r) flat indices (its pairs counted in (i, j) order)
    and keeps them, or, when k_r > |P_r| / 2, keeps every index it did not draw (enumerating
    |P_r| < 2 k_r). The t_r indices are the first t_r distinct values of a sequence of i.i.d. uniform
    draws from [0, |P_r|): exactly a uniform t_r-subset. A row whose first draws hold fewer distinct
    values draws more, continuing its sequence. A flat index maps to (i, j) in closed form
    (_row_shape, _pair_of_flat). The draws come from `generator` (None: the default generator of
    lengths' device); a generator of another device (the trainer's CPU one for CUDA tensors) gives
    one seed for a generator of lengths' device, so the draws are made there: the same generator
    state, the same pairs.

    Host synchronisations: one reads the sizes (draws, enumerated indices, pairs) with the checks;
    one more asks whether a row is short of distinct values (none when nothing is drawn); a row
    short after all (rare) costs one more each further round. (A CUDA generator for CPU tensors
    adds one: its seed.)
    """
    if not isinstance(min_gap, int) or isinstance(min_gap, bool) or min_gap < 1:
        raise ValueError(f"min_gap must be an int >= 1, got {min_gap!r}")
    if not isinstance(max_gap, int) or isinstance(max_gap, bool) or max_gap < min_gap:
        raise ValueError(f"max_gap must be an int >= min_gap ({min_gap}), got {max_gap!r}")
    dev = lengths.device
    lengths, prefix_start, k = (x.to(device=dev, dtype=torch.int64) for x in (lengths, prefix_start, k))
    B = lengths.numel()
    if not (lengths.shape == prefix_start.shape == k.shape == (B,)):
        raise ValueError(f"lengths, prefix_start and k must be (B,) vectors, got {tuple(lengths.shape)}, "
                          f"{tuple(prefix_start.shape)} and {tuple(k.shape)}")
    N, shape = _row_shape(lengths, prefix_start, min_gap, max_gap)
    comp = 2 * k > N  # rows that keep the complement of t = |P_r| - k_r drawn indices
    t = torch.where(comp, N - k, k)
    M = _first_draws(t, N)
    enum = torch.where(comp, N, 0)
    checks = [((lengths < 0) | (lengths > 2**31), lengths, "lengths[{r}] must lie in [0, 2**31], got {v}"),
              (prefix_start < 0, prefix_start, "prefix_start[{r}] must be >= 0, got {v}"),
              ((k < 0) | (k > N), k, "k[{r}] must lie in [0, |P_r| = {n}], got {v}"),
              (N > 2**_BITS, N, "row {r} has |P_r| = {v} pairs: sample_on_device draws from at most "
                                "2**53 pairs a row (sample_pairs takes more)")]
    # sync 1: the sizes (draws, enumerated indices, pairs drawn, |P|; float64 holds them exactly
    # below 2**53, and |P| is only compared) and the checks
    D, E, K, total, *flags = torch.stack([x.double() for x in (M.sum(), enum.sum(), k.sum(), N.double().sum())]
                                         + [bad.any().double() for bad, _, _ in checks]).tolist()
    for (bad, values, what), flag in zip(checks, flags):
        if flag:
            r = int(bad.nonzero()[0])
            raise ValueError(what.format(r=r, v=int(values[r]), n=int(N[r])))
    if total >= 2.0**62:
        raise ValueError(f"the batch has {total:.4g} pairs: sample_on_device keys them in int64, below 2**62")
    D, E, K = int(D), int(E), int(K)
    # a draw's key, row r's first flat index in the batch plus its value, sorts by (row, value);
    # int32 keys (half a radix sort's passes) while |P| leaves room for the sentinel of rejected draws
    key_dtype = torch.int32 if total < 2**31 - 1 else torch.int64
    sentinel = torch.iinfo(key_dtype).max
    off = _exclusive(N)
    threshold = torch.remainder(torch.full_like(N, 2**_BITS), N.clamp(min=1))
    if generator is not None and generator.device != dev:
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        generator = torch.Generator(device=dev).manual_seed(seed)
    row, value, ok = _draw(M, D, N, threshold, generator)
    while True:
        # each value's first draw in its row's sequence: a stable sort keeps draw order among equal
        # keys; rejected draws sort last and count for nothing
        key = torch.where(ok, off.index_select(0, row) + value, sentinel).to(key_dtype)
        key, order = torch.sort(key, stable=True)
        new = torch.ones_like(ok)
        new[1:] = key[1:] != key[:-1]
        first = torch.empty_like(ok).scatter_(0, order, new) & ok  # back in draw order
        # rank among the row's first draws, in draw order (the draws are grouped by row, rows in order)
        distinct = torch.zeros_like(N).index_add_(0, row, first.long())
        rank = torch.cumsum(first, 0) - 1 - _exclusive(distinct).index_select(0, row)
        keep = first & (rank < t.index_select(0, row))
        if D == 0:
            break
        more = torch.where(distinct < t, torch.maximum(M, t), 0)
        n_more = int(more.sum())  # sync 2 (one more each further round)
        if n_more == 0:
            break
        # rows short of t distinct values draw on: their new draws follow the old ones in each row
        row2, value2, ok2 = _draw(more, n_more, N, threshold, generator)
        row, value, ok = torch.cat([row, row2]), torch.cat([value, value2]), torch.cat([ok, ok2])
        regroup = torch.sort(row, stable=True).indices
        row, value, ok = row[regroup], value[regroup], ok[regroup]
        D += n_more

    # the kept draws in key order, i.e. by (row, value): each row's k_r values (or t_r), sorted
    keep, row = keep[order], row.index_select(0, order)
    value = key.long() - off.index_select(0, row)
    out_off = _exclusive(k)  # a row's first slot in the output
    out_row = torch.zeros(K + 1, dtype=torch.int64, device=dev)  # slot K takes what is not kept
    out_val = torch.zeros(K + 1, dtype=torch.int64, device=dev)
    take = keep & ~comp[row]
    pos = _exclusive(take.long()) - _exclusive(torch.where(comp, 0, k))[row] + out_off[row]
    pos = torch.where(take, pos, K)
    out_row.scatter_(0, pos, row)
    out_val.scatter_(0, pos, value)
    if E > 0:
        # the complement rows: every index of [0, |P_r|) that was not drawn, in order
        en_row = torch.repeat_interleave(torch.arange(B, device=dev), enum, output_size=E)
        en_off = _exclusive(enum)
        en_val = torch.arange(E, device=dev) - en_off[en_row]
        drawn = torch.zeros(E + 1, dtype=torch.bool, device=dev)
        drawn.scatter_(0, torch.where(keep & comp[row], value + en_off[row], E), True)
        rest = ~drawn[:E]
        pos = _exclusive(rest.long()) - _exclusive(torch.where(comp, k, 0))[en_row] + out_off[en_row]
        pos = torch.where(rest, pos, K)
        out_row.scatter_(0, pos, en_row)
        out_val.scatter_(0, pos, en_val)
    out_row, out_val = out_row[:K], out_val[:K]
    i, j = _pair_of_flat(out_val, shape.index_select(0, out_row))
    return out_row, i, j
