"""The two-half cross-entropy of a chunk of pairs over its logits, with the gradient written in place.

Row r of Z holds one pair's 2V logits, Next first. With w the pair's weight, lam = next_weight,
y_n = tokens[ia + 1] (the token after the prefix) and y_p = tokens[ib - 1] (the one before the
suffix):

    loss[r] = w * (lam * (lse(Z[r, :V]) - Z[r, y_n]) + (1 - lam) * (lse(Z[r, V:]) - Z[r, V + y_p]))
    Z[r, :V] <- g * w * lam * (softmax(Z[r, :V]) - onehot(y_n))          (NEED_GRAD only)
    Z[r, V:] <- g * w * (1 - lam) * (softmax(Z[r, V:]) - onehot(y_p))

with g = gscale (1, or the torch backend's float16 chunk scale). Under MEET (docs/contract.md §8:
the pair set holds pairs with ib - ia = 1, min_gap = 1) such a pair takes `meet` as both y_n and
y_p; without it (every min_gap >= 2) the kernel compiles without that select.

A program takes BR rows at a time (a [BR, BV] block of each half), STEPS times over consecutive
row blocks. Where a half fits one block (ONE: V <= BV) it is read once into registers and the
gradient written from them; a wider half takes two passes over V in blocks of BV: an online max /
sum of exponentials, then (NEED_GRAD) the gradient, re-reading the row from L1/L2. Under SUMS (the
triton backend's switch ce_bias_sums; ONE only) the program also sums the gradient it writes (as
rounded to Z's dtype) over its BR * STEPS rows in float32 and stores one (2V,) row of partial sums:
the last layer's bias gradient is then a sum over n / (BR * STEPS) partial rows instead of a column
sum re-reading the n * 2V * es gradient.

Cost model per pair: read 2V * es, write 2V * es (the gradient), 4V exp and about 8V
compare/select/FMA, 3 index loads, no atomics; the row's bytes, not this arithmetic, bound it: at
the paper's chunk (n ~ 29k, V = 1000, bf16) 8 KB a row, 235 MB a chunk, ~80 us at 3 TB/s. One row a
program (BR = 1, two passes) ran at 1.4 TB/s on the H100 (47 ms of the BST original's step): a
program had 4 KB in flight and a chain of scalar loads and block reductions per row. BR rows a
program keep BR times the bytes in flight per reduction; SUMS adds 2V * 4 bytes a program. The
logsumexp is float32 whatever the logits' dtype (docs/contract.md §6), kept as the top logit and
log1p of the rest with the label's term apart, so a confident model's small loss is not lost to
the rounding of the large logits.
"""
import torch
import triton
import triton.language as tl

from .activation import cast


@triton.jit
def _label(tok, a, c, half: tl.constexpr, meet, w, lam, MEET: tl.constexpr):
    # (label, weight) of the Next (half 0) or Prev (half 1) cross-entropy of the pair (a, c) of
    # weight w; a gap-1 pair under MEET takes meet as both labels (tok + a + 1 is still in bounds)
    if half == 0:
        y = tl.load(tok + a + 1)
        cw = w * lam
    else:
        y = tl.load(tok + c - 1)
        cw = w * (1.0 - lam)
    if MEET:
        y = tl.where(c - a == 1, meet, y)
    return y, cw


@triton.jit
def _pair(W, w_stride, ia, ib, slot):
    # (weight, ia, ib) of the pair at `slot`, the flat positions as int64
    return (tl.load(W + slot * w_stride), tl.load(ia + slot).to(tl.int64), tl.load(ib + slot).to(tl.int64))


@triton.jit
def _nll(mx, zy, ry):
    # (lse - zy, 1 / sum of exp(z - mx)) from the top logit mx, the label's zy and ry, the sum of
    # exp(z - mx) over the other logits: (mx - zy) + log1p(ry + (ey - 1)), ey = exp(zy - mx)
    ey = tl.exp(zy - mx)
    rest = ry + (ey - 1.0)
    u = 1.0 + rest
    log1p = tl.where(u == 1.0, rest, tl.log(u) * (rest / (u - 1.0)))  # log1p(rest) to a few ulps
    return (mx - zy) + log1p, 1.0 / (ry + ey)


@triton.jit
def _fold(z, is_y, mx, ry):
    # One (rows, block) of logits z folded into the rows' online max mx and ry, the sum of exp(z - mx)
    # over every logit but the label's (is_y); returns the new (mx, ry). While every logit so far is
    # -inf (a masked block) it shifts by 0: exp(-inf - -inf) is NaN.
    m_new = tl.maximum(mx, tl.max(z, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, ry * tl.exp(mx - m_safe) + tl.sum(tl.where(is_y, 0.0, tl.exp(z - m_safe[:, None])), axis=1)


@triton.jit
def _grad(z, is_y, mx, ry, inv, g):
    # g * (softmax - onehot) of a (rows, block) of logits from the rows' mx, ry and inv (_nll), g (rows, 1)
    return g * tl.where(is_y, (-ry * inv)[:, None], tl.exp(z - mx[:, None]) * inv[:, None])


@triton.jit
def pair_cross_entropy_kernel(Z, tok, ia, ib, W, w_stride, loss, dc_part, s0, n, V, ldz, hoff, lam, gscale, meet,
                              NEED_GRAD: tl.constexpr, SUMS: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
                              BV: tl.constexpr, ONE: tl.constexpr, UP: tl.constexpr, MEET: tl.constexpr):
    # Rows (pid * STEPS + st) * BR + [0, BR) for st < STEPS, those < n. Row r starts ldz elements
    # after row r - 1; its Prev half hoff elements after its Next half (ldz = 2 * hoff = 2V, or a
    # vocabulary padded to a tile multiple: the columns past V of each half are neither read nor
    # written). SUMS: dc_part[pid] <- the column sums of the program's gradient, laid out as a row of Z.
    tl.static_assert(not SUMS or (ONE and NEED_GRAD), "SUMS sums the gradient of a half read once: ONE and NEED_GRAD")
    pid = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BV)
    if SUMS:
        acc0 = tl.zeros((BV,), dtype=tl.float32)
        acc1 = tl.zeros((BV,), dtype=tl.float32)
    for st in range(STEPS):
        r = (pid * STEPS + st) * BR + tl.arange(0, BR)
        live = r < n
        rs = tl.where(live, r, 0)  # a row past the chunk reads row 0 and writes nothing
        w, a, c = _pair(W, w_stride, ia, ib, s0 + rs)
        total = tl.zeros((BR,), dtype=tl.float32)
        for half in tl.static_range(2):
            y, cw = _label(tok, a, c, half, meet, w, lam, MEET)
            zr = Z + rs * ldz + half * hoff  # (BR,) row starts
            is_y = col[None, :] == y[:, None]
            # Online max mx and ry = the sum of exp(z - mx) over every logit but the label's: the
            # loss is (mx - zy) + log1p(ry + (ey - 1)) and the label's gradient -ry / (ry + ey), ey =
            # exp(zy - mx). For a confident model (the label on top, ey = 1) both keep the tiny ry
            # whole, which mx + log(se) - zy loses to the rounding of a large mx.
            if ONE:
                cm = col[None, :] < V
                z = tl.load(zr[:, None] + col[None, :], mask=cm, other=-float("inf")).to(tl.float32)
                mx = tl.max(z, axis=1)
                m_safe = tl.where(mx == -float("inf"), 0.0, mx)  # a row of -inf logits: no NaN from -inf - -inf
                e = tl.exp(z - m_safe[:, None])
                ry = tl.sum(tl.where(is_y, 0.0, e), axis=1)
                zy = tl.sum(tl.where(is_y, z, 0.0), axis=1)
            else:
                mx = tl.full((BR,), -float("inf"), dtype=tl.float32)
                ry = tl.zeros((BR,), dtype=tl.float32)
                for vb in range(0, V, BV):
                    cb = vb + col[None, :]
                    z = tl.load(zr[:, None] + cb, mask=cb < V, other=-float("inf")).to(tl.float32)
                    mx, ry = _fold(z, cb == y[:, None], mx, ry)
                # a label outside [0, V) reads nothing (the op raises on it once its kernels are queued)
                zy = tl.load(zr + y, mask=(y >= 0) & (y < V), other=0.0).to(tl.float32)
            nll, inv = _nll(mx, zy, ry)
            total += cw * nll
            if NEED_GRAD:
                g = (cw * gscale)[:, None]
                if ONE:
                    d = cast(g * tl.where(is_y, (-ry * inv)[:, None], e * inv[:, None]), Z.dtype.element_ty, UP)
                    write = cm & live[:, None]
                    tl.store(zr[:, None] + col[None, :], d, mask=write)
                    if SUMS:
                        part = tl.sum(tl.where(write, d.to(tl.float32), 0.0), axis=0)
                        if half == 0:
                            acc0 += part
                        else:
                            acc1 += part
                else:
                    for vb in range(0, V, BV):
                        cb = vb + col[None, :]
                        cm = (cb < V) & live[:, None]
                        z = tl.load(zr[:, None] + cb, mask=cm, other=0.0).to(tl.float32)
                        d = _grad(z, cb == y[:, None], mx, ry, inv, g)
                        tl.store(zr[:, None] + cb, cast(d, Z.dtype.element_ty, UP), mask=cm)
        tl.store(loss + rs, total, mask=live)
    if SUMS:
        tl.store(dc_part + pid * 2 * hoff + col, acc0, mask=col < V)
        tl.store(dc_part + pid * 2 * hoff + hoff + col, acc1, mask=col < V)


def _halves(name, Z, V):
    """(n, hoff, V) of a chunk's logits Z: rows of two halves hoff apart, V real logits each (None: hoff)."""
    n, hoff = Z.shape[0], Z.shape[1] // 2
    V = hoff if V is None else V
    if Z.stride(1) != 1 or not 0 < V <= hoff:
        raise ValueError(f"{name}: Z {tuple(Z.shape)} with strides {Z.stride()} does not hold two halves of "
                         f"V = {V} logits")
    return n, hoff, V


def pair_cross_entropy_(Z, tok, pl, s0, lam, gscale, need, loss_rows, cfg, up, V=None, dc_part=None):
    """The weighted loss of the chunk's logits Z (n, 2V), rows contiguous, at slots [s0, s0 + n) of
    the PairList `pl` (a 0-dim float32 sum); with need, Z becomes gscale * its gradient in place.
    With V given, Z is (n, 2Vp), each half padded from V to Vp columns that are left as they are.
    tok: the flat int64 tokens; loss_rows: a float32 buffer of at least n; cfg: ce_config's shapes.
    The labels of gap-1 pairs are pl.meet_token (None: the pair set has none).

    dc_part (with need, and a half of at most cfg's BV): a float32 buffer of at least
    ce_sum_programs(n, cfg) rows of Z.shape[1]; the program p then writes the column sums of its
    rows' gradient into dc_part[p] (zero in a padded vocabulary's columns), and the call returns
    (loss, dc_part[:programs]), whose sum over rows is the last layer's bias gradient. Without it,
    (loss, None)."""
    n, hoff, V = _halves("pair_cross_entropy_", Z, V)
    BV = cfg["BV"]
    if loss_rows.dtype != torch.float32 or loss_rows.dim() != 1 or loss_rows.stride(0) != 1 or loss_rows.numel() < n:
        raise ValueError(f"pair_cross_entropy_: loss_rows must be a contiguous float32 vector of at least {n} rows, "
                         f"got {loss_rows.dtype} {tuple(loss_rows.shape)} with strides {loss_rows.stride()}")
    sums = dc_part is not None
    if sums:
        if not need:
            raise ValueError("pair_cross_entropy_: column sums (dc_part) are sums of the gradient: they need need=True")
        if V > BV:
            raise ValueError(f"pair_cross_entropy_: column sums need a half of at most BV = {BV} logits, got V = {V}")
        BR, warps, one = cfg["ce_sum_block"], cfg["ce_sum_warps"], True
        steps = _sum_steps(cfg)
        programs = ce_sum_programs(n, cfg)
        if (dc_part.dtype != torch.float32 or dc_part.device != Z.device or dc_part.dim() != 2
                or dc_part.stride() != (2 * hoff, 1) or dc_part.shape[0] < programs
                or dc_part.shape[1] != 2 * hoff):
            raise ValueError(f"pair_cross_entropy_: dc_part must be a contiguous float32 ({programs} or more, {2 * hoff}) "
                             f"buffer on {Z.device}, got {dc_part.dtype} {tuple(dc_part.shape)} with strides "
                             f"{dc_part.stride()} on {dc_part.device}")
    else:
        BR, warps, steps, one = cfg["ce_rows"], cfg["ce_warps"], 1, cfg["ce_one"] and V <= BV
        programs = triton.cdiv(n, BR)
    meet = pl.meet_token
    pair_cross_entropy_kernel[(programs,)](
        Z, tok, pl.ia, pl.ib, pl.w, pl.w_stride, loss_rows, dc_part if sums else loss_rows, s0, n, V, Z.stride(0), hoff,
        float(lam), float(gscale), 0 if meet is None else int(meet), NEED_GRAD=need, SUMS=sums, BR=BR, STEPS=steps,
        BV=BV, ONE=one, UP=up, MEET=meet is not None, num_warps=warps)
    return loss_rows[:n].sum(), dc_part[:programs] if sums else None


def _sum_steps(cfg) -> int:
    """Blocks a program of the column sums: cfg's ce_sum_rows rows in blocks of ce_sum_block."""
    block, rows = cfg["ce_sum_block"], cfg["ce_sum_rows"]
    if block < 1 or block & (block - 1) or rows < block or rows % block:
        raise ValueError(f"ce_sum_block must be a power of 2 dividing ce_sum_rows, got {block} and {rows}")
    return rows // block


def ce_sum_programs(n: int, cfg) -> int:
    """Programs (rows of partial sums) of pair_cross_entropy_ with column sums over n rows."""
    return triton.cdiv(n, cfg["ce_sum_block"] * _sum_steps(cfg))
