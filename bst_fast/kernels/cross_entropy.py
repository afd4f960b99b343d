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
"""
import triton
import triton.language as tl

from .activation import cast


@triton.jit
def pair_cross_entropy_kernel(Z, tok, ia, ib, W, w_stride, loss, s0, V, ldz, hoff, lam, gscale, meet,
                              NEED_GRAD: tl.constexpr, BV: tl.constexpr, UP: tl.constexpr, MEET: tl.constexpr):
    # Row r starts ldz elements after row r - 1; its Prev half hoff elements after its Next half
    # (ldz = 2 * hoff = 2V, or a vocabulary padded to a tile multiple: the columns past V of each
    # half are neither read nor written).
    r = tl.program_id(0).to(tl.int64)
    row = Z + r * ldz
    w = tl.load(W + (s0 + r) * w_stride)
    a = tl.load(ia + s0 + r).to(tl.int64)
    c = tl.load(ib + s0 + r).to(tl.int64)
    total = 0.0
    for half in tl.static_range(2):
        if half == 0:
            y = tl.load(tok + a + 1)
            cw = w * lam
        else:
            y = tl.load(tok + c - 1)
            cw = w * (1.0 - lam)
        if MEET:  # a gap-1 pair: both labels are the meet token (tok + a + 1 is still in bounds)
            y = tl.where(c - a == 1, meet, y)
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
        ey = tl.exp(zy - mx)
        rest = ry + (ey - 1.0)
        u = 1.0 + rest
        log1p = tl.where(u == 1.0, rest, tl.log(u) * (rest / (u - 1.0)))  # log1p(rest) to a few ulps
        total += cw * ((mx - zy) + log1p)
        if NEED_GRAD:
            inv = 1.0 / (ry + ey)
            for vb in range(0, V, BV):
                col = vb + tl.arange(0, BV)
                cm = col < V
                z = tl.load(zr + col, mask=cm, other=0.0).to(tl.float32)
                d = (cw * gscale) * tl.where(col == y, -ry * inv, tl.exp(z - mx) * inv)
                tl.store(zr + col, cast(d, Z.dtype.element_ty, UP), mask=cm)
    tl.store(loss + r, total)


def pair_cross_entropy_(Z, tok, pl, s0, lam, gscale, need, loss_rows, cfg, up, V=None):
    """The weighted loss of the chunk's logits Z (n, 2V), rows contiguous, at slots [s0, s0 + n) of
    the PairList `pl` (a 0-dim float32 sum); with need, Z becomes gscale * its gradient in place.
    With V given, Z is (n, 2Vp), each half padded from V to Vp columns that are left as they are.
    tok: the flat int64 tokens; loss_rows: a float32 buffer of at least n; cfg: ce_config's shapes.
    The labels of gap-1 pairs are pl.meet_token (None: the pair set has none)."""
    n, hoff = Z.shape[0], Z.shape[1] // 2
    V = hoff if V is None else V
    if Z.stride(1) != 1 or not 0 < V <= hoff:
        raise ValueError(f"pair_cross_entropy_: Z {tuple(Z.shape)} with strides {Z.stride()} does not hold "
                         f"two halves of V = {V} logits")
    meet = pl.meet_token
    pair_cross_entropy_kernel[(n,)](
        Z, tok, pl.ia, pl.ib, pl.w, pl.w_stride, loss_rows, s0, V, Z.stride(0), hoff, float(lam), float(gscale),
        0 if meet is None else int(meet), NEED_GRAD=need, BV=cfg["BV"], UP=up, MEET=meet is not None,
        num_warps=cfg["ce_warps"])
    return loss_rows[:n].sum()
