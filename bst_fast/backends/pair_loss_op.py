"""The rules shared by the pair-loss ops of the fused backends (bst_fast::pair_loss in C++ for the
CPU, bst_fast::triton_pair_loss in Python for the GPU), which share one schema:

    (A, Bm, weights[], biases[], tokens, lengths, prefix_start, min_gap, max_gap, row?, i?, j?,
     weight, next_weight, activation, need_grad, meet_token?=None) -> (loss, dA, dB, dW[], dc[])

A, Bm: (B, L, h1) float32, the split first layer (docs/contract.md §3); weights/biases: the layers
after it (the last one (2V, hL)); row/i/j: None for all pairs (then weight is the 0-dim scale of
every pair, or a (B,) scale per row: row_mean, §9) or an explicit list with one weight per pair;
meet_token: both labels of the pairs with j - i = 1 (§8), needed by min_gap = 1. The pair set's
tensors (lengths, prefix_start, weight and a listed row, i, j) are on A's device, or a listed set's
all on the CPU (the triton op builds its pair list on the host then: check_devices). The op returns
the loss and, with need_grad, every gradient in float32 (empty tensors without); autograd only
scales them by grad_output, since the loss is the graph's last node. The triton op takes the whole
head instead (split=False below): f, b (B, L, m) in A's and Bm's places and the first layer's own
weight (h1, 2m) and bias first in the lists, split inside it a window of rows at a time, so that no
(B, L, h1) float32 table of the whole batch is held; it returns df, db in f's and b's dtypes
(float32 for float16: side_grad_dtype).
`text_head_arguments` builds these arguments from a TextHead, the one place the fused backends read
a head's layers; `fused_problem` says whether a fused backend takes a head and dtype at all.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import _pairs
from ..head import TextHead, has_backward_hooks, text_head_changes


def fused_problem(name: str, head, dtype: torch.dtype) -> Optional[str]:
    """Why the fused engine `name` cannot take this head and dtype (None if it can): it computes a
    TextHead, from its layers' weights and biases alone, in 32 or 16 bits."""
    if not isinstance(head, TextHead):
        return f"backend={name!r} needs a TextHead; use backend='torch' for {type(head).__name__}"
    changed = text_head_changes(head)
    if changed:
        # a backward hook needs every pair's head output: only 'reference' materialises it
        other = ("use backend='reference', which runs the head on every pair" if has_backward_hooks(head)
                 else "use backend='torch', which runs the head itself")
        return f"backend={name!r} computes a TextHead from its layers' weights and biases, but {changed}; {other}"
    if dtype == torch.float64:
        return (f"backend={name!r} takes float32, float16 or bfloat16 inputs; float64 runs through "
                "'torch' or 'reference'")
    return None


def text_head_arguments(f, b, tokens, head, p, next_weight: float, dtype: torch.dtype, split: bool = True):
    """The op's arguments (meet_token apart, a keyword) for a TextHead: its first layer split in torch
    (autograd maps dA, dB to f, b, W1, c1), or with split=False f, b and the layer itself (the triton
    op's form); the later layers in `dtype`, the matrix operands' type (autograd casts their
    gradients back), and need_grad when any of them needs a gradient."""
    if p.bounds is not None:  # packed rows (docs/contract.md §10): the schema takes their pairs listed
        p = _pairs.listed(p, f.shape[1])
    later = head.layers[1:]
    weights = [layer.weight.to(dtype) for layer in later]
    biases = [layer.bias.to(dtype) for layer in later]
    if split:
        A, Bm = head.first_layer_states(f, b, _pairs.to_device(p.lengths, f.device), dtype)  # (B, L, h1) float32 each
    else:
        A, Bm = f, b
        weights, biases = [head.layers[0].weight] + weights, [head.layers[0].bias] + biases
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (A, Bm, *weights, *biases))
    weight = p.scale if p.row is None else p.weight
    return (A, Bm, weights, biases, tokens, p.lengths, p.prefix_start, p.min_gap, p.max_gap, p.row, p.i, p.j,
            weight, float(next_weight), head.activation, need_grad)


def check_devices(A, Bm, weights, biases, tokens, lengths, prefix_start, row, i, j, weight):
    """Every tensor argument on A's device, but for a listed pair set that may lie on the CPU whole
    (lengths, prefix_start, weight, row, i, j): the triton op then builds its pair list on the host."""
    model = [A, Bm, *weights, *biases, tokens]
    pair_set = [lengths, prefix_start, weight] + [t for t in (row, i, j) if t is not None]
    on_host = row is not None and all(t.device.type == "cpu" for t in pair_set)
    given = model + ([] if on_host else pair_set)
    if any(t.device != A.device for t in given):
        raise ValueError(f"every tensor argument must be on A's device ({A.device}), or a listed pair set's "
                         f"(lengths, prefix_start, weight, row, i, j) all on the CPU, got "
                         f"{sorted({str(t.device) for t in model + pair_set})}")


def side_grad_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which the triton op returns the gradients of f and b of `dtype`: theirs for
    bfloat16 (float32's range: 16 bits a value fewer to hold, and _backward scales them in float32)
    and float32; float32 for float16, whose range would lose them to a loss scale (GradScaler's
    65536 overflowed them) or to subnormals (a tiny pair weight) before grad_output reached them."""
    return torch.float32 if dtype == torch.float16 else dtype


def fake(A, Bm, weights, biases, tokens, lengths, prefix_start, min_gap, max_gap,
         row, i, j, weight, next_weight, activation, need_grad, meet_token=None, split: bool = True):
    # Also the Meta kernel: one meta argument among real ones lands here, and the outputs, made on
    # A's device, would be uninitialised memory returned as a loss. split=False: the triton op's
    # form, whose first two gradients are f's and b's (contiguous, in side_grad_dtype's dtype).
    check_devices(A, Bm, weights, biases, tokens, lengths, prefix_start, row, i, j, weight)
    f32 = dict(dtype=torch.float32)
    if not need_grad:  # the op returns empty gradients then
        return (A.new_empty((), **f32), A.new_empty(0, **f32), A.new_empty(0, **f32),
                [A.new_empty(0, **f32) for _ in weights], [A.new_empty(0, **f32) for _ in biases])
    side = lambda t: t.new_empty(t.shape, dtype=torch.float32 if split else side_grad_dtype(t.dtype))
    return (A.new_empty((), **f32), side(A), side(Bm),
            [w.new_empty(w.shape, **f32) for w in weights], [c.new_empty(c.shape, **f32) for c in biases])


def _setup_context(ctx, inputs, output):
    weight = inputs[12]  # the pairs' scale: a constant of the op, whose backward returns no gradient for it
    if torch.is_tensor(weight) and weight.requires_grad:
        raise ValueError("weight (the pairs' scale) takes no gradient through the pair-loss op: pass it detached")
    _, dA, dB, dW, dc = output
    ctx.n_layers = len(dW)
    ctx.save_for_backward(dA, dB, *dW, *dc)


def no_double_backward(backend: str):
    """Raise under create_graph=True (autograd runs a backward with grad mode on only then): the
    gradients are computed outside autograd's graph (in the forward pass, or for the torch
    backend's float16 in a rerun of it) and are constants here, so a second derivative taken
    through them would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"belief_state_loss: backend {backend!r} computes its gradients outside autograd's graph "
                           f"and has no second derivative (backward with create_graph=True); use backend='reference'")


def scaled(grad_loss: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """grad_loss * g in g's dtype, the product taken in float32 at least: a 16-bit product would
    round grad_output to 16 bits first (the ops' 16-bit gradients of f and b)."""
    if g.dtype.itemsize >= 4:
        return grad_loss * g
    return (grad_loss * g.float()).to(g.dtype)


def _backward(backend, ctx, grad_loss, *_):
    # The op computed its gradients in the forward pass; the chain rule only scales them.
    no_double_backward(backend)
    dA, dB, *rest = ctx.saved_tensors
    if dA.numel() == 0:
        raise RuntimeError("the pair-loss op ran with need_grad=False: it computed no gradient to return")
    n = ctx.n_layers
    scale = functools.partial(scaled, grad_loss)
    grads = (scale(dA), scale(dB), [scale(w) for w in rest[:n]], [scale(c) for c in rest[n:]])
    # one None per argument after the tensor lists: the dispatcher drops a trailing argument left at
    # its default (meet_token=None), and needs_input_grad has the arguments it kept
    return grads + (None,) * (len(ctx.needs_input_grad) - len(grads))


def register(qualname: str, backend: str, split: bool = True):
    """Attach the fake (shapes) and autograd rules to one of the pair-loss ops (`backend`'s);
    split=False for the triton op's form (the whole head, df and db in side_grad_dtype)."""
    torch.library.register_fake(qualname)(fake if split else functools.partial(fake, split=False))
    torch.library.register_autograd(qualname, functools.partial(_backward, backend), setup_context=_setup_context)
