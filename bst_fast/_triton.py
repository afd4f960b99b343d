"""The "triton" backend: the pair head's loss and gradients in one fused Triton kernel (SPEC §3-§4).

Split of the work (the C++ backend uses the same one):

- torch, with autograd: the first layer, split (SPEC §3): A = f W1f^T + c1, B = b W1b^T, both
  (B, L, h1) float32. Autograd maps dA, dB back to df, db, dW1 and dc1.
- `_PairLoss` (an autograd.Function): its forward launches `_pair_kernel`, which computes the loss
  AND dA, dB and the gradients of every later layer (head.layers[1:]) in one pass over the pairs;
  its backward only multiplies the stored gradients by grad_output (no host synchronisation).

`_pair_kernel` is persistent: G programs, program g handles tiles g, g + G, g + 2G, ... A tile is
BP = BI * BJ pairs: in the all-pairs case an (i-block x j-block) square of one row's triangle
(only squares holding a valid pair are listed, so the empty part of the triangle is never
visited, as in causal flash attention; the kernel masks the rest), for explicit or subsampled
pairs a run of BP consecutive entries of the (row, i, j, weight) list.

A tile's hidden states (BP, HP) go through a small per-program scratch in global memory (it stays
in L2): the hidden width (512 in the paper) is too wide to keep a (BP, h) tile in registers and
K-block the next matmul from it, since Triton cannot slice a register tensor. The logits never
leave registers: the last layer runs over V in blocks of BV with an online logsumexp, and again
in the backward phase, which recomputes each block's logits instead of storing (BP, 2V).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._pairs import Pairs

_ACT = {"relu": 0, "leaky_relu": 1, "gelu": 2, "gelu_tanh": 3, "silu": 4}

# Launch shape. BI * BJ pairs a tile, BK-wide blocks of the hidden width, BV-wide blocks of the
# vocabulary. CUDA values are a first guess, not tuned (no GPU was available when written); the
# interpreter values keep tl.dot at its 16-wide minimum and still exercise every block loop.
CONFIG = {
    # for h=512 in bf16 on sm_90, ptxas gives 254 registers and no spills with these (BK=32
    # spills): one program per SM. To be tuned (autotune keyed on h, V, dtype) on a GPU.
    "cuda": dict(BI=8, BJ=16, BK=16, BV=64, num_warps=8, programs_per_sm=1),
    "cpu": dict(BI=4, BJ=4, BK=16, BV=16, num_warps=4, programs=2),
}


@triton.jit
def _act(z, ACT: tl.constexpr):
    # act(z) in float32; every activation has act(0) = 0, so zero-padded hidden units stay zero.
    if ACT == 0:
        return tl.maximum(z, 0.0)
    elif ACT == 1:
        return tl.where(z > 0, z, 0.01 * z)
    elif ACT == 2:
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 3:
        # tanh(u) = 1 - 2 / (1 + e^{2u}); the clamp keeps e^{2u} finite (tanh is 1 there to float32)
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 1.0 - 2.0 / (1.0 + tl.exp(tl.minimum(2.0 * u, 80.0)))
        return 0.5 * z * (1.0 + t)
    else:
        return z / (1.0 + tl.exp(tl.minimum(-z, 80.0)))


@triton.jit
def _act_grad(z, ACT: tl.constexpr):
    # d act / dz in float32 (relu'(0) = 0, as autograd has it).
    if ACT == 0:
        return tl.where(z > 0, 1.0, 0.0)
    elif ACT == 1:
        return tl.where(z > 0, 1.0, 0.01)
    elif ACT == 2:
        # 0.5 (1 + erf(z / sqrt 2)) + z * phi(z), phi the standard normal density
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == 3:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 1.0 - 2.0 / (1.0 + tl.exp(tl.minimum(2.0 * u, 80.0)))
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    else:
        s = 1.0 / (1.0 + tl.exp(tl.minimum(-z, 80.0)))
        return s * (1.0 + z * (1.0 - s))


@triton.jit
def _dot(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    # float32 accumulation; UP upcasts the operands (exactly) first, because the CPU interpreter's
    # bfloat16 dot is wrong (Triton 3.9). Compiled kernels never set it.
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _cast(x, DT: tl.constexpr, UP: tl.constexpr):
    # x (float32) as a dot operand of type DT. Under UP (interpreter, bfloat16) the scratch is
    # float32 and the bfloat16 rounding is done by hand, round-to-nearest-even as on the GPU: the
    # interpreter's own float32 -> bfloat16 cast truncates.
    if UP:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    return x.to(DT)


@triton.jit
def _logits(Hl, WL, cL, rows, rmask, P, K, HP: tl.constexpr, HL, BP: tl.constexpr, BK: tl.constexpr,
            BV: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    # (BP, BV) float32 logits of the last layer for the W_L rows `rows`: sum over K blocks of
    # h[:, kb] @ W_L[rows, kb]^T, plus the bias. h comes from the program's scratch Hl (BP, HP).
    acc = tl.zeros((BP, BV), dtype=tl.float32)
    for kb in range(0, HP, BK):
        k = kb + K
        h = tl.load(Hl + P[:, None] * HP + k[None, :])
        w = tl.load(WL + rows[:, None] * HL + k[None, :], mask=rmask[:, None] & (k[None, :] < HL), other=0.0)
        acc += _dot(h, tl.trans(w), PREC=PREC, UP=UP)
    return acc + tl.load(cL + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _pair_kernel(
    A, Bm, tok, lengths, pstart, tiles, n_tiles,   # (B, L, H1) f32 x2, (B, L) i64, (B,) i64 x2, (n_tiles, 3) i32
    prow, pi, pj, pw, n_pairs, scale,              # pair list (n,) i64 x3 + (n,) f32; scale (1,) f32
    Wh, ch, WL, cL,                                # hidden layers packed (NH-1, HP, HP), (NH-1, HP); last (2V, HL), (2V,)
    Z, Hs, dH,                                     # scratch: (G, max(NH-1, 1) | NH | min(NH, 2), BP, HP): f32, dtype, f32
    loss_part, dA, dB, dWh, dch, dWL, dcL,         # (G,) f32; gradients, f32, shaped as their inputs
    L, H1, HL, V, min_gap, max_gap, lam,
    NH: tl.constexpr, HP: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, ACT: tl.constexpr, MODE: tl.constexpr, NEED_GRAD: tl.constexpr, PREC: tl.constexpr,
    UP: tl.constexpr, DET: tl.constexpr,
):
    # Forward, per pair (i, j) of the tile (h_0 is not formed: the first layer is split):
    #   z_1 = A_i + B_j,  h_k = act(z_k),  z_{k+1} = W_k h_k + c_k  (k < NH),  z = W_L h_NH + c_L (2V)
    #   loss = w * [lam * (lse(z[:V]) - z[y_next]) + (1 - lam) * (lse(z[V:]) - z[V + y_prev])]
    # Backward (same tile, logits recomputed per V block):
    #   dz = w * lam_half * (softmax_half(z) - onehot(y_half))
    #   dW_L += dz^T h_NH, dc_L += sum dz, dh_NH = dz W_L
    #   dz_k = dh_k * act'(z_k), dW_{k-1} += dz_k^T h_{k-1}, dc_{k-1} += sum dz_k, dh_{k-1} = dz_k W_{k-1}
    #   dA_i += sum_j dz_1,  dB_j += sum_i dz_1
    # Sums over pairs land in global float32 buffers through atomics, whose order may vary between
    # runs on a GPU. DET (deterministic) runs one program (so tiles are summed in order; the
    # barrier at each tile start orders them across threads) and adds dA, dB one pair at a time:
    # bitwise reproducible, and slow. The loss is reduced per program, then in a fixed order.
    BP: tl.constexpr = BI * BJ
    g = tl.program_id(0)
    G = tl.num_programs(0)
    P = tl.arange(0, BP)
    K = tl.arange(0, BK)
    Vv = tl.arange(0, BV)
    # this program's scratch: z of hidden layers 2..NH (z_1 = A_i + B_j is cheaper to gather again),
    # h of layers 1..NH, and dh in min(NH, 2) ping-pong slots
    ZS: tl.constexpr = NH - 1 if NH > 1 else 1
    DS: tl.constexpr = 2 if NH > 1 else 1
    zs = Z + g.to(tl.int64) * (ZS * BP * HP) - BP * HP   # so that zs + l * BP * HP is layer l + 1's z
    hs = Hs + g.to(tl.int64) * (NH * BP * HP)
    ds = dH + g.to(tl.int64) * (DS * BP * HP)
    loss_acc = tl.zeros((BP,), dtype=tl.float32)
    for t in range(g, n_tiles, G):
        # ---- the tile's pairs: row, i, j, weight (0 for a padding slot)
        if MODE == 0:
            r0 = tl.load(tiles + 3 * t)
            i = tl.load(tiles + 3 * t + 1) + P // BJ
            j = tl.load(tiles + 3 * t + 2) + P % BJ
            row = r0 + 0 * P
            gap = j - i
            valid = (i >= tl.load(pstart + r0)) & (gap >= min_gap) & (gap <= max_gap) & (j <= tl.load(lengths + r0) - 1)
            w = tl.where(valid, tl.load(scale), 0.0)
        else:
            q = t * BP + P
            valid = q < n_pairs
            row = tl.load(prow + q, mask=valid, other=0)
            i = tl.load(pi + q, mask=valid, other=0)
            j = tl.load(pj + q, mask=valid, other=0)
            w = tl.load(pw + q, mask=valid, other=0.0)
        row = row.to(tl.int64)
        i = tl.where(valid, i, 0).to(tl.int64)
        j = tl.where(valid, j, 0).to(tl.int64)
        y_next = tl.load(tok + row * L + i + 1, mask=valid, other=0)
        y_prev = tl.load(tok + row * L + j - 1, mask=valid, other=0)
        ai = (row * L + i) * H1    # row offsets of A_i and B_j
        bj = (row * L + j) * H1
        tl.debug_barrier()         # the previous tile's readers of the scratch are done

        # ---- layer 1 from the split first layer: z_1 = A_i + B_j (padded units: 0)
        for kb in range(0, HP, BK):
            k = kb + K
            m2 = valid[:, None] & (k[None, :] < H1)
            z = tl.load(A + ai[:, None] + k[None, :], mask=m2, other=0.0) + \
                tl.load(Bm + bj[:, None] + k[None, :], mask=m2, other=0.0)
            tl.store(hs + P[:, None] * HP + k[None, :], _cast(_act(z, ACT), Hs.dtype.element_ty, UP))
        tl.debug_barrier()

        # ---- further hidden layers, K-blocked through the scratch
        for l in range(1, NH):
            h_in = hs + (l - 1) * BP * HP
            w_l = Wh + (l - 1) * HP * HP
            for nb in range(0, HP, BK):
                n = nb + K
                acc = tl.zeros((BP, BK), dtype=tl.float32)
                for kb in range(0, HP, BK):
                    k = kb + K
                    h = tl.load(h_in + P[:, None] * HP + k[None, :])
                    wt = tl.load(w_l + n[:, None] * HP + k[None, :])
                    acc += _dot(h, tl.trans(wt), PREC=PREC, UP=UP)
                z = acc + tl.load(ch + (l - 1) * HP + n)[None, :]
                tl.store(zs + l * BP * HP + P[:, None] * HP + n[None, :], z)
                tl.store(hs + l * BP * HP + P[:, None] * HP + n[None, :], _cast(_act(z, ACT), Hs.dtype.element_ty, UP))
            tl.debug_barrier()

        # ---- last layer: online logsumexp over V blocks, Next half then Prev half
        h_last = hs + (NH - 1) * BP * HP
        lse_n = tl.zeros((BP,), dtype=tl.float32)
        lse_p = tl.zeros((BP,), dtype=tl.float32)
        for half in tl.static_range(2):
            y = y_next if half == 0 else y_prev
            mx = tl.full((BP,), -1e30, dtype=tl.float32)
            se = tl.zeros((BP,), dtype=tl.float32)
            zy = tl.zeros((BP,), dtype=tl.float32)
            for vb in range(0, V, BV):
                col = vb + Vv
                cm = col < V
                zt = _logits(h_last, WL, cL, half * V + col, cm, P, K, HP, HL, BP, BK, BV, PREC, UP)
                zt = tl.where(cm[None, :], zt, -1e30)
                m_new = tl.maximum(mx, tl.max(zt, axis=1))
                se = se * tl.exp(mx - m_new) + tl.sum(tl.exp(zt - m_new[:, None]), axis=1)
                mx = m_new
                zy += tl.sum(tl.where(col[None, :] == y[:, None], zt, 0.0), axis=1)
            lse = mx + tl.log(se)
            if half == 0:
                lse_n = lse
                loss_acc += w * lam * (lse - zy)
            else:
                lse_p = lse
                loss_acc += w * (1.0 - lam) * (lse - zy)

        if NEED_GRAD:
            # The backward runs in units of wmax, the tile's largest pair weight: with
            # reduction="mean" a weight is 1/|P|, and w * (softmax - onehot) would underflow as a
            # float16 dot operand. dz, dh and the dH scratch hold values / wmax; every atomic_add
            # multiplies wmax back in.
            wmax = tl.maximum(tl.max(w, axis=0), 1e-30)
            wn = w / wmax
            # ---- dh_NH = sum over V blocks of dz W_L, accumulated in scratch slot 0
            for kb in range(0, HP, BK):
                tl.store(ds + P[:, None] * HP + (kb + K)[None, :], tl.zeros((BP, BK), dtype=tl.float32))
            tl.debug_barrier()
            for half in tl.static_range(2):
                y = y_next if half == 0 else y_prev
                lse = lse_n if half == 0 else lse_p
                cw = wn * lam if half == 0 else wn * (1.0 - lam)
                for vb in range(0, V, BV):
                    col = vb + Vv
                    cm = col < V
                    rows = half * V + col
                    zt = _logits(h_last, WL, cL, rows, cm, P, K, HP, HL, BP, BK, BV, PREC, UP)
                    pr = tl.exp(zt - lse[:, None]) - tl.where(col[None, :] == y[:, None], 1.0, 0.0)
                    dz = tl.where(cm[None, :], pr * cw[:, None], 0.0)  # (BP, BV)
                    tl.atomic_add(dcL + rows, tl.sum(dz, axis=0) * wmax, mask=cm)
                    dzc = _cast(dz, Hs.dtype.element_ty, UP)
                    for kb in range(0, HP, BK):
                        k = kb + K
                        km = cm[:, None] & (k[None, :] < HL)
                        h = tl.load(h_last + P[:, None] * HP + k[None, :])
                        tl.atomic_add(dWL + rows[:, None] * HL + k[None, :],
                                      _dot(tl.trans(dzc), h, PREC=PREC, UP=UP) * wmax, mask=km)
                        wt = tl.load(WL + rows[:, None] * HL + k[None, :], mask=km, other=0.0)
                        dptr = ds + P[:, None] * HP + k[None, :]
                        tl.store(dptr, tl.load(dptr) + _dot(dzc, wt, PREC=PREC, UP=UP))
                    # the next V block reads dH back, possibly in another thread layout
                    tl.debug_barrier()

            # ---- back through the hidden layers; dh ping-pongs between scratch slots 0 and 1
            for ll in range(0, NH - 1):
                l = NH - 1 - ll
                cur = ds + ((NH - 1 - l) % 2) * BP * HP
                nxt = ds + ((NH - l) % 2) * BP * HP
                for nb in range(0, HP, BK):   # dz_l = dh_l * act'(z_l), in place
                    n = nb + K
                    off = P[:, None] * HP + n[None, :]
                    dz = tl.load(cur + off) * _act_grad(tl.load(zs + l * BP * HP + off), ACT)
                    tl.store(cur + off, dz)
                    tl.atomic_add(dch + (l - 1) * HP + n, tl.sum(dz, axis=0) * wmax)
                tl.debug_barrier()
                w_l = Wh + (l - 1) * HP * HP
                for kb in range(0, HP, BK):
                    k = kb + K
                    h = tl.load(hs + (l - 1) * BP * HP + P[:, None] * HP + k[None, :])
                    acc = tl.zeros((BP, BK), dtype=tl.float32)
                    for nb in range(0, HP, BK):
                        n = nb + K
                        dzc = _cast(tl.load(cur + P[:, None] * HP + n[None, :]), Hs.dtype.element_ty, UP)
                        tl.atomic_add(dWh + (l - 1) * HP * HP + n[:, None] * HP + k[None, :],
                                      _dot(tl.trans(dzc), h, PREC=PREC, UP=UP) * wmax)
                        acc += _dot(dzc, tl.load(w_l + n[:, None] * HP + k[None, :]), PREC=PREC, UP=UP)
                    tl.store(nxt + P[:, None] * HP + k[None, :], acc)
                tl.debug_barrier()

            # ---- dz_1 = dh_1 * act'(z_1) -> dA_i (sum over j), dB_j (sum over i)
            cur = ds + ((NH - 1) % 2) * BP * HP
            for kb in range(0, HP, BK):
                k = kb + K
                off = P[:, None] * HP + k[None, :]
                m2 = valid[:, None] & (k[None, :] < H1)
                z = tl.load(A + ai[:, None] + k[None, :], mask=m2, other=0.0) + \
                    tl.load(Bm + bj[:, None] + k[None, :], mask=m2, other=0.0)
                dz = tl.load(cur + off) * _act_grad(z, ACT) * wmax
                if DET:
                    # one pair at a time, so that no atomic_add holds an address twice (pairs of
                    # a tile share i's and j's) and every sum runs in pair order
                    for pq in range(0, BP):
                        sel = P == pq
                        dzq = tl.sum(tl.where(sel[:, None], dz, 0.0), axis=0)  # (BK,)
                        kq = k < H1 * tl.sum(tl.where(sel & valid, 1, 0), axis=0)  # none for padding
                        tl.atomic_add(dA + tl.sum(tl.where(sel, ai, 0), axis=0) + k, dzq, mask=kq)
                        tl.atomic_add(dB + tl.sum(tl.where(sel, bj, 0), axis=0) + k, dzq, mask=kq)
                else:
                    tl.atomic_add(dA + ai[:, None] + k[None, :], dz, mask=m2)
                    tl.atomic_add(dB + bj[:, None] + k[None, :], dz, mask=m2)
    tl.store(loss_part + g, tl.sum(loss_acc, axis=0))


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _tiles(p: Pairs, L: int, BI: int, BJ: int) -> torch.Tensor:
    """(n_tiles, 3) int32 (row, i0, j0): the i-block x j-block squares holding at least one valid pair.

    Over the i's of the block that can start a pair, i in [i_lo, i_hi], the valid j's form the one
    interval [i_lo + min_gap, i_hi + max_gap] (consecutive i's give overlapping intervals), cut at
    len - 1; the square holds a pair exactly when that meets [j0, j0 + BJ - 1].
    """
    dev = p.lengths.device
    i0 = torch.arange(0, L, BI, device=dev)[None, :, None]
    j0 = torch.arange(0, L, BJ, device=dev)[None, None, :]
    n, s = p.lengths[:, None, None], p.prefix_start[:, None, None]
    i_lo = torch.maximum(i0, s)
    i_hi = torch.minimum(i0 + BI - 1, n - 1 - p.min_gap)
    j_lo = torch.maximum(j0, i_lo + p.min_gap)
    j_hi = torch.minimum(torch.minimum(j0 + BJ - 1, i_hi + p.max_gap), n - 1)
    r, a, c = ((i_lo <= i_hi) & (j_lo <= j_hi)).nonzero(as_tuple=True)
    return torch.stack([r, a * BI, c * BJ], 1).to(torch.int32).contiguous()


class _PairLoss(torch.autograd.Function):
    """loss(A, B, later layers); the forward also computes every gradient, the backward scales them."""

    @staticmethod
    def forward(ctx, A, Bm, tokens, p, lam, activation, dtype, deterministic, need, *params):
        dev = A.device
        Bn, L, H1 = A.shape
        weights, biases = params[0::2], params[1::2]
        NH = len(weights)  # hidden layers = n_layers - 1; weights[-1] is the last layer
        widths = [H1] + [w.shape[0] for w in weights[:-1]]
        HL, V = widths[-1], weights[-1].shape[0] // 2
        cfg = CONFIG["cuda" if dev.type == "cuda" else "cpu"]
        BI, BJ, BK, BV = cfg["BI"], cfg["BJ"], cfg["BK"], cfg["BV"]
        HP = max(16, _next_pow2(max(widths)))
        BK, BV = min(BK, HP), min(BV, max(16, _next_pow2(V)))
        BP = BI * BJ

        # hidden-to-hidden layers zero-padded to (HP, HP) so one loop serves every width
        Wh = torch.zeros(max(NH - 1, 1), HP, HP, dtype=dtype, device=dev)
        ch = torch.zeros(max(NH - 1, 1), HP, dtype=torch.float32, device=dev)
        for l, (w, c) in enumerate(zip(weights[:-1], biases[:-1])):
            Wh[l, : w.shape[0], : w.shape[1]] = w.detach()
            ch[l, : c.shape[0]] = c.detach().float()
        WL, cL = weights[-1].detach().to(dtype).contiguous(), biases[-1].detach().contiguous()

        if p.row is None:
            tiles = _tiles(p, L, BI, BJ)
            n_tiles = tiles.shape[0]
            prow = pi = pj = torch.zeros(1, dtype=torch.int64, device=dev)
            pw = torch.zeros(1, dtype=torch.float32, device=dev)
            n_pairs, mode = 0, 0
        else:
            tiles = torch.zeros(3, dtype=torch.int32, device=dev)
            prow, pi, pj = (x.contiguous() for x in (p.row, p.i, p.j))
            pw = p.weight.float().contiguous()
            n_pairs, mode = prow.numel(), 1
            n_tiles = triton.cdiv(n_pairs, BP)
        scale = p.scale.float().reshape(1)
        if deterministic:
            G = 1
        elif dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            G = max(1, min(n_tiles, sms * cfg["programs_per_sm"]))
        else:
            G = max(1, min(n_tiles, cfg["programs"]))

        f32 = dict(dtype=torch.float32, device=dev)
        Z = torch.empty(G, NH - 1, BP, HP, **f32) if NH > 1 else torch.empty(1, **f32)  # unread if NH = 1
        up = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
        Hs = torch.empty(G, NH, BP, HP, dtype=torch.float32 if up else dtype, device=dev)
        dH = torch.empty(G, min(NH, 2), BP, HP, **f32) if need else Z[:1]
        loss_part = torch.empty(G, **f32)
        g_shape = lambda *s: torch.zeros(*s, **f32) if need else torch.zeros(1, **f32)
        dA, dB = g_shape(Bn, L, H1), g_shape(Bn, L, H1)
        dWh, dch = g_shape(*Wh.shape), g_shape(*ch.shape)
        dWL, dcL = g_shape(*WL.shape), g_shape(*cL.shape)
        prec = "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"
        if n_tiles:
            _pair_kernel[(G,)](
                A.contiguous(), Bm.contiguous(), tokens.contiguous(), p.lengths, p.prefix_start, tiles, n_tiles,
                prow, pi, pj, pw, n_pairs, scale,
                Wh, ch, WL, cL, Z, Hs, dH,
                loss_part, dA, dB, dWh, dch, dWL, dcL,
                L, H1, HL, V, p.min_gap, p.max_gap, float(lam),
                NH=NH, HP=HP, BI=BI, BJ=BJ, BK=BK, BV=BV, ACT=_ACT[activation], MODE=mode,
                NEED_GRAD=need, PREC=prec, UP=up, DET=deterministic, num_warps=cfg["num_warps"],
            )
        else:
            loss_part.zero_()
        grads = []
        if need:
            for l, (w, c) in enumerate(zip(weights[:-1], biases[:-1])):
                grads += [dWh[l, : w.shape[0], : w.shape[1]], dch[l, : c.shape[0]]]
            grads += [dWL, dcL]
            ctx.save_for_backward(dA, dB, *grads)
        ctx.need = need
        ctx.dtypes = [q.dtype for q in params]
        return loss_part.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        if not ctx.need:
            return (None,) * (9 + len(ctx.dtypes))
        dA, dB, *gp = ctx.saved_tensors
        gA = grad_loss * dA if ctx.needs_input_grad[0] else None
        gB = grad_loss * dB if ctx.needs_input_grad[1] else None
        out = [(grad_loss * g).to(dt) if n else None for g, dt, n in zip(gp, ctx.dtypes, ctx.needs_input_grad[9:])]
        return (gA, gB, None, None, None, None, None, None, None, *out)


def pair_loss(f, b, tokens, head, p: Pairs, next_weight: float, deterministic: bool = False,
              compute_dtype=None):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), fused in Triton.

    f, b: (B, L, m) float32/float16/bfloat16; tokens: (B, L) int64; head: a TextHead in f's dtype;
    p: the checked pair set; deterministic: bitwise-reproducible gradients (one program: slow);
    compute_dtype: the dot operands' type (default f's dtype; bf16 under autocast for an fp32 model).
    Returns a 0-dim float32 loss.
    """
    A, Bm = head.first_layer_states(f, b, p.lengths)  # (B, L, h1) each
    params = [q for layer in head.layers[1:] for q in (layer.weight, layer.bias)]
    # Decided here, not in forward: inside forward grad mode is off and needs_input_grad ignores it.
    need = torch.is_grad_enabled() and any(t.requires_grad for t in (A, Bm, *params))
    dtype = compute_dtype or f.dtype
    return _PairLoss.apply(A, Bm, tokens, p, next_weight, head.activation, dtype, bool(deterministic),
                           need, *params)
