"""The "torch" backend: any head module, all pairs in large chunks across rows, each chunk's head
graph built by torch autograd, differentiated and freed before the next.

The pair set is one flat list on the device (`_pairs.flat_pairs`: ia = row * L + i, ib = row * L + j,
built once without a loop over rows), cut into chunks of `chunk_pairs` pairs: no host
synchronisation per chunk. The head's work splits into parts computed once per position and a
per-pair tail (`pair_parts`, see head.py): TextHead splits its first layer, ResidualSwiGLUHead its
gate/up projection; any other head gets [f ; 0] and [0 ; b], whose pair sum is [f_i ; b_j]. Per
chunk of n pairs, for each part (P, Q) of width w and with es the logits' bytes:

    x      = P[ia] + Q[ib]                (n, w): one embedding_bag over [P ; Q] (_PairSum)
    logits = tail(x, ...)                 (n, 2V): the head's per-pair work, built by autograd
    CE     = row max, exp, float32 (float64) sums; the logits become w·(softmax - onehot) in place
             (5 passes over n*2V*es bytes; on a GPU no float32 copy of the logits, on the CPU
             torch upcasts one for the float32 sum)
    grads  = autograd.grad(logits, parameters, that gradient); on the way back each pair sum adds
             x's gradient into d[P ; Q] at ia and B*L + ib (index_add_, float32; float64 for
             float64), so no per-chunk gradient of P or Q is made
    dparam += grads                       float32 (float64 for float64)

A chunk holds about CHUNK_BYTES in its widest per-pair tensor (the logits for a TextHead, the
gate/up sums for a ResidualSwiGLUHead). The loss is the graph's last node, so the forward computes
every gradient and the backward only scales them by grad_output (autograd then maps the parts'
gradients back to f, b and the split weights). Pair weights are divided by the largest one (so
that fp16 gradients do not underflow) and multiplied back at the end.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from .._pairs import Pairs, flat_pairs
from ..head import concat_parts

# Bytes of a chunk's widest per-pair tensor. On a GPU: 256 MB (the logits of 65k pairs at V=1000 in
# bf16); BST_FAST_TORCH_CHUNK_MB changes it. On the CPU a smaller chunk stays in cache.
CHUNK_BYTES = int(float(os.environ.get("BST_FAST_TORCH_CHUNK_MB", "256")) * 2**20)
CPU_CHUNK_BYTES = 16 * 2**20
# A fixed number of pairs per chunk instead of the byte budget (tests set it).
CHUNK_PAIRS: Optional[int] = None


def chunk_pairs(per_pair_bytes: int, device: torch.device) -> int:
    """Pairs per chunk: CHUNK_PAIRS if set, else the byte budget over the widest per-pair tensor."""
    if CHUNK_PAIRS is not None:
        return int(CHUNK_PAIRS)
    budget = CHUNK_BYTES if device.type != "cpu" else CPU_CHUNK_BYTES
    return max(1, budget // max(1, per_pair_bytes))


def _cross_entropy_(z, y, wl, need: bool, gscale: float = 1.0):
    """sum of wl * CE(z, y) over the (n, 2) rows of z (n, 2, V), in wl's dtype. z is overwritten: with
    need, by gscale * wl * (softmax(z) - onehot(y)) in its own dtype. On a GPU no float32 copy of z
    is made; on the CPU torch's sum(dtype=float32) of a 16-bit tensor upcasts a copy first."""
    acc = wl.dtype
    zy = z.gather(2, y[..., None]).to(acc)  # (n, 2, 1)
    mx = z.amax(2, keepdim=True)
    z.sub_(mx).exp_()
    s = z.sum(2, keepdim=True, dtype=acc)
    loss = (wl * (mx.to(acc) + s.log() - zy)).sum()
    if need:
        z.mul_((gscale * wl / s).to(z.dtype))
        z.scatter_add_(2, y[..., None], (-gscale * wl).to(z.dtype).expand(z.shape[0], 2, 1))
    return loss


class _SavedStorages:
    """Records the storages autograd saves while a graph is built: the logits may be overwritten
    with their own gradient only if no backward node reads them."""

    def __init__(self):
        self.ptrs = set()

    def pack(self, t):
        try:
            self.ptrs.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no plain storage: assume it may be the logits
            self.ptrs.add(None)
        return t

    def holds(self, t) -> bool:
        return None in self.ptrs or t.untyped_storage().data_ptr() in self.ptrs


class _PairSum(torch.autograd.Function):
    """x = P[ia] + Q[ib] for the pairs of a chunk: one embedding_bag (the sum of two rows, in float32
    for 16-bit tables) over the stacked table [P ; Q] with rows = [ia, B*L + ib]. The backward
    converts x's gradient to the accumulator's dtype once and adds it into `into` (the table's
    float32 or float64 gradient) at both rows itself, returning none: no per-chunk gradient of the
    table is made. `token` (a leaf that requires grad) puts this node in the graph."""

    @staticmethod
    def forward(ctx, table, rows, into, token, unscale):
        ctx.save_for_backward(rows)
        ctx.into, ctx.unscale = into, unscale
        return _pair_sum(table, rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        g = grad.to(ctx.into.dtype)
        if ctx.unscale != 1.0:  # the chunk's gradient was scaled down (float16, see _ChunkedLoss)
            g = g * ctx.unscale
        ctx.into.index_add_(0, rows[:, 0], g)
        ctx.into.index_add_(0, rows[:, 1], g)
        return None, None, None, None, None


def _pair_sum(table, rows):
    with torch.autocast(table.device.type, enabled=False):
        return F.embedding_bag(rows, table, mode="sum")


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, p, next_weight, vocab_size, tail, n_parts, grad_enabled, *inputs):
        prefix, suffix, params = inputs[:n_parts], inputs[n_parts : 2 * n_parts], inputs[2 * n_parts :]
        acc = torch.float64 if any(t.dtype == torch.float64 for t in inputs[: 2 * n_parts]) else torch.float32
        dev = tokens.device
        BL = tokens.numel()
        # needs_input_grad ignores grad mode (inside forward it is always off): the caller's
        # grad_enabled decides whether any gradient is computed at all.
        need = [grad_enabled and n for n in ctx.needs_input_grad[7:]]
        need_parts = [a or b for a, b in zip(need[:n_parts], need[n_parts : 2 * n_parts])]
        need_params = need[2 * n_parts :]
        # [P ; Q] per part, (2 B L, w): a pair's x is the sum of its rows ia and B*L + ib
        tables = [torch.cat([P.detach().reshape(BL, -1), Q.detach().reshape(BL, -1)]) for P, Q in zip(prefix, suffix)]
        grad_tables = [torch.zeros(t.shape, dtype=acc, device=dev) if n else None for t, n in zip(tables, need_parts)]
        wrt_params = [q for q, n in zip(params, need_params) if n]
        grad_params = [None] * len(wrt_params)  # created at the first chunk that reaches them
        token = torch.zeros((), device=dev, requires_grad=True)
        backprop = any(need_parts) or bool(wrt_params)

        ia, ib, weight = flat_pairs(p, tokens.shape[1])
        total = ia.numel()
        wscale = (p.scale if weight is None else weight.max()).to(acc)
        w_rel = None if weight is None else (weight / weight.max()).to(acc).reshape(-1, 1, 1)
        lam = torch.tensor([next_weight, 1.0 - next_weight], dtype=acc, device=dev).reshape(1, 2, 1)
        tok = tokens.reshape(-1)
        es = torch.finfo(torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type)
                         else params[0].dtype if params else tables[0].dtype).bits // 8
        widest = max([2 * vocab_size * es] + [t.shape[1] * t.element_size() for t in tables])
        chunk = chunk_pairs(widest, dev)
        loss = torch.zeros((), dtype=acc, device=dev)
        param_storages = {q.untyped_storage().data_ptr() for q in params}
        for s in range(0, total, chunk):
            a, c = ia[s : s + chunk], ib[s : s + chunk]
            n = a.numel()
            rows = torch.stack([a, c + BL], 1)  # (n, 2)
            # float16 parameter gradients are sums over the chunk's pairs of O(1) per-pair terms
            # (the weights are normalised): scaled by 1/sqrt(n) they neither overflow 65504 nor
            # fall to subnormals; the float32 accumulators multiply it back.
            gs = n ** -0.5 if (params[0].dtype if params else tables[0].dtype) == torch.float16 else 1.0
            saved = _SavedStorages()
            with torch.set_grad_enabled(backprop), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                xs = [_pair_sum(t, rows) if g is None else _PairSum.apply(t, rows, g, token, 1.0 / gs)
                      for t, g in zip(tables, grad_tables)]
                logits = tail(xs)
                del xs
            if logits.shape != (n, 2 * vocab_size):
                raise ValueError(f"the head must map (n, 2m) to (n, 2V) = ({n}, {2 * vocab_size}), "
                                 f"got {tuple(logits.shape)}")
            z = logits.detach()
            # z becomes its own gradient in place: not where a backward node reads it, nor in a
            # view or a parameter's storage (a head may return a slice or an expand of one)
            if (saved.holds(z) or not z.is_contiguous() or logits._base is not None
                    or z.untyped_storage().data_ptr() in param_storages):
                z = z.clone(memory_format=torch.contiguous_format)
            y = torch.stack([tok[a + 1], tok[c - 1]], 1)  # Next and Prev labels, (n, 2)
            wl = lam if w_rel is None else lam * w_rel[s : s + chunk]
            loss += _cross_entropy_(z.view(n, 2, vocab_size), y, wl, backprop, gs)
            if not backprop:
                continue
            # The pair sums add into grad_tables on the way. allow_unused: a head may hold
            # parameters its per-pair work does not use.
            grads = torch.autograd.grad(logits, [token] + wrt_params, grad_outputs=z, allow_unused=True)[1:]
            del logits, z
            for k, g in enumerate(grads):
                if g is not None:
                    if grad_params[k] is None:
                        grad_params[k] = torch.zeros(g.shape, dtype=acc, device=dev)
                    grad_params[k].add_(g, alpha=1.0 / gs)
        loss = loss * wscale
        it = iter(g if g is None else g.mul_(wscale) for g in grad_params)
        grad_params = [next(it) if n else None for n in need_params]  # None: not used per pair
        halves = [(None, None) if g is None else g.mul_(wscale).split(BL) for g in grad_tables]
        grad_prefix = [h[0] if n else None for h, n in zip(halves, need[:n_parts])]
        grad_suffix = [h[1] if n else None for h, n in zip(halves, need[n_parts : 2 * n_parts])]
        ctx.save_for_backward(*grad_prefix, *grad_suffix, *grad_params)
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        out = [None if g is None else (grad_loss * g).to(dt).reshape(shape)
               for g, (shape, dt) in zip(ctx.saved_tensors, ctx.shapes)]
        return (None,) * 7 + tuple(out)


def _concat_parts(head):
    """The split of a head without pair_parts: [f ; 0] + [0 ; b] = [f_i ; b_j], then the head."""
    def tail(xs):
        return head(xs[0])

    def parts(f, b, lengths):
        xf, xb = concat_parts(f, b)
        return [xf], [xb], tail
    return parts


def pair_loss(f, b, tokens, head, p: Pairs, next_weight: float, vocab_size: int):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), a chunk of pairs at a time."""
    split = getattr(head, "pair_parts", None) or _concat_parts(head)
    prefix_parts, suffix_parts, tail = split(f, b, p.lengths)
    return _ChunkedLoss.apply(tokens, p, next_weight, vocab_size, tail, len(prefix_parts), torch.is_grad_enabled(),
                              *prefix_parts, *suffix_parts, *head.parameters())
