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

One program per row; each half is two passes over V in blocks of BV: an online max / sum of
exponentials, then (NEED_GRAD) the gradient. The second pass re-reads the row (2V * es bytes), which
is still in L1/L2. Cost per pair: read 2V * es, write 2V * es (gradient), 4V exp and about 8V
compare/select/FMA, no atomics; the row's bytes, not this arithmetic, bound it. The logsumexp is
float32 whatever the logits' dtype (docs/contract.md §6), kept as the top logit and log1p of the
rest with the label's term apart, so a confident model's small loss is not lost to the rounding
of the large logits.

pair_cross_entropy_rows_kernel (the triton backend's switch ce_bias_sums; V <= BV, one block a
half): R rows a program, each half read once into registers (no second pass), and the column sums
of the gradient it writes (as rounded to Z's dtype) accumulated over the program's rows in float32:
it stores them as one (2V,) row of partial sums, so the last layer's bias gradient is a sum over
n / R partial rows (n * 2V * 4 / R bytes) instead of a column sum re-reading the n * 2V * es
gradient. Per pair: read 2V * es, write 2V * es, the same arithmetic; per program one 2V * 4 write.
"""
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
def pair_cross_entropy_kernel(Z, tok, ia, ib, W, w_stride, loss, s0, V, ldz, hoff, lam, gscale, meet,
                              NEED_GRAD: tl.constexpr, BV: tl.constexpr, UP: tl.constexpr, MEET: tl.constexpr):
    # Row r starts ldz elements after row r - 1; its Prev half hoff elements after its Next half
    # (ldz = 2 * hoff = 2V, or a vocabulary padded to a tile multiple: the columns past V of each
    # half are neither read nor written).
    r = tl.program_id(0).to(tl.int64)
    row = Z + r * ldz
    w, a, c = _pair(W, w_stride, ia, ib, s0 + r)
    total = 0.0
    for half in tl.static_range(2):
        y, cw = _label(tok, a, c, half, meet, w, lam, MEET)
        zr = row + half * hoff
        # Online max mx and ry = the sum of exp(z - mx) over every logit but the label's: the loss
        # is (mx - zy) + log1p(ry + (ey - 1)) and the label's gradient -ry / (ry + ey), ey =
        # exp(zy - mx). For a confident model (the label on top, ey = 1) both keep the tiny ry
        # whole, which mx + log(se) - zy loses to the rounding of a large mx.
        mx = -float("inf")
        ry = 0.0
        for vb in range(0, V, BV):
            col = vb + tl.arange(0, BV)
            z = tl.load(zr + col, mask=col < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(mx, tl.max(z, axis=0))
            # while every logit so far is -inf (a masked block), shift by 0: exp(-inf - -inf) is NaN
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            ry = ry * tl.exp(mx - m_safe) + tl.sum(tl.where(col == y, 0.0, tl.exp(z - m_safe)), axis=0)
            mx = m_new
        zy = tl.load(zr + y).to(tl.float32)
        nll, inv = _nll(mx, zy, ry)
        total += cw * nll
        if NEED_GRAD:
            for vb in range(0, V, BV):
                col = vb + tl.arange(0, BV)
                cm = col < V
                z = tl.load(zr + col, mask=cm, other=0.0).to(tl.float32)
                d = (cw * gscale) * tl.where(col == y, -ry * inv, tl.exp(z - mx) * inv)
                tl.store(zr + col, cast(d, Z.dtype.element_ty, UP), mask=cm)
    tl.store(loss + r, total)


@triton.jit
def pair_cross_entropy_rows_kernel(Z, tok, ia, ib, W, w_stride, loss, dc_part, s0, n, V, ldz, hoff, lam, gscale,
                                   meet, R: tl.constexpr, NEED_GRAD: tl.constexpr, BV: tl.constexpr,
                                   UP: tl.constexpr, MEET: tl.constexpr):
    # Rows pid * R .. pid * R + R - 1 (those < n); dc_part[pid] <- the column sums of their gradient,
    # laid out as a row of Z (2 * hoff wide: a padded vocabulary's columns are left alone).
    pid = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BV)
    cm = col < V
    acc0 = tl.zeros((BV,), dtype=tl.float32)
    acc1 = tl.zeros((BV,), dtype=tl.float32)
    for rr in range(R):
        r = pid * R + rr
        live = r < n
        rs = tl.where(live, r, 0)  # a row past the chunk reads row 0 and writes nothing
        w, a, c = _pair(W, w_stride, ia, ib, s0 + rs)
        total = 0.0
        for half in tl.static_range(2):
            y, cw = _label(tok, a, c, half, meet, w, lam, MEET)
            zr = Z + rs * ldz + half * hoff
            z = tl.load(zr + col, mask=cm, other=-float("inf")).to(tl.float32)
            mx = tl.max(z, axis=0)
            m_safe = tl.where(mx == -float("inf"), 0.0, mx)
            e = tl.exp(z - m_safe)
            is_y = col == y
            ry = tl.sum(tl.where(is_y, 0.0, e), axis=0)
            zy = tl.sum(tl.where(is_y, z, 0.0), axis=0)
            nll, inv = _nll(mx, zy, ry)
            total += cw * nll
            if NEED_GRAD:
                d = cast((cw * gscale) * tl.where(is_y, -ry * inv, e * inv), Z.dtype.element_ty, UP)
                write = cm & (r + col * 0 < n)  # (a vector compare: the interpreter takes no scalar mask here)
                tl.store(zr + col, d, mask=write)
                d = tl.where(write, d.to(tl.float32), 0.0)
                if half == 0:
                    acc0 += d
                else:
                    acc1 += d
        tl.store(loss + rs, total, mask=live)
    if NEED_GRAD:
        tl.store(dc_part + pid * 2 * hoff + col, acc0, mask=cm)
        tl.store(dc_part + pid * 2 * hoff + hoff + col, acc1, mask=cm)


def _halves(name, Z, V):
    """(n, hoff, V) of a chunk's logits Z: rows of two halves hoff apart, V real logits each (None: hoff)."""
    n, hoff = Z.shape[0], Z.shape[1] // 2
    V = hoff if V is None else V
    if Z.stride(1) != 1 or not 0 < V <= hoff:
        raise ValueError(f"{name}: Z {tuple(Z.shape)} with strides {Z.stride()} does not hold two halves of "
                         f"V = {V} logits")
    return n, hoff, V


def pair_cross_entropy_rows_(Z, tok, pl, s0, lam, gscale, need, loss_rows, dc_part, cfg, up, V=None):
    """pair_cross_entropy_ by the rows kernel (V <= cfg's rows_BV): also, with need, the column sums
    of the gradient written into Z, in float32 partial rows dc_part[:programs] (returned) of a
    zeroed (>= ceil(n / R), Z.shape[1]) buffer (without need, (1, Z.shape[1]): not written); their
    sum over rows is the last layer's bias gradient (zero in a padded vocabulary's columns)."""
    n, hoff, V = _halves("pair_cross_entropy_rows_", Z, V)
    R, BV = cfg["ce_rows"], cfg["rows_BV"]
    if V > BV or dc_part.shape[1] != 2 * hoff or need and dc_part.shape[0] * R < n:
        raise ValueError(f"pair_cross_entropy_rows_: Z {tuple(Z.shape)} / {Z.stride()}, V {V}, BV {BV}, "
                         f"dc_part {tuple(dc_part.shape)} do not fit {n} rows of {R}")
    programs = triton.cdiv(n, R)
    meet = pl.meet_token
    pair_cross_entropy_rows_kernel[(programs,)](
        Z, tok, pl.ia, pl.ib, pl.w, pl.w_stride, loss_rows, dc_part, s0, n, V, Z.stride(0), hoff, float(lam),
        float(gscale), 0 if meet is None else int(meet), R=R, NEED_GRAD=need, BV=BV, UP=up, MEET=meet is not None,
        num_warps=cfg["rows_warps"])
    return loss_rows[:n].sum(), dc_part[:programs]


def pair_cross_entropy_(Z, tok, pl, s0, lam, gscale, need, loss_rows, cfg, up, V=None):
    """The weighted loss of the chunk's logits Z (n, 2V), rows contiguous, at slots [s0, s0 + n) of
    the PairList `pl` (a 0-dim float32 sum); with need, Z becomes gscale * its gradient in place.
    With V given, Z is (n, 2Vp), each half padded from V to Vp columns that are left as they are.
    tok: the flat int64 tokens; loss_rows: a float32 buffer of at least n; cfg: ce_config's shapes.
    The labels of gap-1 pairs are pl.meet_token (None: the pair set has none)."""
    n, hoff, V = _halves("pair_cross_entropy_", Z, V)
    meet = pl.meet_token
    pair_cross_entropy_kernel[(n,)](
        Z, tok, pl.ia, pl.ib, pl.w, pl.w_stride, loss_rows, s0, V, Z.stride(0), hoff, float(lam), float(gscale),
        0 if meet is None else int(meet), NEED_GRAD=need, BV=cfg["BV"], UP=up, MEET=meet is not None,
        num_warps=cfg["ce_warps"])
    return loss_rows[:n].sum()
