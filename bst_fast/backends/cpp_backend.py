"""The "cpp" backend: the registered ops bst_fast::pair_loss / sample_pairs, their fake and autograd rules."""
from __future__ import annotations

import torch

from .. import _C  # noqa: F401  (loads the library; TORCH_LIBRARY registers the ops)
from .._pairs import Pairs


@torch.library.register_fake("bst_fast::pair_loss")
def _pair_loss_fake(A, Bm, weights, biases, tokens, lengths, prefix_start, min_gap, max_gap,
                    row, i, j, weight, next_weight, activation, need_grad):
    if not need_grad:  # the op returns empty gradients then
        return (A.new_empty(()), A.new_empty(0), A.new_empty(0), [A.new_empty(0) for _ in weights],
                [A.new_empty(0) for _ in biases])
    return (A.new_empty(()), torch.empty_like(A), torch.empty_like(Bm),
            [torch.empty_like(w) for w in weights], [torch.empty_like(c) for c in biases])


@torch.library.register_fake("bst_fast::sample_pairs")
def _sample_pairs_fake(lengths, prefix_start, min_gap, max_gap, k, seed):
    n = torch.library.get_ctx().new_dynamic_size()
    return tuple(lengths.new_empty(n) for _ in range(3))


def _setup_context(ctx, inputs, output):
    _, dA, dB, dW, dc = output
    ctx.n_layers = len(dW)
    ctx.save_for_backward(dA, dB, *dW, *dc)


def _backward(ctx, grad_loss, *_):
    # The op computed its gradients in the forward pass; the chain rule only scales them.
    dA, dB, *rest = ctx.saved_tensors
    if dA.numel() == 0:
        raise RuntimeError("bst_fast::pair_loss ran with need_grad=False: it computed no gradient to return")
    n = ctx.n_layers
    return (grad_loss * dA, grad_loss * dB, [grad_loss * w for w in rest[:n]],
            [grad_loss * c for c in rest[n:]]) + (None,) * 12


torch.library.register_autograd("bst_fast::pair_loss", _backward, setup_context=_setup_context)


def pair_loss(f, b, tokens, head, p: Pairs, next_weight: float):
    """The cpp backend: the split first layer in torch (autograd maps dA, dB to f, b, W1, c1),
    everything per pair in the C++ engine."""
    A, Bm = head.first_layer_states(f, b, p.lengths)  # (B, L, h1) each
    weights = [layer.weight.float() for layer in head.layers[1:]]
    biases = [layer.bias.float() for layer in head.layers[1:]]
    need_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (A, Bm, *weights, *biases))
    weight = p.scale if p.row is None else p.weight
    loss = torch.ops.bst_fast.pair_loss(A, Bm, weights, biases, tokens, p.lengths, p.prefix_start,
                                        p.min_gap, p.max_gap, p.row, p.i, p.j, weight,
                                        float(next_weight), head.activation, need_grad)[0]
    return loss
