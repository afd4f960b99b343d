"""The torch backend's chunk engines: a chunk's pair sums, their gradients and its cross-entropy.

They do the work around the head's per-pair tail; backends/torch_backend.py runs the chunk loop.

Two engines with one interface, for part k of a chunk (a _pairs.Chunk) and `what` ("sum" the
part's pair sum, "gate" or "up" one half of a swiglu part's, "swiglu" swiglu of both). An engine
holds the tables of a window of rows, the flat positions from pos0 on (row p - pos0 of a table is
position p), and their gradient accumulators d[P ; Q] (the window's prefix rows, then its suffix rows):

    gather(k, chunk, what) -> x           (n, w) the per-pair value, in the part's dtype
    add_grad(k, chunk, grad, scale, what) adds scale * x's gradient into the part's accumulator
    cross_entropy_(z, chunk, need, gscale) the chunk's weighted loss; with need, the logits z
                                          become gscale * their gradient in place

- TritonOps (CUDA tensors, float32 accumulation): the triton backend's kernels. The pair sum is
  pair_hidden_kernel without an activation: one read of two rows (L2 hits) and one write of
  n*w*es. Its gradient is the prefix and suffix segment sums: each reads x's gradient once
  (n*w*es), no atomics (these sums are reproducible; the head's own are torch's), and no float32
  copy of x or of its gradient is made. A swiglu part: the same kernels with SWIGLU, one write of
  n*w/2*es forward; backward each reads the (n, w/2) gradient once and recomputes gate and up from
  P and Q (L2 hits), so neither gate, up nor their gradients are ever stored. The cross-entropy
  kernel reads and writes the logits once (2 * n*2V*es).
- TorchOps (the CPU, and float64): one embedding_bag over [P ; Q] and a cast; index_add_ of x's
  gradient cast to the accumulator's dtype (atomic, so not reproducible on a GPU); a swiglu part's
  activation and its gradient (head.swiglu_grad, from the sums gathered again) in the
  accumulator's dtype; the cross-entropy on the logits in the accumulator's dtype (a copy of
  16-bit logits), its gradient rounded once into them.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .._pairs import Chunk, PairList
from ..head import swiglu, swiglu_grad


def _cross_entropy_(z, y, wl, need: bool, gscale: float = 1.0):
    """sum of wl * CE(z, y) over the (n, 2) rows of z (n, 2, V), in wl's dtype. With need, z is
    overwritten by gscale * wl * (softmax(z) - onehot(y)), computed in wl's dtype and rounded once
    to z's, as the Triton kernel does (rounding every 16-bit step breaks docs/contract.md §6's 2x
    bound on small bias gradients). This engine runs on the CPU (and in float64): a float32 copy of
    a 16-bit chunk (16 MB of logits) is cheap there; the GPU engine makes none."""
    acc = wl.dtype
    x = z.to(acc)  # z itself when it is already float32 / float64: overwritten in place
    yi = y[..., None]
    zy = x.gather(2, yi)  # (n, 2, 1)
    mx = x.amax(2, keepdim=True)
    x = x.sub_(mx).exp_()
    # The label's term ey and the others' sum ry, apart: the loss is (mx - zy) + log1p(ry + (ey - 1))
    # and the label's gradient -ry / (ry + ey). For a confident model (the label on top, ey = 1) both
    # keep the tiny ry whole, which mx + log(sum) - zy loses to the rounding of mx and of 1 + ry.
    ey = x.gather(2, yi)
    x.scatter_(2, yi, 0.0)
    ry = x.sum(2, keepdim=True)
    s = ry + ey
    loss = (wl * ((mx - zy) + torch.log1p(ry + (ey - 1.0)))).sum()
    if need:
        x.mul_(gscale * wl / s)
        x.scatter_(2, yi, gscale * wl * (-ry / s))
        if x is not z:
            z.copy_(x)
    return loss


def _halves(t, what):
    """The columns of a part's table (or gradient) that `what` reads: the gate or up half, or all."""
    h = t.shape[-1] // 2
    return t[..., :h] if what == "gate" else t[..., h:] if what == "up" else t


class TorchOps:
    """A chunk's work around the head through torch ops. The pair sums: x = P[ia] + Q[ib] as one
    embedding_bag over the stacked table [P ; Q] (rows ia and B*L + ib), cast to the part's dtype;
    the gradient cast to the accumulator's dtype and added into d[P ; Q] at both rows by
    index_add_. A swiglu part: the [gate | up] sums in the accumulator's dtype, swiglu of them
    rounded once; on the way back the sums are gathered again for swiglu_grad. The cross-entropy:
    _cross_entropy_."""

    writes_logits_without_grad = True  # the cross-entropy works in place on the logits

    def __init__(self, prefix, suffix, dtypes, swiglu_parts, pl: PairList, grads, tokens, next_weight, pos0: int = 0):
        BL = prefix[0].shape[0] * prefix[0].shape[1]  # the window's positions
        self.tables = [torch.cat([P.detach().reshape(BL, -1), Q.detach().reshape(BL, -1)]) for P, Q in zip(prefix, suffix)]
        for k in swiglu_parts:  # SwiGLU of the float32 (float64) sums: 16-bit tables are upcast first
            if self.tables[k].dtype != torch.float64:
                self.tables[k] = self.tables[k].float()
        self.dtypes, self.pl, self.grads, self.BL, self.pos0 = dtypes, pl, grads, BL, pos0
        self.tok = tokens.reshape(-1)
        self.lam = torch.tensor([next_weight, 1.0 - next_weight], dtype=pl.w.dtype, device=tokens.device).reshape(1, 2, 1)
        self._rows = (None, None)

    def rows(self, chunk: Chunk):
        if self._rows[0] != chunk.s0:  # one (n, 2) index per chunk, shared by the parts
            s0, n = chunk.s0, chunk.n
            ia, ib = (t[s0 : s0 + n].long() - self.pos0 for t in (self.pl.ia, self.pl.ib))
            self._rows = (s0, torch.stack([ia, ib + self.BL], 1))
        return self._rows[1]

    def _sums(self, k, chunk, what):
        with torch.autocast(self.tables[k].device.type, enabled=False):
            return F.embedding_bag(self.rows(chunk), _halves(self.tables[k], what), mode="sum")

    def gather(self, k, chunk, what):
        x = self._sums(k, chunk, what)
        if what == "swiglu":
            x = swiglu(*x.chunk(2, dim=1))
        return x.to(self.dtypes[k])

    def add_grad(self, k, chunk, grad, scale, what):
        g = grad.to(self.grads[k].dtype)
        if scale != 1.0:
            g = g * scale
        rows = self.rows(chunk)
        if what == "swiglu":  # the gate's and up's gradients into the two halves
            pieces = zip(swiglu_grad(g, *self._sums(k, chunk, what).chunk(2, dim=1)), ("gate", "up"))
        else:
            pieces = [(g, what)]
        for g, half in pieces:
            dst = _halves(self.grads[k], half)
            dst.index_add_(0, rows[:, 0], g)
            dst.index_add_(0, rows[:, 1], g)

    def cross_entropy_(self, z, chunk, need, gscale):
        s0, n = chunk.s0, chunk.n
        rows = self.rows(chunk)
        at = rows[:, 0] + self.pos0, rows[:, 1] + (self.pos0 - self.BL)  # the flat positions ia, ib
        y = torch.stack([self.tok[at[0] + 1], self.tok[at[1] - 1]], 1)  # Next, Prev labels
        if self.pl.meet_token is not None:  # a pair with j - i = 1 takes meet_token as both labels (contract §8)
            y = y.masked_fill((at[1] - at[0] == 1)[:, None], self.pl.meet_token)
        wl = self.lam if self.pl.w_stride == 0 else self.lam * self.pl.w[s0 : s0 + n].reshape(-1, 1, 1)
        return _cross_entropy_(z.view(n, 2, -1), y, wl, need, gscale)


class TritonOps:
    """A chunk's work around the head through the triton backend's kernels. The pair sums without
    an activation (float32 sums, rounded once to the part's dtype); their gradient reduced by the
    prefix and suffix segment kernels straight from x's gradient into the float32 dP and dQ, in a
    fixed order. A swiglu part: the same kernels with SWIGLU, silu(gate) * up from the float32
    sums, and on the way back gate and up recomputed from P and Q. The cross-entropy:
    pair_cross_entropy_ (one read and one write of the logits, float32 loss per pair). The
    launches are the triton backend's (kernels/, shapes from launch.py)."""

    writes_logits_without_grad = False  # without gradients the cross-entropy only reads the logits

    def __init__(self, prefix, suffix, dtypes, swiglu_parts, pl: PairList, grads, tokens, next_weight, pos0: int = 0):
        from ..kernels.activation import NO_ACT, SWIGLU, interpreted_bf16
        from .launch import gather_config

        BL = prefix[0].shape[0] * prefix[0].shape[1]
        self.P, self.Q = [], []
        for k, (P, Q) in enumerate(zip(prefix, suffix)):
            # rows may be ld apart (a column slice of a wider table), but each row contiguous and
            # both tables alike; otherwise a contiguous copy. A swiglu part's backward reads P and Q
            # with the row stride of its contiguous gradient, so it is always contiguous.
            P, Q = P.detach().reshape(BL, -1), Q.detach().reshape(BL, -1)
            if P.stride(1) != 1 or Q.stride() != P.stride() or k in swiglu_parts:
                P, Q = P.contiguous(), Q.contiguous()
            self.P.append(P)
            self.Q.append(Q)
        self.dtypes, self.pl, self.grads, self.BL, self.pos0 = dtypes, pl, grads, BL, pos0
        # launch shapes by what a part's kernels do: its sum, a half (gate or up), or SWIGLU
        self.cfg = []
        for P in self.P:
            half = gather_config(P.device.type, P.shape[1] // 2, "sum")
            self.cfg.append(dict(sum=gather_config(P.device.type, P.shape[1], "sum"), gate=half, up=half,
                                 swiglu=gather_config(P.device.type, P.shape[1] // 2, "swiglu")))
        self.up = [interpreted_bf16(d) for d in dtypes]
        self.act = dict(swiglu=SWIGLU.value, gate=NO_ACT.value, up=NO_ACT.value, sum=NO_ACT.value)
        self.tok, self.lam = tokens.contiguous().reshape(-1), float(next_weight)
        self.loss_rows = torch.empty(max((c.n for c in pl.chunks), default=1), dtype=torch.float32, device=tokens.device)

    def gather(self, k, chunk, what):
        from ..kernels.pair_hidden import pair_hidden

        P, Q = self.P[k], self.Q[k]
        if what != "swiglu":
            P, Q = _halves(P, what), _halves(Q, what)
        x = torch.empty(chunk.n, P.shape[1] // (2 if what == "swiglu" else 1), dtype=self.dtypes[k], device=P.device)
        pair_hidden(P, Q, self.pl, chunk.s0, chunk.n, x, self.act[what], self.cfg[k][what], self.up[k], self.pos0)
        return x

    def add_grad(self, k, chunk, grad, scale, what):
        from ..kernels.pair_hidden import segment_grads

        # without an activation the kernels read only the gradient and the index lists, never P or
        # Q; with SWIGLU they recompute gate and up from P and Q (both contiguous then)
        P, Q, dPQ = self.P[k], self.Q[k], self.grads[k]
        if what != "swiglu":
            P, Q, dPQ = _halves(P, what), _halves(Q, what), _halves(dPQ, what)
        segment_grads(grad.contiguous(), P, Q, self.pl, chunk, dPQ[: self.BL], dPQ[self.BL :], self.act[what], scale,
                      self.cfg[k][what], pos0=self.pos0)

    def cross_entropy_(self, z, chunk, need, gscale):
        from ..kernels.activation import interpreted_bf16
        from ..kernels.cross_entropy import pair_cross_entropy_
        from .launch import ce_config

        return pair_cross_entropy_(z, self.tok, self.pl, chunk.s0, self.lam, gscale, need, self.loss_rows,
                                   ce_config(z.device.type, z.shape[1] // 2), interpreted_bf16(z.dtype))[0]


def engine(device: torch.device, acc: torch.dtype, triton_ops: Optional[bool]):
    """The engine for a chunk loop accumulating in `acc` on `device`: TritonOps for CUDA tensors in
    float32 (or wherever triton_ops is True), TorchOps for float64, the CPU, triton_ops False, or a
    CUDA machine without Triton."""
    if acc != torch.float32 or triton_ops is False:
        return TorchOps
    if triton_ops:
        return TritonOps
    if device.type != "cuda":
        return TorchOps
    try:
        import triton  # noqa: F401
    except ImportError:  # a CUDA machine without Triton: the torch ops
        return TorchOps
    return TritonOps
