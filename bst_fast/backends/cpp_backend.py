"""The "cpp" backend: the C++ op bst_fast::pair_loss and its fake and autograd rules."""
from __future__ import annotations

import torch

from .. import _ext  # noqa: F401  (loads the library; TORCH_LIBRARY registers the ops)
from .._pairs import Pairs
from . import pair_loss_op


pair_loss_op.register("bst_fast::pair_loss", "cpp")


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
                                        float(next_weight), head.activation, need_grad,
                                        meet_token=p.meet_token)[0]
    return loss
