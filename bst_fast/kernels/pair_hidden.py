"""The split first layer over a chunk of pairs: H = act(A_ia + B_ib) forward, dA / dB backward.

A pair list is sorted by (ia, ib), ia = row * L + i and ib = row * L + j (flat positions of A and
B). A chunk is the slot range [s0, s0 + n) of that list. With dH the chunk's gradient at H:

    dz1[s] = dH[s] * act'(A[ia[s]] + B[ib[s]])
    dA[a] += sum over slots s of the chunk with ia[s] = a  of dz1[s]     (prefix segments)
    dB[c] += sum over slots s of the chunk with ib[s] = c  of dz1[s]     (suffix segments)

Prefix segments are contiguous runs of the list. Suffix segments are runs of `perm`, the list's
slots sorted by (ib, ia); within one, slots increase, so a chunk's part of it is a sub-run that the
kernel finds by binary search. One program owns one segment and one block of hidden units: it sums
in a fixed order and adds into dA / dB without atomics, so results are bitwise reproducible (chunks
run one after another on the stream).

A structured list (all pairs, PairList.jlo set; Switches.structured_sums) takes
structured_grad_kernel instead: the pair (a, c) sits at slot pre_off[a] + c - jlo[a], so a program
owns a block of BO consecutive positions of one side and walks the other side one position a step
by arithmetic, loading BO rows of dH at once (consecutive rows on the suffix side) and the other
side's row once for all BO. No ib, perm or ia is read, and nothing is searched. A chunk that holds
few positions (one row of T = 256 at the profile shape) cuts each walk into pieces, whose float32
sums go to a scratch table summed in a fixed order afterwards: still no atomics.

With ACT = NO_ACT the same kernels are the "torch" backend's pair sums of a head's per-position
parts (backends/torch_chunks.py): H = A_ia + B_ib rounded once to H's dtype, and the plain segment
sums of dH (no z to recompute, so A and B are not read in the backward). With ACT = SWIGLU they are
its swiglu parts: A and B are [gate | up] tables (2h wide), H = silu(g) * u with g, u the pair's
two half sums, and the segment sums give both halves' gradients, dH * u * silu'(g) and
dH * silu(g), from g and u recomputed.

Cost per pair and hidden unit (h1 wide, es bytes per element of the compute dtype):
- forward: 2 float32 reads of A, B rows (L2 hits: consecutive slots share ia, and a chunk's B rows
  fit in L2), one es write of H; no FLOPs worth counting next to the GEMMs.
- backward: each reduction reads dH (es) and recomputes z1 (two float32 reads, mostly L2): about
  2 * (es + 8) bytes (2 * es under NO_ACT); the sums are in float32 registers, one read-add-write
  of dA / dB per segment and chunk. No atomics.
- SWIGLU, per pair and output unit: forward four float32 reads (L2) and one es write; backward
  each reduction one es read of dH and two float32 reads (L2). So about 3 * es of memory traffic
  per unit, against about 19 * es when gate and up are stored and combined by torch (written:
  gate, up, silu(gate), H, and three gradients; read back: 12), 16 KB against 102 KB per pair for
  the SwiGLU head at m=512 in bf16.
- Launch shapes (backends/launch.py gather_config): the listed segment loop is latency-bound
  (slot -> other row index -> row, dependent loads), so it takes more rows a loop step on fewer
  warps: activation and SWIGLU sums 32 slots x 64 units on 2 warps (127-168 registers, ptxas
  sm_90, Triton 3.9), plain sums 16 x 128 on 4 warps (32-54). The timings behind both:
  docs/backends.md ("Launch shapes").
- structured_grad_kernel, per program step: BO x BK elements of dH (es bytes each, from HBM) and
  BK float32 of the other side's row (L2), no index load on the prefix side and three scalars on
  the suffix side; its own rows' z (and SWIGLU's up) and the sums stay in registers. Per chunk and
  side: n * h * es bytes of dH, (positions / BO) * walk * h * 4 of other-side rows (the listed walk
  reads one a slot: 32x more), and with P > 1 pieces 2 * P * positions * h * 4 of scratch. With
  the divisibility a launch at h = 768 specialises on, 96-126 registers for an activation at
  BO = 32, BK = 64, 4 warps, 48-55 for plain sums, 93-94 for SWIGLU at BO = 16; the test's
  compile without it: at most 255, no spills. On the H100 it took 0.195 ms a chunk at pairs-a (both
  sides, its best shape) against the listed kernels' 0.126 (docs/backends.md "Levers").
"""
import torch
import triton
import triton.language as tl

from .activation import NO_ACT, SILU, SWIGLU, act, act_grad, cast, swiglu_grad


@triton.jit
def pair_hidden_kernel(A, Bm, ia, ib, H, s0, n, h, ld, ldh, pos0,
                       ACT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, UP: tl.constexpr):
    # H[r, k] = act(A[ia[s0 + r] - pos0, k] + B[ib[s0 + r] - pos0, k]) for r < n, summed in float32,
    # in H's dtype: A and B hold the positions from pos0 on (the triton backend's window of rows).
    # Rows of A and B are ld elements apart (a column slice of a wider table), those of H ldh (H may
    # be the first h columns of a wider buffer: the triton backend's ones column, see there).
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    rm = r < n
    m2 = rm[:, None] & (k[None, :] < h)
    a = (tl.load(ia + s0 + r, mask=rm, other=0).to(tl.int64) - pos0) * ld
    b = (tl.load(ib + s0 + r, mask=rm, other=0).to(tl.int64) - pos0) * ld
    z = (tl.load(A + a[:, None] + k[None, :], mask=m2, other=0.0).to(tl.float32)
         + tl.load(Bm + b[:, None] + k[None, :], mask=m2, other=0.0).to(tl.float32))
    if ACT == SWIGLU:  # z is the gate; the up half sits h columns further on
        u = (tl.load(A + a[:, None] + h + k[None, :], mask=m2, other=0.0).to(tl.float32)
             + tl.load(Bm + b[:, None] + h + k[None, :], mask=m2, other=0.0).to(tl.float32))
        y = act(z, SILU) * u
    else:
        y = act(z, ACT)
    tl.store(H + r[:, None] * ldh + k[None, :], cast(y, H.dtype.element_ty, UP), mask=m2)


# How a segment kernel walks its segment (_segment_sum's MODE), from the list's index arrays.
PREFIX_LISTED = tl.constexpr(0)  # q a slot; the other row ib[q]
SUFFIX_LISTED = tl.constexpr(1)  # q a position in perm; slot perm[q]; the other row ia[slot]


@triton.jit
def _segment_sum(dH, M, other, perm, lo, hi, z_fixed, u_fixed, s0, h, ld, pos0, k, km,
                 ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    # The listed segment kernels' shared loop: the sum over q in [lo, hi) of dH[slot - s0] * act'(z1),
    # slot and the other side's row as MODE says (`other` is ib or ia), z1 = z_fixed (the segment's
    # own A or B row) + M[row - pos0] (rows ld apart). Under NO_ACT,
    # the plain sum of dH (z_fixed and M are not read). Under SWIGLU two sums, the gate's and the
    # up half's gradients, with g = z_fixed + M[.., k], u = u_fixed + M[.., h + k]; else the second
    # is zero.
    acc = tl.zeros((BK,), dtype=tl.float32)
    acc_up = tl.zeros((BK,), dtype=tl.float32)
    for s in range(lo, hi, BS):
        q = tl.cast(s, tl.int64) + tl.arange(0, BS)  # int64 slots (interpreted, s is a Python int)
        qm = q < hi
        slot = tl.load(perm + q, mask=qm, other=0) if MODE == SUFFIX_LISTED else q
        m2 = qm[:, None] & km[None, :]
        d = tl.load(dH + (slot - s0).to(tl.int64)[:, None] * h + k[None, :], mask=m2, other=0.0).to(tl.float32)
        if ACT != NO_ACT:
            Mrows = M + (tl.load(other + slot, mask=qm, other=0).to(tl.int64) - pos0)[:, None] * ld
            z = z_fixed[None, :] + tl.load(Mrows + k[None, :], mask=m2, other=0.0).to(tl.float32)
            if ACT == SWIGLU:
                u = u_fixed[None, :] + tl.load(Mrows + h + k[None, :], mask=m2, other=0.0).to(tl.float32)
                d, d_up = swiglu_grad(d, z, u)
                acc_up += tl.sum(tl.where(m2, d_up, 0.0), axis=0)
            else:
                d = d * act_grad(z, ACT)
        acc += tl.sum(tl.where(m2, d, 0.0), axis=0)
    return acc, acc_up


@triton.jit
def _add_row(dA, row, k, km, h, scale, acc, acc_up, ACT: tl.constexpr):
    # dA[row, k] += scale * acc (row the element offset of the row); under SWIGLU also the up half,
    # h columns further on
    tl.store(dA + row + k, tl.load(dA + row + k, mask=km) + scale * acc, mask=km)
    if ACT == SWIGLU:
        tl.store(dA + row + h + k, tl.load(dA + row + h + k, mask=km) + scale * acc_up, mask=km)


@triton.jit
def prefix_grad_kernel(dH, A, Bm, ib, seg_off, seg_lo, dA, s0, n, h, ld, pos0, scale,
                       ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    # Program (g, kb) owns prefix segment a = seg_lo + g: slots seg_off[a] .. seg_off[a + 1].
    # dA[a - pos0] += scale * (the chunk's part of the segment's sum). Rows of A, B, dA are ld
    # apart; they hold the positions from pos0 on.
    g = seg_lo + tl.program_id(0)
    s0 = tl.cast(s0, tl.int64)  # s0 + n passes 2**31 in a batch of more pairs (an i32 argument)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < h
    a = (g.to(tl.int64) - pos0) * ld
    lo = tl.maximum(tl.load(seg_off + g), s0)
    hi = tl.minimum(tl.load(seg_off + g + 1), s0 + n)
    # the segment's own row, float32 (the sums are float32 whatever the tables' dtype)
    za = tl.load(A + a + k, mask=km & (ACT != NO_ACT), other=0.0).to(tl.float32)
    ua = tl.load(A + a + h + k, mask=km & (ACT == SWIGLU), other=0.0).to(tl.float32)
    acc, acc_up = _segment_sum(dH, Bm, ib, ib, lo, hi, za, ua, s0, h, ld, pos0, k, km, ACT, BS, BK, PREFIX_LISTED)
    _add_row(dA, a, k, km, h, scale, acc, acc_up, ACT)


@triton.jit
def _first_at_least(perm, lo, hi, x, STEPS):
    # the first p in [lo, hi) with perm[p] >= x (hi if none): perm is increasing there. A binary
    # search of STEPS >= log2(hi - lo + 1) rounds; rounds after it has converged change nothing.
    for _ in range(STEPS):
        live = lo < hi
        mid = (lo + hi) // 2
        below = live & (tl.load(perm + mid, mask=live, other=0) < x)
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(live & ~below, mid, hi)
    return lo


@triton.jit
def suffix_grad_kernel(dH, A, Bm, ia, perm, seg_off, seg_lo, dB, s0, n, h, ld, pos0, steps, scale,
                       ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr):
    # Program (g, kb) owns suffix segment c = seg_lo + g: slots perm[seg_off[c] .. seg_off[c + 1]],
    # increasing; the chunk's part of them is found by binary search, so no program scans slots of
    # other chunks (a row's suffix segments span every chunk that holds part of the row).
    # dB[c - pos0] += scale * (the chunk's part of the segment's sum).
    c = (seg_lo + tl.program_id(0)).to(tl.int64)
    own = (c - pos0) * ld
    s0 = tl.cast(s0, tl.int64)  # s0 + n passes 2**31 in a batch of more pairs (an i32 argument)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < h
    first = tl.load(seg_off + c)
    last = tl.load(seg_off + c + 1)
    zb = tl.load(Bm + own + k, mask=km & (ACT != NO_ACT), other=0.0).to(tl.float32)
    ub = tl.load(Bm + own + h + k, mask=km & (ACT == SWIGLU), other=0.0).to(tl.float32)
    lo = _first_at_least(perm, first, last, s0, steps)
    hi = _first_at_least(perm, lo, last, s0 + n, steps)
    acc, acc_up = _segment_sum(dH, A, ia, perm, lo, hi, zb, ub, s0, h, ld, pos0, k, km, ACT, BS, BK, SUFFIX_LISTED)
    _add_row(dB, own, k, km, h, scale, acc, acc_up, ACT)


# structured_grad_kernel's SIDE: whose sums a program owns
PREFIX = tl.constexpr(0)  # own prefixes a (rows of A, dA); walk suffixes c (rows of B)
SUFFIX = tl.constexpr(1)  # own suffixes c (rows of B, dB); walk prefixes a (rows of A)
_NONE = tl.constexpr(2**62)  # past every position: the minimum of no run


@triton.jit
def structured_grad_kernel(dH, A, Bm, pre_off, jlo, alo, suf_off, dOwn, part, s0, n, h, ld, pos0, own_lo, own_hi,
                           walk_lo, walk_hi, part_rows, scale, SIDE: tl.constexpr, ACT: tl.constexpr,
                           BO: tl.constexpr, BK: tl.constexpr, PIECES: tl.constexpr):
    # A structured list (all pairs, PairList.jlo/alo): the pair (a, c) sits at slot
    # pre_off[a] + c - jlo[a] when c lies in prefix a's run [jlo[a], jlo[a] + count[a]). Program
    # (blk, kb, piece) owns BO consecutive positions o (a block aligned to BO, inside [own_lo,
    # own_hi)) and BK hidden units, and walks the other side's positions w one at a time: at each
    # step its BO slots are one load of BO rows of dH (suffix side: consecutive rows), the other
    # side's row is read once for all BO, and the own rows' z halves stay in registers. The walk
    # reads no index array on the prefix side, and three scalars a step (pre_off[w], pre_off[w + 1],
    # jlo[w]) on the suffix side.
    # PIECES > 1 splits each block's walk into that many parts (parallelism when a chunk holds few
    # positions): piece p stores its sums in part[p, o - base] (part_rows rows a piece), summed
    # afterwards in a fixed order; PIECES = 1 adds scale * sums into dOwn. No atomics either way.
    # A, B, dOwn hold the positions from pos0 on (row p - pos0 for position p).
    base = own_lo // BO * BO
    o = base + tl.program_id(0).to(tl.int64) * BO + tl.arange(0, BO)
    om = (o >= own_lo) & (o < own_hi)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < h
    s0 = tl.cast(s0, tl.int64)
    if SIDE == PREFIX:
        start = tl.load(pre_off + o, mask=om, other=0)
        j0 = tl.load(jlo + o, mask=om, other=0).to(tl.int64)
        # the chunk's part of each own prefix's run: suffixes c in [rlo, rhi)
        rlo = j0 + tl.maximum(s0 - start, 0)
        rhi = j0 + tl.minimum(tl.load(pre_off + o + 1, mask=om, other=0) - start, s0 + n - start)
        live = om & (rhi > rlo)
        lo = tl.min(tl.where(live, rlo, _NONE), axis=0)
        hi = tl.max(tl.where(live, rhi, 0), axis=0)
        rlo = tl.where(live, rlo, _NONE)  # a dead row is valid at no step
        row0 = start - j0 - s0  # the chunk row of (o, c) is row0 + c
        own, walk = A, Bm
    else:
        a0 = tl.load(alo + o, mask=om, other=0).to(tl.int64)
        count = tl.load(suf_off + o + 1, mask=om, other=0) - tl.load(suf_off + o, mask=om, other=0)
        live = om & (count > 0)
        lo = tl.maximum(tl.min(tl.where(live, a0, _NONE), axis=0), walk_lo)
        hi = tl.minimum(tl.max(tl.where(live, a0 + count, 0), axis=0), walk_hi)
        own, walk = Bm, A
    hi = tl.maximum(hi, lo)
    step = (hi - lo + PIECES - 1) // PIECES
    w_lo = lo + tl.program_id(2) * step
    w_hi = tl.minimum(hi, w_lo + step)
    rows2 = (o - pos0)[:, None] * ld + k[None, :]
    om2 = om[:, None] & km[None, :]
    zo = tl.load(own + rows2, mask=om2 & (ACT != NO_ACT), other=0.0).to(tl.float32)
    uo = tl.load(own + rows2 + h, mask=om2 & (ACT == SWIGLU), other=0.0).to(tl.float32)
    acc = tl.zeros((BO, BK), dtype=tl.float32)
    acc_up = tl.zeros((BO, BK), dtype=tl.float32)
    for w_ in range(w_lo, w_hi):
        w = tl.cast(w_, tl.int64)  # a Python int when interpreted
        if SIDE == PREFIX:
            valid = (w >= rlo) & (w < rhi)
            row = row0 + w
        else:  # prefix w's run, cut to the chunk, as the suffixes it meets here
            first = tl.load(pre_off + w)
            j = tl.load(jlo + w).to(tl.int64)
            w_rlo = j + tl.maximum(s0 - first, 0)
            w_rhi = j + tl.minimum(tl.load(pre_off + w + 1) - first, s0 + n - first)
            valid = om & (o >= w_rlo) & (o < w_rhi)
            row = o + (first - j - s0)
        m2 = valid[:, None] & km[None, :]
        d = tl.load(dH + row[:, None] * h + k[None, :], mask=m2, other=0.0).to(tl.float32)
        if ACT != NO_ACT:
            z = zo + tl.load(walk + (w - pos0) * ld + k, mask=km, other=0.0).to(tl.float32)[None, :]
            if ACT == SWIGLU:
                u = uo + tl.load(walk + (w - pos0) * ld + h + k, mask=km, other=0.0).to(tl.float32)[None, :]
                d, d_up = swiglu_grad(d, z, u)
                acc_up += tl.where(m2, d_up, 0.0)
            else:
                d = d * act_grad(z, ACT)
        acc += tl.where(m2, d, 0.0)
    if PIECES == 1:
        tl.store(dOwn + rows2, tl.load(dOwn + rows2, mask=om2) + scale * acc, mask=om2)
        if ACT == SWIGLU:
            tl.store(dOwn + rows2 + h, tl.load(dOwn + rows2 + h, mask=om2) + scale * acc_up, mask=om2)
    else:
        wide = 2 * h if ACT == SWIGLU else h
        prow = (tl.program_id(2) * part_rows + (o - base))[:, None] * wide + k[None, :]
        tl.store(part + prow, acc, mask=km[None, :])
        if ACT == SWIGLU:
            tl.store(part + prow + h, acc_up, mask=km[None, :])


def pair_hidden(A, Bm, pl, s0, n, H, act, cfg, up, pos0: int = 0):
    """H (n, h) <- act(A[ia] + B[ib]) for the chunk's slots [s0, s0 + n) of the PairList `pl`,
    where A and B hold the flat positions from pos0 on (their row p - pos0 is position p);
    A and B share a row stride (A.stride(-2), rows contiguous), H's rows are contiguous (H may be a
    column slice of a wider buffer); act an index of ACT, NO_ACT.value or
    SWIGLU.value (A, B then [gate | up], 2h wide); cfg holds gather_config's shapes; up:
    interpreted_bf16(H.dtype)."""
    h = H.shape[1]
    if (A.stride(-1) != 1 or Bm.stride() != A.stride() or A.shape[-1] != (2 * h if act == SWIGLU.value else h)
            or H.shape[0] != n or H.stride(-1) != 1 or H.stride(0) < h):
        raise ValueError(f"pair_hidden: A {tuple(A.shape)} / B {tuple(Bm.shape)} with strides {A.stride()} / "
                         f"{Bm.stride()} do not fit H {tuple(H.shape)} ({n} rows) and act {act}")
    pair_hidden_kernel[(triton.cdiv(n, cfg["BM"]), triton.cdiv(h, cfg["BK"]))](
        A, Bm, pl.ia, pl.ib, H, s0, n, h, A.stride(-2), H.stride(0), pos0, ACT=act, BM=cfg["BM"], BK=cfg["BK"], UP=up,
        num_warps=cfg["hidden_warps"])


def segment_grads(dH, A, Bm, pl, chunk, dA, dB, act, scale, cfg, sides=("prefix", "suffix"), pos0: int = 0):
    """dA, dB += scale * the prefix / suffix segment sums, over `chunk` (a _pairs.Chunk), of
    dH * act'(A_ia + B_ib) (of dH alone under NO_ACT, which reads neither A nor B; under SWIGLU the
    gate's and up's gradients, dA and dB 2h wide). dH (n, h) contiguous; the rows of dA, dB (and of
    A, B where read) share a stride, each row contiguous: dA may be a column slice of a wider table.
    A structured list (pl.jlo set) takes structured_grad_kernel, a listed one the segment kernels.
    `sides`: the kernels to launch (benchmarks time one alone). A, B, dA and dB hold the flat
    positions from pos0 on, as in pair_hidden."""
    s0, n, pre_lo, pre_hi, suf_lo, suf_hi = chunk.s0, chunk.n, chunk.pre_lo, chunk.pre_hi, chunk.suf_lo, chunk.suf_hi
    h, ld = dH.shape[1], dA.stride(-2)
    wide = 2 * h if act == SWIGLU.value else h
    read = act != NO_ACT.value
    if (not dH.is_contiguous() or dH.shape[0] != n or dA.stride(-1) != 1 or dB.stride() != dA.stride()
            or dA.shape[-1] != wide or read and (A.stride() != dA.stride() or Bm.stride() != dA.stride())):
        raise ValueError(f"segment_grads: dH {tuple(dH.shape)} (contiguous, {n} rows), dA {tuple(dA.shape)} / "
                         f"{dA.stride()}, dB {dB.stride()}, A {A.stride()}, B {Bm.stride()} do not fit act {act}")
    if pl.jlo is not None:
        for side in sides:
            own = (pre_lo, pre_hi) if side == "prefix" else (suf_lo, suf_hi)
            _structured_sums(dH, A, Bm, pl, chunk, dA if side == "prefix" else dB, own, act, scale, cfg, side, pos0)
        return
    BS, BK, warps = cfg["BS"], cfg["seg_BK"], cfg["seg_warps"]
    grid_k = triton.cdiv(h, BK)
    if pre_hi > pre_lo and "prefix" in sides:
        prefix_grad_kernel[(pre_hi - pre_lo, grid_k)](
            dH, A, Bm, pl.ib, pl.pre_off, pre_lo, dA, s0, n, h, ld, pos0, scale, ACT=act, BS=BS, BK=BK,
            num_warps=warps)
    if suf_hi > suf_lo and "suffix" in sides:
        suffix_grad_kernel[(suf_hi - suf_lo, grid_k)](
            dH, A, Bm, pl.ia, pl.perm, pl.suf_off, suf_lo, dB, s0, n, h, ld, pos0, pl.search_steps, scale,
            ACT=act, BS=BS, BK=BK, num_warps=warps)


def walk_pieces(blocks: int, longest: int, cfg) -> int:
    """How many pieces structured_grad_kernel cuts each block's walk into: enough for about
    cfg["block_programs"] programs (blocks counts own blocks times hidden blocks), at most 8, each
    piece at least cfg["block_min_steps"] of the `longest` walk."""
    want = triton.cdiv(cfg["block_programs"], max(1, blocks))
    return max(1, min(8, want, longest // cfg["block_min_steps"]))


def _structured_sums(dH, A, Bm, pl, chunk, dOwn, own, act, scale, cfg, side, pos0):
    # one side's sums over a structured list's chunk: positions [own[0], own[1]) own them
    lo, hi = own
    if hi <= lo:
        return
    h, ld = dH.shape[1], dOwn.stride(-2)
    wide = 2 * h if act == SWIGLU.value else h
    BO, BK = cfg["block_BO"], cfg["block_BK"]
    base = lo // BO * BO
    blocks = triton.cdiv(hi - base, BO)
    grid_k = triton.cdiv(h, BK)
    # a walk is at most one row's (one document's) positions: 2**search_steps bounds the longest run
    pieces = walk_pieces(blocks * grid_k, 1 << pl.search_steps, cfg)
    part = torch.empty((pieces, blocks * BO, wide) if pieces > 1 else (1,), dtype=torch.float32, device=dH.device)
    structured_grad_kernel[(blocks, grid_k, pieces)](
        dH, A, Bm, pl.pre_off, pl.jlo, pl.alo, pl.suf_off, dOwn, part, chunk.s0, chunk.n, h, ld, pos0, lo, hi,
        chunk.pre_lo, chunk.pre_hi, blocks * BO, scale, SIDE=0 if side == "prefix" else 1, ACT=act, BO=BO, BK=BK,
        PIECES=pieces, num_warps=cfg["block_warps"])
    if pieces > 1:  # the pieces' sums in a fixed order (a reduction without atomics)
        rows = dOwn.view(-1, dOwn.shape[-1])[lo - pos0 : hi - pos0]  # a view (or an error), never a copy
        rows.add_(part[:, lo - base : hi - base].sum(0), alpha=scale)
