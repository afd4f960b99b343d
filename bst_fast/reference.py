"""The executable spec: the belief-state loss with every pair materialised, plain autograd (docs/contract.md §2-§5, §8-§10)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._pairs import Pairs, labels, pair_mask

# The backend protocol (bst_fast/backends/__init__.py): the spec takes any head, dtype and device.
NAME = "reference"
FUSED = False
HOST_PAIRS = False


def supports(head, device, dtype):
    return None


def run(f, b, tokens, head, p: Pairs, options):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), with a (pairs, 2m) input;
    lambda = options.next_weight, V = options.vocab_size (a backends.runtime.LossOptions)."""
    next_weight, vocab_size = options.next_weight, options.vocab_size
    if p.row is None:
        L = f.shape[1]
        row, i, j = pair_mask(p.lengths, p.prefix_start, p.min_gap, p.max_gap, L, p.bounds).nonzero(as_tuple=True)
        # one weight for every pair, or each row's own (row_mean)
        weight = p.scale.expand(row.shape) if p.scale.dim() == 0 else p.scale[row]
    else:
        row, i, j, weight = p.row, p.i, p.j, p.weight
    x = torch.cat([f[row, i], b[row, j]], dim=-1)  # (pairs, 2m)
    logits = head(x)  # (pairs, 2V)
    if logits.shape != (x.shape[0], 2 * vocab_size):  # as the torch backend checks it
        raise ValueError(f"the head must map (n, 2m) to (n, 2V) = ({x.shape[0]}, {2 * vocab_size}), "
                         f"got {tuple(logits.shape)}")
    acc = torch.float64 if f.dtype == torch.float64 else torch.float32
    logits = logits.to(acc)
    y_next, y_prev = labels(tokens, row, i, j, p.meet_token)
    ce_next = F.cross_entropy(logits[:, :vocab_size], y_next, reduction="none")
    ce_prev = F.cross_entropy(logits[:, vocab_size:], y_prev, reduction="none")
    per_pair = next_weight * ce_next + (1.0 - next_weight) * ce_prev
    return (weight.to(acc) * per_pair).sum()

