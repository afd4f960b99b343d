"""The "torch" backend: any head module, pairs in chunks, gradients computed chunk by chunk in the forward.

Activation memory is bounded by one chunk of pairs (the pair index lists of a row are O(L^2)
integers): each chunk's head graph is built, differentiated with
torch.autograd.grad and freed before the next; f, b and parameter gradients are accumulated in
float32 (float64 for float64 inputs) and only scaled by grad_output in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._pairs import Pairs, labels, pair_chunks

# Elements of the (chunk, 2m + 2V + hidden) working set; about 128 MB of float32.
_CHUNK_ELEMENTS = 1 << 25


def _chunk_pairs(m: int, vocab_size: int) -> int:
    per_pair = 2 * m + 4 * vocab_size + 2048  # input, logits and their grads, hidden activations
    return max(64, min(65536, _CHUNK_ELEMENTS // per_pair))


def _chunk_loss(fi, bj, head, tokens, row, i, j, weight, next_weight, vocab_size, acc):
    logits = head(torch.cat([fi, bj], dim=-1)).to(acc)  # (chunk, 2V)
    y_next, y_prev = labels(tokens, row, i, j)
    ce = next_weight * F.cross_entropy(logits[:, :vocab_size], y_next, reduction="none")
    ce = ce + (1.0 - next_weight) * F.cross_entropy(logits[:, vocab_size:], y_prev, reduction="none")
    return (weight.to(acc) * ce).sum()


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, b, tokens, head, p, next_weight, vocab_size, grad_enabled, *params):
        acc = torch.float64 if f.dtype == torch.float64 else torch.float32
        # needs_input_grad ignores grad mode (inside forward it is always off): the caller's
        # grad_enabled decides whether any gradient is computed at all.
        need_f, need_b = (grad_enabled and n for n in ctx.needs_input_grad[:2])
        need_p = [grad_enabled and n for n in ctx.needs_input_grad[8:]]
        grad_params = [q for q, n in zip(params, need_p) if n]
        gf = torch.zeros(f.shape, dtype=acc, device=f.device) if need_f else None
        gb = torch.zeros(b.shape, dtype=acc, device=b.device) if need_b else None
        gp = [torch.zeros(q.shape, dtype=acc, device=q.device) for q in grad_params]
        loss = torch.zeros((), dtype=acc, device=f.device)
        chunk = _chunk_pairs(f.shape[-1], vocab_size)
        for row, i, j, w in pair_chunks(p, chunk):
            fi = f[row, i].detach().requires_grad_(need_f)
            bj = b[row, j].detach().requires_grad_(need_b)
            wrt = ([fi] if need_f else []) + ([bj] if need_b else []) + grad_params
            with torch.set_grad_enabled(bool(wrt)):
                part = _chunk_loss(fi, bj, head, tokens, row, i, j, w, next_weight, vocab_size, acc)
                # allow_unused: a head may hold parameters its forward does not use
                grads = list(torch.autograd.grad(part, wrt, allow_unused=True)) if wrt else []
            loss += part.detach()
            if need_f:
                gf.index_put_((row, i), grads.pop(0).to(acc), accumulate=True)
            if need_b:
                gb.index_put_((row, j), grads.pop(0).to(acc), accumulate=True)
            for acc_g, g in zip(gp, grads):
                if g is not None:
                    acc_g += g
        ctx.save_for_backward(*([gf] if need_f else []), *([gb] if need_b else []), *gp)
        ctx.flags = (need_f, need_b, need_p)
        ctx.dtypes = (f.dtype, b.dtype, [q.dtype for q in params])
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        need_f, need_b, need_p = ctx.flags
        saved = list(ctx.saved_tensors)
        gf = (grad_loss * saved.pop(0)).to(ctx.dtypes[0]) if need_f else None
        gb = (grad_loss * saved.pop(0)).to(ctx.dtypes[1]) if need_b else None
        gp = [(grad_loss * saved.pop(0)).to(dt) if n else None for n, dt in zip(need_p, ctx.dtypes[2])]
        return (gf, gb, None, None, None, None, None, None, *gp)


def pair_loss(f, b, tokens, head, p: Pairs, next_weight: float, vocab_size: int):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), a chunk of pairs at a time."""
    params = [q for q in head.parameters()]
    return _ChunkedLoss.apply(f, b, tokens, head, p, next_weight, vocab_size, torch.is_grad_enabled(), *params)
