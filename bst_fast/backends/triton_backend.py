"""The "triton" GPU backend: all pairs in chunks of tens of thousands, the head's matrix products on
the tensor cores (cuBLAS through torch), the per-pair work in Triton kernels (docs/contract.md §3-§4).

Per chunk of n pairs (slots [s0, s0 + n) of the sorted pair list, see `PairList`), with es the
bytes of the compute dtype, h the hidden widths (h1 first, hL last) and V the vocabulary:

    H1 = act(A_ia + B_ib)                 pair_hidden_kernel         write n*h1*es
    Z_k = H_{k-1} W_k^T + c_k, H_k = act  cuBLAS + torch            2*n*h^2 FLOPs per hidden layer
    Z = H_L W_L^T + c_L   (n, 2V)         cuBLAS                    2*n*hL*2V FLOPs
    loss, Z <- dz in place                pair_cross_entropy_kernel  read + write n*2V*es
    dc_L += colsum(dz)                    torch (float32 sum)        read n*2V*es (none under
                                                                     bias_in_gemm or ce_bias_sums)
    dW_L += dz^T H_L   (float32 output)   cuBLAS                    2*n*hL*2V FLOPs
    dH_L = dz W_L                         cuBLAS                    2*n*hL*2V FLOPs
    hidden layers back (dZ_k, dW_k, dc_k, dH_{k-1}), as above
    dA, dB += segment sums of dH1*act'(z1)  prefix/suffix_grad_kernel  read 2*n*h1*es + L2 gathers

So 6*n*hL*2V FLOPs in three large GEMMs (M = n, the chunk), about 4*n*2V*es bytes of logits traffic,
no atomics anywhere (every sum has one owner and a fixed order: bitwise reproducible), and memory
bounded by one chunk's working set (CHUNK_BYTES), never by the number of pairs times V.

The first layer is split here, a window of rows at a time (_FirstLayer): A, B, dA, dB in float32
for the rows the chunks in flight read, 16*L*h1 bytes a row, so no (B, L, h1) table of the whole
batch is held (the kernels read the window at position - pos0). Its products are the split layer's
own, 2*L*m*h1 FLOPs a row and side forward and twice that backward, once per row (a row carried
from one window to the next is not recomputed); each move of the window is about twenty launches.

Levers, runtime switches that bench/levers.py times against the defaults (all off: none paid on the
H100, docs/backends.md "Levers"):
- bias_in_gemm: every layer's input H_k sits in a buffer with a ones column, so the dW GEMM over
  [H_k | 1 | 0..] (8 more columns at most) also yields dc_k: no column sum, saving a read of
  n*2V*es per chunk for the last layer (n*h*es for a hidden one) for 8/hL more dW FLOPs; a hidden
  layer's H is copied once into its buffer (n*h*es written and read).
- ce_bias_sums: the cross-entropy (a half of at most its block, V <= 4096 on a GPU) also writes
  the column sums of dz, one partial row a program of ce_sum_rows rows: dc_L without the column
  sum, and no 8 extra dW columns (bias_in_gemm's, which at h = 512 or 768 cost a partly filled
  GEMM tile); the hidden layers keep bias_in_gemm's fold where it is on too.
- fused_ce: the logits GEMM, the cross-entropy and dc_L's column sums as one kernel
  (kernels/logits_cross_entropy.py): the logits go from the tensor cores' accumulators through an
  online logsumexp, are stored once and overwritten by dz while still in L2, with dc_L's partial
  sums from the same registers: the cross-entropy kernel's read and write and the column sum's
  read of n*2V*es each go, for a Triton GEMM in place of cuBLAS's (0.55-0.89x it at plain shapes
  on the H100, bench/gemm_shapes.py).
- relu_in_gemm: a relu hidden layer's GEMM applies the activation in cuBLASLt's epilogue
  (torch._addmm_activation): no relu pass (a read and a write of n*h*es), no Z kept.
- hidden_sums: a hidden layer's activation gradient with its bias gradient's partial column sums,
  one kernel (kernels/hidden_grad.py): no column sum re-reading dZ (n*h*es).
- vocab_pad: each half of W_L padded with zero rows to Vp, a tile multiple (V = 1000 -> 1024):
  2Vp/2V more logit FLOPs and bytes, for GEMM tiles that divide N = 2Vp. The padded logits are
  exact zeros the cross-entropy skips; their gradient rows are dropped.

The loss is the graph's last node, so the forward computes every gradient and the backward only
scales by grad_output (as the cpp backend does): no logits are recomputed. The work is the op
bst_fast::triton_pair_loss, with the C++ op's schema and rules (pair_loss_op), so that opcheck and
torch.compile(fullgraph=True) see it as one opaque node. That schema has no place for the runtime
switches: the op takes its chunk from the switches in force (runtime.SWITCHES), the ones a
LossOptions gets by default.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from .. import _pairs
from .._pairs import PairList, Pairs, pair_list
from . import pair_loss_op, runtime
from ..head import activation, activation_grad, mm_f32, split_operands, split_part, split_part_grads
from ..kernels.activation import ACT, interpreted_bf16
from ..kernels.cross_entropy import ce_sum_programs, pair_cross_entropy_
from ..kernels.hidden_grad import act_grad_sums_, hidden_grad_programs
from ..kernels.logits_cross_entropy import logits_ce_programs, pair_logits_cross_entropy_
from ..kernels.pair_hidden import pair_hidden, segment_grads
from .launch import chunk_config, hidden_grad_config
from .pair_loss_op import fused_problem
from .runtime import LossOptions, on_device

NAME = "triton"
FUSED = True
HOST_PAIRS = True  # pair_list builds a host pair set's list on the host, no device sync


def _ones_column(rows: int, width: int, dtype, device):
    """An (rows, width + e) buffer whose column `width` is ones and the rest past it zeros, e >= 1
    taking a row to a multiple of 8 elements (16-bit rows stay 16-byte aligned for the tensor cores):
    a layer's input H goes in its first `width` columns, and a GEMM over it all yields [dZ^T H | dZ^T 1]."""
    buf = torch.zeros(rows, (width + 8) // 8 * 8, dtype=dtype, device=device)
    buf[:, width] = 1
    return buf


def _padded_vocabulary(weights, biases, V: int, Vp: int):
    """The last layer with each half's V rows followed by Vp - V zero rows (weights and biases): its
    padded logits are exact zeros, which the cross-entropy leaves alone, so they add nothing to the
    gradient of the layer's input, and their own gradient rows are dropped (_unpadded)."""
    W, c = weights[-1], biases[-1]
    Wp, cp = W.new_zeros(2 * Vp, W.shape[1]), c.new_zeros(2 * Vp)
    for half in range(2):
        Wp[half * Vp : half * Vp + V] = W[half * V : (half + 1) * V]
        cp[half * Vp : half * Vp + V] = c[half * V : (half + 1) * V]
    return weights[:-1] + [Wp], biases[:-1] + [cp]


def _unpadded(t, V: int, Vp: int):
    """The rows of a padded last layer's gradient that belong to the real vocabulary."""
    return torch.cat([t[:V], t[Vp : Vp + V]])


class _FirstLayer:
    """The split first layer (docs/contract.md §3) over a window of rows: A = f W_f^T + c1 and
    B = b W_b^T in float32 for the rows [r0, r1) that the chunks in flight read, and (need) their
    gradient sums dA, dB. A chunk's pairs lie in rows [ra, rb] (the list is sorted by row, and a
    pair's two positions share its row), so when a chunk reaches past the window the rows before
    ra are complete: their sums are mapped at once to df, db, dW1, dc1 (head.split_part_grads, the
    products of the split layer's own backward) and dropped, the rows in flight carried over. The
    tables then hold at most about `rows` rows (or one chunk's, if more) instead of the batch's:
    at B = 256, T = 64, h1 = 768 the whole batch's four were 200 MB, 40% of the loss's peak.

    f, b: (B, L, m) as given; W1 (h1, 2m), c1 (h1,) the layer's own (any float dtype); lengths:
    (B,) on the device (positions at or past them are zeroed, as head.split_linear zeroes them);
    operands: head.split_operands' (forward, backward) dtypes of the matrix operands."""

    def __init__(self, f, b, W1, c1, lengths, operands, need: bool, rows: int, scale: float):
        m = f.shape[-1]
        self.f, self.b, self.lengths, self.need, self.rows = f, b, lengths, need, max(1, rows)
        self.wf, self.wb, self.c1 = W1[:, :m], W1[:, m:], c1
        self.forward, self.backward = operands
        self.r0 = self.r1 = 0
        self.A = self.B = self.dA = self.dB = None
        self.scale = scale  # the pair list's wscale: the sums are in its units
        if need:
            # contiguous, as the op's fake says (zeros_like would keep a permuted f's strides)
            self.df, self.db = (torch.zeros(x.shape, dtype=pair_loss_op.side_grad_dtype(x.dtype), device=x.device)
                                for x in (f, b))
            self.dW, self.dc = torch.zeros(W1.shape, dtype=torch.float32, device=f.device), torch.zeros(
                c1.shape, dtype=torch.float32, device=f.device)

    def cover(self, ra: int, rb: int):
        """Make the window hold rows ra..rb (ra never decreases): map the rows before ra, keep the
        window's rows from ra on, add the rows after it."""
        if rb < self.r1:
            return
        new1 = min(self.f.shape[0], max(rb + 1, ra + self.rows))
        self.flush(min(ra, self.r1))
        first = max(ra, self.r1)  # the rows the window does not hold yet
        with torch.autocast(self.f.device.type, enabled=False):
            fresh = [split_part(x[first:new1], self.lengths[first:new1], w, c, self.forward)
                     for x, w, c in ((self.f, self.wf, self.c1), (self.b, self.wb, None))]
        if first == ra:  # nothing in flight to carry
            self.A, self.B = fresh
            self.dA, self.dB = (torch.zeros_like(t) for t in fresh) if self.need else (None, None)
        else:
            kept = lambda old, new: torch.cat([old[ra - self.r0 :], new])
            self.A, self.B = kept(self.A, fresh[0]), kept(self.B, fresh[1])
            if self.need:
                self.dA, self.dB = (kept(d, torch.zeros_like(t)) for d, t in ((self.dA, fresh[0]), (self.dB, fresh[1])))
        self.r0, self.r1 = ra, new1

    def flush(self, upto: int):
        """Map the sums of rows r0 .. upto - 1 (complete) to the gradients of f, b, W1 and c1."""
        if not self.need or upto <= self.r0:
            return
        rows, done = slice(self.r0, upto), slice(0, upto - self.r0)
        dA, dB = self.dA[done].mul_(self.scale), self.dB[done].mul_(self.scale)
        with torch.autocast(self.f.device.type, enabled=False):
            for x, d, w, dx, cols in ((self.f, dA, self.wf, self.df, slice(0, self.wf.shape[1])),
                                      (self.b, dB, self.wb, self.db, slice(self.wf.shape[1], None))):
                g, gw = split_part_grads(x[rows], d, w, self.lengths[rows], True, True, self.backward, dx.dtype)
                dx[rows] = g
                self.dW[:, cols] += gw
            self.dc += dA.sum((0, 1))

    def gradients(self):
        """df, db, dW1, dc1, once every chunk is done."""
        self.flush(self.r1)
        return self.df, self.db, self.dW, self.dc


def _loss_by_chunks(f, b, lengths, tokens, pl: PairList, weights, biases, act_name: str, lam: float, need: bool,
                    dtype, cfg, V: int, window_rows: int):
    """Loss and (need) the gradients of f, b (side_grad_dtype) and of every layer (float32), chunk by chunk.

    f, b: (B, L, m); lengths (B,) on f's device; tokens (B, L) int64; weights/biases: the first
    layer's own (split here, _FirstLayer, window_rows rows at a time), then the later layers in the
    compute dtype `dtype` (the last one (2V, hL), or (2Vp, hL) padded by _padded_vocabulary); cfg:
    chunk_config's launch shapes, which also cut `pl`. Returns (loss, df, db, dW list, dc list)."""
    dev = f.device
    L = f.shape[1]
    first = _FirstLayer(f, b, weights[0], biases[0], lengths, split_operands(dtype, f.dtype), need, window_rows,
                        pl.wscale)
    weights, biases = weights[1:], biases[1:]
    h1 = weights[0].shape[1]
    up = interpreted_bf16(dtype)
    act_id = ACT[act_name]
    tok = tokens.contiguous().reshape(-1)  # the kernels read labels at flat offsets ia + 1, ib - 1
    f32 = dict(dtype=torch.float32, device=dev)
    dW = [torch.zeros(w.shape, **f32) for w in weights] if need else []
    dc = [torch.zeros(c.shape, **f32) for c in biases] if need else []
    loss = torch.zeros((), **f32)
    nmax = max((c.n for c in pl.chunks), default=1)  # the longest chunk's pairs
    loss_rows = torch.empty(nmax, **f32)
    # Under bias_in_gemm each layer's input H_k sits in the first columns of a buffer with a ones
    # column (_ones_column; one for all chunks, filled once): dW_k's GEMM over the whole buffer then
    # yields dc_k, the column sum of dZ_k, as its extra output column, and no separate column sum
    # re-reads dZ_k (for the last layer, the (n, 2V) logits gradient).
    fold = runtime.SWITCHES.bias_in_gemm
    ones = [_ones_column(nmax, w.shape[1], dtype, dev) for w in weights] if fold and need else None
    # Under fused_ce the last layer's GEMM, the cross-entropy and dc_L's partial sums are one kernel
    # (its loss rows: a half each). Else, under ce_bias_sums, the cross-entropy also writes dc_L as
    # partial column sums of cfg's ce_sum_rows rows each, where a half fits one block.
    fused = runtime.SWITCHES.fused_ce
    sums_ce = need and not fused and runtime.SWITCHES.ce_bias_sums and V <= cfg["BV"]
    width_L = weights[-1].shape[0]  # 2V, or 2Vp padded: the partial rows are laid out as the logits
    dc_part = torch.zeros(ce_sum_programs(nmax, cfg), width_L, **f32) if sums_ce else None
    if fused:
        loss_rows = torch.empty(2 * nmax, **f32)
        dc_part = torch.empty(logits_ce_programs(nmax, cfg), width_L, **f32) if need else None
    # Under relu_in_gemm a relu hidden layer's GEMM applies the activation (cuBLASLt's epilogue): its
    # gradient reads the output H in z's place (relu'(z) = [h > 0]). Under hidden_sums a hidden
    # layer's activation gradient also writes its bias gradient's partial column sums.
    relu_gemm = runtime.SWITCHES.relu_in_gemm and act_name == "relu"
    hidden_cfg = [hidden_grad_config(dev.type, w.shape[0]) for w in weights[:-1]]
    hidden_parts = ([torch.empty(hidden_grad_programs(nmax, g), w.shape[0], **f32)
                     for g, w in zip(hidden_cfg, weights[:-1])] if need and runtime.SWITCHES.hidden_sums else None)
    for chunk in pl.chunks:
        s0, n = chunk.s0, chunk.n
        # float16: the chunk's per-pair gradients scaled by a power of two that centres its pair
        # weights on 1 (rows of unequal weight, row_mean's: the light ones' would fall to subnormals
        # in wscale's units), every float32 sum of them multiplied back by `back`
        gs = chunk.half_scale(summed=False) if dtype == torch.float16 else 1.0
        back = 1.0 / gs
        first.cover(chunk.pre_lo // L, (chunk.pre_hi - 1) // L)  # the rows of the chunk's pairs
        pos0 = first.r0 * L  # the window's first flat position
        H = ones[0][:n, :h1] if ones else torch.empty(n, h1, dtype=dtype, device=dev)
        pair_hidden(first.A, first.B, pl, s0, n, H, act_id, cfg, up, pos0)
        Hs, Zs = [H], []
        for k, (w, c) in enumerate(zip(weights[:-1], biases[:-1])):
            if relu_gemm:
                H = torch._addmm_activation(c, Hs[-1], w.t())
                Zs.append(H)
            else:
                Zs.append(torch.addmm(c, Hs[-1], w.t()))
                H = activation(act_name, Zs[-1])
            if ones:  # one more pass over a hidden layer's H, into its buffer
                H = ones[k + 1][:n, : H.shape[1]].copy_(H)
            Hs.append(H)
        if fused:  # the gradient of the logits, which are never stored without need
            Z = torch.empty(n, width_L, dtype=dtype, device=dev) if need else None
            chunk_loss, last_dc = pair_logits_cross_entropy_(Hs[-1], weights[-1], biases[-1], Z, tok, pl, s0, lam, gs, need,
                                                             loss_rows, dc_part, cfg, up, V)
        else:
            Z = torch.addmm(biases[-1], Hs[-1], weights[-1].t())  # (n, 2V) logits, then their gradient
            chunk_loss, last_dc = pair_cross_entropy_(Z, tok, pl, s0, lam, gs, need, loss_rows, cfg, up, V, dc_part)
        loss += chunk_loss
        if not need:
            del H, Z, Zs, Hs
            continue
        # Each tensor goes once the backward is past it (the logits' gradient Z once dH_L is made,
        # a layer's input once its dW is summed): the chunk holds at most the forward's tensors and one
        # layer's gradient, es * (2V + sum h + sum h[1:] + max h) bytes a pair, within chunk_config's budget.
        dH = Z
        del H, Z
        for k in range(len(weights) - 1, -1, -1):
            made = last_dc if k == len(weights) - 1 else None  # the cross-entropy's partial sums of dc_L
            if k < len(weights) - 1:  # dZ of hidden layer k + 2 (and its bias gradient's partial sums)
                if hidden_parts:
                    made = act_grad_sums_(dH, Zs[k], act_id, hidden_parts[k], hidden_cfg[k], up)
                else:
                    dH = activation_grad(act_name, dH, Zs[k])
            if ones and made is None:
                width = Hs[k].shape[1]
                g = mm_f32(dH.t(), ones[k][:n])
                dW[k].add_(g[:, :width], alpha=back)
                dc[k].add_(g[:, width], alpha=back)
            else:
                dc[k].add_(dH.sum(0, dtype=torch.float32) if made is None else made.sum(0), alpha=back)
                dW[k].add_(mm_f32(dH.t(), Hs[k]), alpha=back)
            Hs[k] = None  # the layer's input, and below its pre-activation, are spent
            if k < len(Zs):
                Zs[k] = None
            dH = dH @ weights[k]
        del Zs, Hs
        segment_grads(dH, first.A, first.B, pl, chunk, first.dA, first.dB, act_id, back, cfg, pos0=pos0)
        del dH
    # every pair weight was divided by wscale (so that fp16 gradients do not underflow): multiply
    # back (the first layer's sums as their rows are mapped)
    s = pl.wscale
    if not need:
        return loss * s, None, None, [], []
    df, db, dW1, dc1 = first.gradients()
    for g in dW + dc:
        g.mul_(s)
    return loss * s, df, db, [dW1] + dW, [dc1] + dc


@torch.library.custom_op("bst_fast::triton_pair_loss", mutates_args=())
def triton_pair_loss(f: torch.Tensor, b: torch.Tensor, weights: List[torch.Tensor], biases: List[torch.Tensor],
                     tokens: torch.Tensor, lengths: torch.Tensor, prefix_start: torch.Tensor, min_gap: int,
                     max_gap: int, row: Optional[torch.Tensor], i: Optional[torch.Tensor],
                     j: Optional[torch.Tensor], weight: torch.Tensor, next_weight: float, activation: str,
                     need_grad: bool, meet_token: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                                List[torch.Tensor], List[torch.Tensor]]:
    """The GPU pair-loss op: bst_fast::pair_loss's schema and rules (pair_loss_op), but for the whole
    head: f, b (B, L, m) in place of the split first layer's A, B, and weights[0], biases[0] that
    layer's own (h1, 2m) and (h1,), which the op splits itself a window of rows at a time
    (_FirstLayer); it returns the gradients of f and b in their dtypes (float32 for float16). The later layers share one
    dtype, the matrix operands' compute dtype."""
    if activation not in ACT:
        raise ValueError(f"activation must be one of {tuple(ACT)}, got {activation!r}")
    if len(weights) != len(biases) or len(weights) < 2 or weights[-1].dim() != 2 or weights[-1].shape[0] % 2:
        raise ValueError(f"weights and biases must hold one entry per layer, the first layer's and at least one "
                         f"more, the last with 2V outputs, got {len(weights)} weights, {len(biases)} biases")
    dtype = weights[-1].dtype
    if any(t.dtype != dtype for t in (*weights[1:], *biases[1:])):
        raise ValueError(f"the layers after the first must share one dtype, got "
                         f"{[t.dtype for t in (*weights[1:], *biases[1:])]}")
    _pairs.check_f(f)
    if f.dtype == torch.float64:
        raise ValueError("f must be float32, float16 or bfloat16 (float64 runs through 'torch' or 'reference')")
    Bn, L, m = f.shape
    widths = [2 * m] + [w.shape[0] for w in weights]
    for k, (w, c) in enumerate(zip(weights, biases)):
        if w.dim() != 2 or tuple(w.shape) != (widths[k + 1], widths[k]) or tuple(c.shape) != (widths[k + 1],):
            raise ValueError(f"weights[{k}] must be ({widths[k + 1]}, {widths[k]}) and biases[{k}] "
                             f"({widths[k + 1]},), got {tuple(w.shape)} and {tuple(c.shape)}")
    expected = [(), (Bn,)] if row is None else [(row.numel(),)]
    if tuple(weight.shape) not in expected:
        raise ValueError(f"weight must have shape {' or '.join(map(str, expected))} (for all pairs a 0-dim scale "
                         f"or one per row, else one per listed pair), got {tuple(weight.shape)}")
    V = weights[-1].shape[0] // 2
    pair_loss_op.check_devices(f, b, weights, biases, tokens, lengths, prefix_start, row, i, j, weight)
    # The values are checked here, inside the op, so that a compiled graph (which skips the checks
    # of belief_state_loss) still rejects bad input. A listed set on the host is checked there (no
    # device read); the tokens then are checked on the device, their flag read once the chunks are
    # queued (their kernels mask a label outside [0, V), so a bad one reads nothing out of bounds).
    checked = _pairs.prepare(f, b, tokens, V, lengths=lengths, prefix_start=prefix_start, min_gap=min_gap,
                             max_gap=max_gap, pairs=None if row is None else (row, i, j), next_weight=next_weight,
                             reduction="sum", generator=None, meet_token=meet_token, host_pairs=True)
    if checked is None:  # as the cpp op: only belief_state_loss makes a sum over no pair 0
        raise ValueError(_pairs.NO_PAIR)
    on_device_lengths = _pairs.to_device(lengths, f.device)  # uploaded once, without blocking
    bad_tok = _pairs.token_problems(tokens, on_device_lengths, V) if checked.host else None
    p = Pairs(lengths=lengths, prefix_start=prefix_start, min_gap=min_gap, max_gap=max_gap,
              scale=weight if row is None else weight.new_ones(()), row=row, i=i, j=j,
              weight=None if row is None else weight, meet_token=meet_token if min_gap == 1 else None)
    # Switches.vocab_pad: each half of the last layer padded to a multiple of it (a GEMM tile)
    pad = runtime.SWITCHES.vocab_pad
    Vp = -(-V // pad) * pad if pad else V
    weights, biases = [w.contiguous() for w in weights], [c.contiguous() for c in biases]
    if Vp != V:
        weights, biases = _padded_vocabulary(weights, biases, V, Vp)
    hidden = [w.shape[0] for w in weights[:-1]]  # h1 first
    cfg = chunk_config(f.device.type, Vp, hidden, dtype, runtime.SWITCHES)
    pl = pair_list(p, Bn, L, cfg["chunk"], structured=runtime.SWITCHES.structured_sums, device=f.device)
    with on_device(f.device):
        loss, df, db, dW, dc = _loss_by_chunks(f, b, on_device_lengths, tokens, pl, weights, biases,
                                               activation, next_weight, need_grad, dtype, cfg, V,
                                               window_rows(Bn, L, hidden[0], need_grad, runtime.SWITCHES))
    if bad_tok is not None:  # the op's one synchronisation, after its kernels
        _pairs.raise_on_bad_tokens(tokens, bad_tok, V)
    if need_grad and Vp != V:
        dW[-1], dc[-1] = _unpadded(dW[-1], V, Vp), _unpadded(dc[-1], V, Vp)
    if not need_grad:
        empty = lambda: f.new_empty(0, dtype=torch.float32)
        return loss, empty(), empty(), [empty() for _ in weights], [empty() for _ in biases]
    return loss, df, db, dW, dc


def window_rows(B: int, L: int, h1: int, need: bool, switches) -> int:
    """_FirstLayer's rows beyond one chunk's (runtime.window_rows): its float32 tables A, B, and with
    need dA, dB, in a sixteenth of the chunk budget (16 MB of 256), or a sixteenth of the batch if
    more (a list of few pairs a row, whose chunks span many rows, moves it once a chunk instead)."""
    return runtime.window_rows(B, L * h1 * 4 * (4 if need else 2), switches.triton_chunk_bytes, switches)


pair_loss_op.register("bst_fast::triton_pair_loss", NAME, split=False)


def supports(head, device: torch.device, dtype: torch.dtype):
    problem = fused_problem(NAME, head, dtype)
    # The Triton kernels run on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1 (tests).
    if problem is None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"backend={NAME!r} runs on a CUDA device (or on the CPU under TRITON_INTERPRET=1)"
                + ("; use backend='cpp' on the CPU" if device.type == "cpu" else f", got {device.type} tensors"))
    return problem


def run(f, b, tokens, head, pairs: Pairs, options: LossOptions):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), chunk by chunk.

    f, b: (B, L, m) float32/float16/bfloat16; tokens: (B, L) int64; head: a TextHead in f's dtype;
    options.compute_dtype: the matrix products' operand type (None: f's dtype; bf16 under autocast
    for an fp32 model). Returns a 0-dim float32 loss."""
    dtype = options.compute_dtype or f.dtype
    args = pair_loss_op.text_head_arguments(f, b, tokens, head, pairs, options.next_weight, dtype, split=False)
    return torch.ops.bst_fast.triton_pair_loss(*args, meet_token=pairs.meet_token)[0]
