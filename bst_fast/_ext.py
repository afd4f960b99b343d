"""The C++ extension, loaded once, below everything that uses it: the pair-loss engine of the cpp
backend and the pair sampler of bst_fast._pairs (both registered as torch ops by TORCH_LIBRARY)."""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library; TORCH_LIBRARY registers the ops)


@torch.library.register_fake("bst_fast::sample_pairs")
def _sample_pairs_fake(lengths, prefix_start, min_gap, max_gap, k, seed):
    n = torch.library.get_ctx().new_dynamic_size()
    return tuple(lengths.new_empty(n) for _ in range(3))
