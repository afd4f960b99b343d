"""The last layer's GEMM with the two-half cross-entropy in its epilogue (the triton backend's switch
fused_ce): a chunk's logits are made, reduced and turned into their gradient by one kernel, and no
separate pass reads them back from HBM.

For a chunk of n pairs with last-layer input H (n, K), weights W (2 hoff, K) and bias c (2 hoff,),
each half V real rows (hoff = V, or Vp padded with zero rows), program (p, half) owns rows
[p BM, p BM + BM) of one half and walks its columns in blocks of BN:

    pass 1, per block:  z = round(H W_half^T + c)        tensor cores, a K-loop of BK
                        online max mx, ry = sum of exp(z - mx) over every column but the label's,
                        the label's logit zy; under NEED_GRAD z is stored into Z
    loss:               w lam_half ((mx - zy) + log1p(ry + ey - 1))   (cross_entropy._nll)
    pass 2 (NEED_GRAD), per block: z read back, dz = g w lam_half (softmax - onehot) written over it,
                        and the block's column sums of dz (as rounded) into dc_part[p]: the bias
                        gradient's partial sums, so no column sum re-reads dz

z is rounded to the compute dtype before anything uses it, so the loss and the gradient are the
cross-entropy of the logits as stored, as on the unfused path (cuBLAS's rounded logits, then
pair_cross_entropy_kernel); the labels, weights and meet pairs come from the same helpers.

Cost model per pair (K = hL, V a half, es the compute dtype's bytes; the paper's chunk: n ~ 29k,
K = 512, V = 1000, bf16):
- FLOPs: 2 K 2V on the tensor cores (the unfused logits GEMM's); 2 exponentials and about 30 other
  instructions a logit in the epilogues: ~60 us of issue a chunk on 132 SMs, which one program an
  SM cannot hide behind its own wgmma (64 x 128 blocks on 4 warps fit two programs an SM).
- HBM: dz written, 2V es (4 KB). z is written in pass 1 and read back in pass 2 while it is likely
  still in L2: a program's BM x V block is 256 KB at BM = 128, one program an SM (255 registers)
  holds ~34 MB of the H100's 50 MB L2. The unfused path moves 4 x 2V es here (the GEMM's write of
  Z, the cross-entropy's read and write, the column sum's read): 47 + ~26 ms of the H100's 408 ms
  BST-original step.
- L2 reads: a program reads all of its half's W (V K es = 1 MB) and its H rows once per column
  block, about 2V K es / BM + K es 2V / BN = 16 + 16 KB a pair at BM = BN = 128: cuBLAS's 256 x 152
  tiles read ~21 KB. Loss and partial sums: 8 bytes a pair, 8V bytes a program. No atomics: every
  output has one writer, in a fixed order (bitwise reproducible).
- Registers: a BM x BN block is two BM x BN/2 float32 accumulators fed by one K-loop (64 a thread at
  128 x 128 on 8 warps), so the epilogue's temporaries cover half a block at a time; with the
  label comparison kept inside the loop and V, K and the strides passed divided by 8 (16-byte
  vectors), ptxas (sm_90) reports 246-255 registers and no spills, and wgmma.
- Prediction: 130-200 us a chunk of the paper's step against the unfused 86 + 164 + ~90 us (GEMM,
  cross-entropy, column sums): 40-60 ms less a step. Not timed on a GPU yet: bench/logits_ce.py
  and bench/levers.py's fused_ce rows measure it against the unfused path.
"""
import torch
import triton
import triton.language as tl

from .activation import cast
from .cross_entropy import _fold, _grad, _label, _nll, _pair


@triton.jit
def _dots(h, w0, w1, acc0, acc1, UP: tl.constexpr, IEEE: tl.constexpr):
    # acc0 + h w0 and acc1 + h w1 on the tensor cores
    if UP:  # the interpreter's bf16 dot is wrong: exact products of the upcast operands instead
        h, w0, w1 = h.to(tl.float32), w0.to(tl.float32), w1.to(tl.float32)
    if IEEE:  # float32 operands: full float32 products, as torch's default mm (no TF32)
        return tl.dot(h, w0, acc0, input_precision="ieee"), tl.dot(h, w1, acc1, input_precision="ieee")
    return tl.dot(h, w0, acc0), tl.dot(h, w1, acc1)


@triton.jit
def _logits_blocks(Hb, W, c, lrs, c0, c1, ldh, ldw, K, BM: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
                   EVEN_K: tl.constexpr, UP: tl.constexpr, IEEE: tl.constexpr):
    # round(H[lrs] W[cs]^T + c[cs]) as float32 for the column sets c0 and c1, (BM, BS) each, Hb the
    # row block's first row. One K-loop feeds both accumulators from each tile of H (a BM x 2BS
    # tile's reads of H), while the epilogue then works on one BM x BS half at a time (half the live
    # registers of a 2BS-wide block's). Offsets within the block are int32.
    acc0 = tl.zeros((BM, BS), dtype=tl.float32)
    acc1 = tl.zeros((BM, BS), dtype=tl.float32)
    kk = tl.arange(0, BK)
    hp = Hb + lrs[:, None] * ldh + kk[None, :]
    wp0 = W + c0[None, :] * ldw + kk[:, None]
    wp1 = W + c1[None, :] * ldw + kk[:, None]
    for kb in range(0, K, BK):
        if EVEN_K:
            h, w0, w1 = tl.load(hp), tl.load(wp0), tl.load(wp1)
        else:
            km = (kb + kk) < K
            h = tl.load(hp, mask=km[None, :], other=0.0)
            w0 = tl.load(wp0, mask=km[:, None], other=0.0)
            w1 = tl.load(wp1, mask=km[:, None], other=0.0)
        acc0, acc1 = _dots(h, w0, w1, acc0, acc1, UP, IEEE)
        hp += BK
        wp0 += BK
        wp1 += BK
    z0 = cast(acc0 + tl.load(c + c0).to(tl.float32)[None, :], Hb.dtype.element_ty, UP).to(tl.float32)
    z1 = cast(acc1 + tl.load(c + c1).to(tl.float32)[None, :], Hb.dtype.element_ty, UP).to(tl.float32)
    return z0, z1


@triton.jit
def _row_label(tok, ia, ib, Wp, w_stride, slot, half, meet, lam, MEET: tl.constexpr):
    # (label, weight) of the rows' pairs at `slot` for the half `half` (a runtime 0 or 1)
    w, a, c = _pair(Wp, w_stride, ia, ib, slot)
    if half == 0:
        y, cw = _label(tok, a, c, 0, meet, w, lam, MEET)
    else:
        y, cw = _label(tok, a, c, 1, meet, w, lam, MEET)
    return y, cw


@triton.jit
def _online(z, cb, V, y, k, mx, ry, zy, Zr, live, NEED_GRAD: tl.constexpr):
    # One (BM, BS) block of a half's logits z, columns cb (those >= V are padding): store it at Zr
    # (row pointers) under NEED_GRAD, and fold it into the online max mx, ry (the sum of exp(z - mx)
    # over every column but the label's) and zy (the label's logit).
    real = cb < V
    z = tl.where(real[None, :], z, -float("inf"))
    if NEED_GRAD:
        tl.store(Zr[:, None] + cb[None, :], z.to(Zr.dtype.element_ty), mask=live[:, None] & real[None, :])
    # the label's column against the block's: both sides shifted by the loop-carried k, so that
    # neither is loop-invariant and the compiler hoists no (BM, BS) broadcast of y or of the columns
    # out of the loop (it would hold a register a logit through the whole K-loop)
    is_y = (cb - k)[None, :] == (y - k)[:, None]
    mx, ry = _fold(z, is_y, mx, ry)
    return mx, ry, zy + tl.sum(tl.where(is_y, z, 0.0), axis=1)


@triton.jit
def pair_logits_ce_kernel(H, W, c, Z, tok, ia, ib, Wp, w_stride, loss, dc_part, s0, n, K, V, ldh, ldw, ldz, hoff,
                          nloss, lam, gscale, meet, NEED_GRAD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, EVEN_K: tl.constexpr, VEC: tl.constexpr, VEC_K: tl.constexpr,
                          UP: tl.constexpr, IEEE: tl.constexpr, MEET: tl.constexpr):
    # Program pid: rows (pid // 2) * BM + [0, BM), half pid % 2 (the two halves of a row block run
    # side by side and share its H rows in L2), columns in blocks of BN as two (BM, BN / 2) halves.
    # Z rows are ldz apart, a half's columns at half * hoff; W is (2 hoff, K), rows ldw apart, its
    # padded rows zeros. loss[half * nloss + r] <- the half's weighted loss of row r;
    # dc_part[pid // 2, half * hoff + col] <- the column sums of the program's gradient (zero in
    # padded columns). The row block's base offsets are int64, offsets within it int32 (BM rows of
    # ldh or ldz, and W's 2 hoff rows of ldw, are far below 2**31).
    # V, hoff and ldz arrive divided by VEC, and K, ldh and ldw by VEC_K (8 where it divides them all,
    # else 1): Triton's launcher marks only multiples of 16 (V = 1000 and K = 200 are multiples of 8),
    # and a product by the constant restores what 16-byte vectors of 16-bit logits need to know.
    V, hoff, ldz = V * VEC, hoff * VEC, ldz * VEC
    K, ldh, ldw = K * VEC_K, ldh * VEC_K, ldw * VEC_K
    BS: tl.constexpr = BN // 2
    pid = tl.program_id(0)
    half = pid % 2
    pm = pid // 2
    row0 = pm.to(tl.int64) * BM
    lr = tl.arange(0, BM)
    live = lr < n - pm * BM
    lrs = tl.where(live, lr, 0)  # a row past the chunk computes row 0's logits and writes nothing
    y, cw = _row_label(tok, ia, ib, Wp, w_stride, s0 + row0 + lrs, half, meet, lam, MEET)
    y = y.to(tl.int32)  # the loop keeps only the labels: the weights are loaded again after it
    col = tl.arange(0, BS)
    base = half * hoff
    Hb = H + row0 * ldh
    Zr = Z + row0 * ldz + base + lrs * ldz  # (BM,) row starts of the half
    mx = tl.full((BM,), -float("inf"), dtype=tl.float32)
    ry = tl.zeros((BM,), dtype=tl.float32)
    zy = tl.zeros((BM,), dtype=tl.float32)
    k = 0
    for vb in range(0, V, BN):
        cb0, cb1 = vb + col, vb + BS + col
        z0, z1 = _logits_blocks(Hb, W, c, lrs, base + tl.where(cb0 < V, cb0, 0), base + tl.where(cb1 < V, cb1, 0),
                                ldh, ldw, K, BM, BS, BK, EVEN_K, UP, IEEE)
        mx, ry, zy = _online(z0, cb0, V, y, k, mx, ry, zy, Zr, live, NEED_GRAD)
        mx, ry, zy = _online(z1, cb1, V, y, k, mx, ry, zy, Zr, live, NEED_GRAD)
        k += 1
    _, cw = _row_label(tok, ia, ib, Wp, w_stride, s0 + row0 + lrs, half, meet, lam, MEET)
    nll, inv = _nll(mx, zy, ry)
    tl.store(loss + half * nloss + row0 + lrs, cw * nll, mask=live)
    if NEED_GRAD:
        # pass 2 reads logits that other threads of the program stored in pass 1 (its layout need not
        # be the store's): a barrier makes their global writes visible to the whole block first
        tl.debug_barrier()
        g = (cw * gscale)[:, None]
        # the blocks of the half and its padding (Vp > V: zero gradient, so the weight GEMMs that read
        # the whole (n, 2 hoff) buffer see zeros there)
        for vb in range(0, hoff, BS):
            cb = vb + col
            zp = Zr[:, None] + cb[None, :]
            z = tl.load(zp, mask=live[:, None] & (cb < V)[None, :], other=-float("inf")).to(tl.float32)
            d = cast(_grad(z, col[None, :] == (y - vb)[:, None], mx, ry, inv, g), Z.dtype.element_ty, UP)
            write = live[:, None] & (cb < hoff)[None, :]
            tl.store(zp, d, mask=write)
            tl.store(dc_part + pm.to(tl.int64) * 2 * hoff + base + cb,
                     tl.sum(tl.where(write, d.to(tl.float32), 0.0), axis=0), mask=cb < hoff)


def logits_ce_programs(n: int, cfg) -> int:
    """Rows of partial column sums pair_logits_cross_entropy_ writes for n rows: one a block of lce_BM."""
    return triton.cdiv(n, cfg["lce_BM"])


def pair_logits_cross_entropy_(H, W, c, Z, tok, pl, s0, lam, gscale, need, loss_rows, dc_part, cfg, up, V):
    """The weighted loss of the chunk at slots [s0, s0 + n) of the PairList `pl`, from the last layer's
    input H (n, K) (rows contiguous, any row stride), weights W (2 hoff, K) and bias c (2 hoff,), all
    in one dtype, each half padded from V to hoff real-or-zero rows; returns (a 0-dim float32 loss,
    dc_part[:programs] or None).

    With need, Z (n, 2 hoff), contiguous and of H's dtype, receives gscale times the logits' gradient (zero in
    padded columns), and dc_part, a contiguous float32 (>= logits_ce_programs(n, cfg), 2 hoff)
    buffer, the column sums of each program's rows of it: their sum over rows is the last layer's
    bias gradient. Without need Z and dc_part are None (the logits are never stored). loss_rows: a
    contiguous float32 buffer of at least 2n; cfg: launch.logits_ce_config's shapes; up: the
    interpreter's bf16 rounding by hand (interpreted_bf16)."""
    if H.dim() != 2 or H.stride(1) != 1 or W.dim() != 2 or W.stride(1) != 1 or c.dim() != 1 or c.stride(0) != 1:
        raise ValueError(f"pair_logits_cross_entropy_: H, W must be matrices with contiguous rows and c a contiguous "
                         f"vector, got H {tuple(H.shape)} strides {H.stride()}, W {tuple(W.shape)} strides "
                         f"{W.stride()}, c {tuple(c.shape)}")
    n, K = H.shape
    hoff = W.shape[0] // 2
    if W.shape != (2 * hoff, K) or c.shape != (2 * hoff,) or not 0 < V <= hoff:
        raise ValueError(f"pair_logits_cross_entropy_: W must be (2 hoff, K = {K}) and c (2 hoff,) with halves of "
                         f"hoff >= V = {V} rows, got W {tuple(W.shape)} and c {tuple(c.shape)}")
    if W.dtype != H.dtype or c.dtype != H.dtype or len({H.device, W.device, c.device}) != 1:
        raise ValueError(f"pair_logits_cross_entropy_: H, W and c must share a dtype and a device, got "
                         f"{H.dtype}/{W.dtype}/{c.dtype} on {H.device}/{W.device}/{c.device}")
    if loss_rows.dtype != torch.float32 or loss_rows.dim() != 1 or loss_rows.stride(0) != 1 or loss_rows.numel() < 2 * n:
        raise ValueError(f"pair_logits_cross_entropy_: loss_rows must be a contiguous float32 vector of at least "
                         f"{2 * n} rows, got {loss_rows.dtype} {tuple(loss_rows.shape)} with strides {loss_rows.stride()}")
    if 2 * hoff * W.stride(0) >= 2**31 or cfg["lce_BM"] * max(H.stride(0), 2 * hoff) >= 2**31:
        raise ValueError(f"pair_logits_cross_entropy_: W {tuple(W.shape)} (row stride {W.stride(0)}) or a block of "
                         f"{cfg['lce_BM']} rows of H or Z is past the kernel's 32-bit offsets: turn fused_ce off")
    programs = logits_ce_programs(n, cfg)
    if need:
        if Z is None or Z.dtype != H.dtype or Z.device != H.device or Z.shape != (n, 2 * hoff) or not Z.is_contiguous():
            raise ValueError(f"pair_logits_cross_entropy_: Z must be a contiguous ({n}, {2 * hoff}) {H.dtype} buffer on "
                             f"{H.device}, got {None if Z is None else (Z.dtype, tuple(Z.shape), Z.stride(), Z.device)}")
        if (dc_part is None or dc_part.dtype != torch.float32 or dc_part.device != H.device or dc_part.dim() != 2
                or dc_part.stride() != (2 * hoff, 1) or dc_part.shape[0] < programs
                or dc_part.shape[1] != 2 * hoff):
            raise ValueError(f"pair_logits_cross_entropy_: dc_part must be a contiguous float32 ({programs} or more, "
                             f"{2 * hoff}) buffer on {H.device}, got "
                             f"{None if dc_part is None else (dc_part.dtype, tuple(dc_part.shape), dc_part.stride())}")
    elif Z is not None or dc_part is not None:
        raise ValueError("pair_logits_cross_entropy_: without need there is no gradient: Z and dc_part must be None")
    meet = pl.meet_token
    vec = 8 if V % 8 == 0 and hoff % 8 == 0 else 1
    vec_k = 8 if K % 8 == 0 and H.stride(0) % 8 == 0 and W.stride(0) % 8 == 0 else 1
    if n:
        pair_logits_ce_kernel[(2 * programs,)](
            H, W, c, Z if need else H, tok, pl.ia, pl.ib, pl.w, pl.w_stride, loss_rows, dc_part if need else loss_rows,
            s0, n, K // vec_k, V // vec, H.stride(0) // vec_k, W.stride(0) // vec_k, 2 * hoff // vec, hoff // vec, n,
            float(lam), float(gscale),
            0 if meet is None else int(meet), NEED_GRAD=need, BM=cfg["lce_BM"], BN=cfg["lce_BN"], BK=cfg["lce_BK"],
            EVEN_K=K % cfg["lce_BK"] == 0, VEC=vec, VEC_K=vec_k, UP=up,
            IEEE=H.dtype == torch.float32, MEET=meet is not None, num_warps=cfg["lce_warps"],
            num_stages=cfg["lce_stages"])
    return loss_rows[: 2 * n].sum(), dc_part[:programs] if need else None
