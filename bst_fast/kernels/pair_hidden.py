"""The split first layer over a chunk of pairs: H = act(A_ia + B_ib) forward, dA / dB backward.

A pair list is sorted by (ia, ib), ia = row * L + i and ib = row * L + j (flat positions of A and
B). A chunk is the slot range [s0, s0 + n) of that list. With dH the chunk's gradient at H:

    dz1[s] = dH[s] * act'(A[ia[s]] + B[ib[s]])
    dA[a] += sum over slots s of the chunk with ia[s] = a  of dz1[s]     (prefix segments)
    dB[c] += sum over slots s of the chunk with ib[s] = c  of dz1[s]     (suffix segments)

Prefix segments are contiguous runs of the list. Suffix segments are runs of `perm`, the list's
slots sorted by (ib, ia); within one, slots increase, so a chunk's part of it is a sub-run that the
kernel finds by binary search. A structured list (all pairs, PairList.jlo set; Switches.structured_sums)
is walked by arithmetic instead: prefix a's suffixes are jlo[a], jlo[a] + 1, ..., suffix c's
prefixes alo[c], alo[c] + 1, ..., and the slot of (a, c) is pre_off[a] + c - jlo[a], so neither ib,
perm, ia nor a search is read. One program owns one segment and one block of hidden units: it sums in a
fixed order and adds into dA / dB without atomics, so results are bitwise reproducible (chunks run
one after another on the stream).

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
- Launch shapes (backends/launch.py gather_config): the segment loop is latency-bound (slot ->
  other row index -> row, dependent loads), so it takes more rows a loop step on fewer warps. The
  structured walk cuts a level from each chain (prefix: none left but dH and the row, both from
  the loop index; suffix: pre_off[a], jlo[a] -> slot -> dH, the row from a) and the suffix search:
  176-193 registers for "act", 140-188 for SWIGLU at 16 rows a step (32 spill), no spills.
  Activation and SWIGLU sums run 32 slots x 64 units on 2 warps: 127-168 registers (ptxas sm_90,
  Triton 3.9), no spills. Plain sums 16 x 128 on 4 warps (32-54 registers). The timings behind
  both: docs/backends.md ("Launch shapes").
"""
import triton
import triton.language as tl

from .activation import NO_ACT, SILU, SWIGLU, act, act_grad, cast, swiglu_grad


@triton.jit
def pair_hidden_kernel(A, Bm, ia, ib, H, s0, n, h, ld, ldh,
                       ACT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, UP: tl.constexpr):
    # H[r, k] = act(A[ia[s0 + r], k] + B[ib[s0 + r], k]) for r < n, summed in float32, in H's dtype.
    # Rows of A and B are ld elements apart (a column slice of a wider table), those of H ldh (H may
    # be the first h columns of a wider buffer: the triton backend's ones column, see there).
    r = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    rm = r < n
    m2 = rm[:, None] & (k[None, :] < h)
    a = tl.load(ia + s0 + r, mask=rm, other=0).to(tl.int64) * ld
    b = tl.load(ib + s0 + r, mask=rm, other=0).to(tl.int64) * ld
    z = (tl.load(A + a[:, None] + k[None, :], mask=m2, other=0.0).to(tl.float32)
         + tl.load(Bm + b[:, None] + k[None, :], mask=m2, other=0.0).to(tl.float32))
    if ACT == SWIGLU:  # z is the gate; the up half sits h columns further on
        u = (tl.load(A + a[:, None] + h + k[None, :], mask=m2, other=0.0).to(tl.float32)
             + tl.load(Bm + b[:, None] + h + k[None, :], mask=m2, other=0.0).to(tl.float32))
        y = act(z, SILU) * u
    else:
        y = act(z, ACT)
    tl.store(H + r[:, None] * ldh + k[None, :], cast(y, H.dtype.element_ty, UP), mask=m2)


# How a segment kernel walks its segment (_segment_sum's MODE). Listed: from the list's index
# arrays. Structured (an all-pairs list, PairList.jlo set): slots and rows by arithmetic.
PREFIX_LISTED = tl.constexpr(0)  # q a slot; the other row ib[q]
SUFFIX_LISTED = tl.constexpr(1)  # q a position in perm; slot perm[q]; the other row ia[slot]
PREFIX_STRUCTURED = tl.constexpr(2)  # q a slot; the other row q + shift (shift = jlo[a] - pre_off[a])
SUFFIX_STRUCTURED = tl.constexpr(3)  # q a prefix a; slot pre_off[a] + shift - jlo[a] (shift = c); row a


@triton.jit
def _segment_sum(dH, M, other, perm, lo, hi, shift, z_fixed, u_fixed, s0, n, h, ld, k, km,
                 ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    # The segment kernels' shared loop: the sum over q in [lo, hi) of dH[slot - s0] * act'(z1),
    # slot and the other side's row as MODE says (`other` is ib or ia, or jlo; `perm` is perm, or
    # pre_off), z1 = z_fixed (the segment's own A or B row) + M[row] (rows ld apart). Under NO_ACT,
    # the plain sum of dH (z_fixed and M are not read). Under SWIGLU two sums, the gate's and the
    # up half's gradients, with g = z_fixed + M[.., k], u = u_fixed + M[.., h + k]; else the second
    # is zero.
    acc = tl.zeros((BK,), dtype=tl.float32)
    acc_up = tl.zeros((BK,), dtype=tl.float32)
    for s in range(lo, hi, BS):
        q = tl.cast(s, tl.int64) + tl.arange(0, BS)  # int64 slots (interpreted, s is a Python int)
        qm = q < hi
        if MODE == SUFFIX_LISTED:
            slot = tl.load(perm + q, mask=qm, other=0)
        elif MODE == SUFFIX_STRUCTURED:
            # the chunk may cut the first and last prefixes' runs: keep slots inside it
            slot = tl.load(perm + q, mask=qm, other=0) + shift - tl.load(other + q, mask=qm, other=0)
            qm = qm & (slot >= s0) & (slot < s0 + n)
        else:
            slot = q
        m2 = qm[:, None] & km[None, :]
        step = tl.arange(0, BS)[:, None]
        d = tl.load(dH + (slot - s0).to(tl.int64)[:, None] * h + k[None, :], mask=m2, other=0.0).to(tl.float32)
        if ACT != NO_ACT:
            # a 64-bit base a step, 32-bit offsets within it (tl.cast: s is a Python int when interpreted)
            if MODE == PREFIX_STRUCTURED:
                Mrows = M + tl.cast(s + shift, tl.int64) * ld + step * ld
            elif MODE == SUFFIX_STRUCTURED:
                Mrows = M + tl.cast(s, tl.int64) * ld + step * ld
            else:
                Mrows = M + tl.load(other + slot, mask=qm, other=0).to(tl.int64)[:, None] * ld
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
def prefix_grad_kernel(dH, A, Bm, ib, jlo, seg_off, seg_lo, dA, s0, n, h, ld, scale,
                       ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, STRUCTURED: tl.constexpr):
    # Program (g, kb) owns prefix segment a = seg_lo + g: slots seg_off[a] .. seg_off[a + 1].
    # dA[a] += scale * (the chunk's part of the segment's sum). Rows of A, B, dA are ld apart.
    # STRUCTURED: the segment's suffixes are jlo[a], jlo[a] + 1, ... (ib is not read).
    g = seg_lo + tl.program_id(0)
    s0 = tl.cast(s0, tl.int64)  # s0 + n passes 2**31 in a batch of more pairs (an i32 argument)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < h
    a = g.to(tl.int64) * ld
    first = tl.load(seg_off + g)
    lo = tl.maximum(first, s0)
    hi = tl.minimum(tl.load(seg_off + g + 1), s0 + n)
    # the segment's own row, float32 (the sums are float32 whatever the tables' dtype)
    za = tl.load(A + a + k, mask=km & (ACT != NO_ACT), other=0.0).to(tl.float32)
    ua = tl.load(A + a + h + k, mask=km & (ACT == SWIGLU), other=0.0).to(tl.float32)
    if STRUCTURED:
        shift = tl.load(jlo + g) - first
        acc, acc_up = _segment_sum(dH, Bm, ib, ib, lo, hi, shift, za, ua, s0, n, h, ld, k, km, ACT, BS, BK,
                                   PREFIX_STRUCTURED)
    else:
        acc, acc_up = _segment_sum(dH, Bm, ib, ib, lo, hi, 0, za, ua, s0, n, h, ld, k, km, ACT, BS, BK,
                                   PREFIX_LISTED)
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
def suffix_grad_kernel(dH, A, Bm, ia, perm, seg_off, seg_lo, dB, s0, n, h, ld, steps, scale,
                       jlo, alo, pre_off, pre_lo, pre_hi,
                       ACT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, STRUCTURED: tl.constexpr):
    # Program (g, kb) owns suffix segment c = seg_lo + g: slots perm[seg_off[c] .. seg_off[c + 1]],
    # increasing; the chunk's part of them is found by binary search, so no program scans slots of
    # other chunks (a row's suffix segments span every chunk that holds part of the row).
    # STRUCTURED: the segment's prefixes are alo[c], alo[c] + 1, ... (as many as its slots), the
    # chunk's part of them those in the chunk's prefix segments [pre_lo, pre_hi), and the slot of
    # prefix a is pre_off[a] + c - jlo[a]: no perm, no ia, no search.
    # dB[c] += scale * (the chunk's part of the segment's sum).
    c = (seg_lo + tl.program_id(0)).to(tl.int64)
    s0 = tl.cast(s0, tl.int64)  # s0 + n passes 2**31 in a batch of more pairs (an i32 argument)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    km = k < h
    first = tl.load(seg_off + c)
    last = tl.load(seg_off + c + 1)
    zb = tl.load(Bm + c * ld + k, mask=km & (ACT != NO_ACT), other=0.0).to(tl.float32)
    ub = tl.load(Bm + c * ld + h + k, mask=km & (ACT == SWIGLU), other=0.0).to(tl.float32)
    if STRUCTURED:
        a0 = tl.load(alo + c)
        lo = tl.maximum(a0, pre_lo)
        hi = tl.minimum(a0 + (last - first), pre_hi)
        acc, acc_up = _segment_sum(dH, A, jlo, pre_off, lo, hi, c, zb, ub, s0, n, h, ld, k, km, ACT, BS, BK,
                                   SUFFIX_STRUCTURED)
    else:
        lo = _first_at_least(perm, first, last, s0, steps)
        hi = _first_at_least(perm, lo, last, s0 + n, steps)
        acc, acc_up = _segment_sum(dH, A, ia, perm, lo, hi, 0, zb, ub, s0, n, h, ld, k, km, ACT, BS, BK,
                                   SUFFIX_LISTED)
    _add_row(dB, c * ld, k, km, h, scale, acc, acc_up, ACT)


def pair_hidden(A, Bm, pl, s0, n, H, act, cfg, up):
    """H (n, h) <- act(A[ia] + B[ib]) for the chunk's slots [s0, s0 + n) of the PairList `pl`;
    A and B share a row stride (A.stride(-2), rows contiguous), H's rows are contiguous (H may be a
    column slice of a wider buffer); act an index of ACT, NO_ACT.value or
    SWIGLU.value (A, B then [gate | up], 2h wide); cfg holds gather_config's shapes; up:
    interpreted_bf16(H.dtype)."""
    h = H.shape[1]
    if (A.stride(-1) != 1 or Bm.stride() != A.stride() or A.shape[-1] != (2 * h if act == SWIGLU.value else h)
            or H.stride(-1) != 1 or H.stride(0) < h):
        raise ValueError(f"pair_hidden: A {tuple(A.shape)} / B {tuple(Bm.shape)} with strides {A.stride()} / "
                         f"{Bm.stride()} do not fit H {tuple(H.shape)} and act {act}")
    pair_hidden_kernel[(triton.cdiv(n, cfg["BM"]), triton.cdiv(h, cfg["BK"]))](
        A, Bm, pl.ia, pl.ib, H, s0, n, h, A.stride(-2), H.stride(0), ACT=act, BM=cfg["BM"], BK=cfg["BK"], UP=up,
        num_warps=cfg["hidden_warps"])


def segment_grads(dH, A, Bm, pl, chunk, dA, dB, act, scale, cfg, sides=("prefix", "suffix")):
    """dA, dB += scale * the prefix / suffix segment sums, over `chunk` (a _pairs.Chunk), of
    dH * act'(A_ia + B_ib) (of dH alone under NO_ACT, which reads neither A nor B; under SWIGLU the
    gate's and up's gradients, dA and dB 2h wide). dH (n, h) contiguous; the rows of dA, dB (and of
    A, B where read) share a stride, each row contiguous: dA may be a column slice of a wider table.
    `sides`: the kernels to launch (benchmarks time one alone)."""
    s0, n, pre_lo, pre_hi, suf_lo, suf_hi = chunk.s0, chunk.n, chunk.pre_lo, chunk.pre_hi, chunk.suf_lo, chunk.suf_hi
    h, ld = dH.shape[1], dA.stride(-2)
    wide = 2 * h if act == SWIGLU.value else h
    read = act != NO_ACT.value
    if (not dH.is_contiguous() or dA.stride(-1) != 1 or dB.stride() != dA.stride() or dA.shape[-1] != wide
            or read and (A.stride() != dA.stride() or Bm.stride() != dA.stride())):
        raise ValueError(f"segment_grads: dH {tuple(dH.shape)}, dA {tuple(dA.shape)} / {dA.stride()}, dB {dB.stride()}, "
                         f"A {A.stride()}, B {Bm.stride()} do not fit act {act}")
    BS, BK, warps = cfg["BS"], cfg["seg_BK"], cfg["seg_warps"]
    grid_k = triton.cdiv(h, BK)
    structured = pl.jlo is not None
    if structured:
        BS = cfg["structured_BS"]
    # a listed list's launches get a placeholder for the structured arrays (never read)
    jlo, alo = (pl.jlo, pl.alo) if structured else (pl.ib, pl.ia)
    if pre_hi > pre_lo and "prefix" in sides:
        prefix_grad_kernel[(pre_hi - pre_lo, grid_k)](
            dH, A, Bm, pl.ib, jlo, pl.pre_off, pre_lo, dA, s0, n, h, ld, scale, ACT=act, BS=BS, BK=BK,
            STRUCTURED=structured, num_warps=warps)
    if suf_hi > suf_lo and "suffix" in sides:
        suffix_grad_kernel[(suf_hi - suf_lo, grid_k)](
            dH, A, Bm, pl.ia, pl.perm, pl.suf_off, suf_lo, dB, s0, n, h, ld, pl.search_steps, scale,
            jlo, alo, pl.pre_off, pre_lo, pre_hi, ACT=act, BS=BS, BK=BK, STRUCTURED=structured, num_warps=warps)
