"""Launch configurations of the GPU backends, in one place.

`CHUNK_BYTES` bounds one chunk's working set in the triton backend (its H, Z and logits): the
default keeps the GEMMs' M dimension in the tens of thousands of pairs for V ~ 1000 (large enough
for full tensor-core efficiency) while peak memory stays a small fraction of the materialised
objective's. Tests shrink it (or set CHUNK_PAIRS) to put chunk boundaries everywhere.
"""
from __future__ import annotations

import triton

from . import env_mb

# BST_FAST_CHUNK_MB overrides the default budget of one chunk's working set.
# Measured on an H200 at B=32, T=256, h=512, V=1000, bf16 (bench/results/h200-run2): 128 MB ran in
# 32.3 ms at 1.3% of the naive objective's memory, 384 MB in 25.8 ms at 2.0%.
CHUNK_BYTES = env_mb("BST_FAST_CHUNK_MB", 256)
CHUNK_PAIRS = None  # an int overrides the byte budget (tests)


def chunk_config(device_type: str, V: int, widths, dtype) -> dict:
    """Chunk size and Triton block shapes for the triton backend; widths = hidden widths, h1 first."""
    es = dtype.itemsize
    # per pair: logits 2V; H of every hidden layer and Z of every one after the first (the first
    # layer's z1 = A_i + B_j is recomputed); dH and dZ of the widest; the loss row (float32)
    per_pair = es * (2 * V + sum(widths) + sum(widths[1:]) + 2 * max(widths)) + 4
    chunk = CHUNK_PAIRS or max(1, CHUNK_BYTES // per_pair)
    return dict(chunk=chunk, **gather_config(device_type, widths[0]), **ce_config(device_type, V))


def ce_config(device_type: str, V: int) -> dict:
    """Block shape of the cross-entropy kernel (kernels/cross_entropy.py) for V logits a half."""
    if device_type == "cuda":
        # at most 8 logits a thread: at 16 (BV 2048 on 4 warps, 4096 on 8) the kernel sits at 64
        # registers on sm_90 and a first form of its split logsumexp spilled there; at 8, 40-62
        BV = min(4096, triton.next_power_of_2(V))
        return dict(BV=BV, ce_warps=max(4, BV // 256))
    return dict(BV=min(16, triton.next_power_of_2(V)), ce_warps=4)  # the interpreter: every loop runs


def gather_config(device_type: str, width: int, swiglu: bool = False) -> dict:
    """Block shapes of the pair_hidden kernels (kernels/pair_hidden.py) for rows `width` wide
    (with swiglu: outputs `width` wide, SWIGLU's segment sums)."""
    if device_type == "cuda":
        # The gathers are memory-bound: 16 elements a thread (BM x BK or BS x BK over 4 warps) keeps
        # registers low enough for several blocks per SM. 64 x 128 at 4 warps spilled 360 bytes
        # (ptxas, sm_90): the int64 row offsets double the registers of every gathered element.
        # SWIGLU loads twice the tiles (gate and up): its segment sums at BS=16 take 91-127
        # registers (ptxas sm_90, Triton 3.6 / 3.9), four blocks an SM, at BS=8 47-56; its gather
        # at BM=16 94-96. Half the rows a block keeps as many elements in flight per thread as the
        # plain kernels (chosen from the registers alone: not timed on a GPU).
        rows = 8 if swiglu else 16
        return dict(BM=rows, BK=min(128, triton.next_power_of_2(width)), BS=rows, hidden_warps=4)
    # the interpreter: small blocks that still exercise every loop
    return dict(BM=16, BK=min(16, triton.next_power_of_2(width)), BS=4, hidden_warps=4)
