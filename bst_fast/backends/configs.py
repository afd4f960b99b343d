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
    return dict(chunk=chunk, **gather_config(device_type, widths[0], "act"), **ce_config(device_type, V))


def ce_config(device_type: str, V: int) -> dict:
    """Block shape of the cross-entropy kernel (kernels/cross_entropy.py) for V logits a half."""
    if device_type == "cuda":
        # at most 8 logits a thread: at 16 (BV 2048 on 4 warps, 4096 on 8) the kernel sits at 64
        # registers on sm_90 and a first form of its split logsumexp spilled there; at 8, 40-62
        BV = min(4096, triton.next_power_of_2(V))
        return dict(BV=BV, ce_warps=max(4, BV // 256))
    return dict(BV=min(16, triton.next_power_of_2(V)), ce_warps=4)  # the interpreter: every loop runs


SEGMENT_KINDS = ("sum", "act", "swiglu")


def gather_config(device_type: str, width: int, kind: str) -> dict:
    """Block shapes of the pair_hidden kernels (kernels/pair_hidden.py) for rows `width` wide (for
    "swiglu": outputs `width` wide). `kind` is what the segment sums read per slot besides dH:
    "sum" nothing (NO_ACT), "act" the other side's row (an activation's z), "swiglu" its two
    halves. BM, BK, hidden_warps shape the forward gather; BS, seg_BK, seg_warps the segment sums."""
    if kind not in SEGMENT_KINDS:
        raise ValueError(f"kind must be one of {SEGMENT_KINDS}, got {kind!r}")
    if device_type == "cuda":
        # The forward gather is memory-bound and fully parallel: 16 elements a thread (BM x BK over
        # 4 warps) keeps registers low enough for several blocks per SM; it wrote H at ~900 GB/s
        # on an H200 while reading its rows from L2. 64 x 128 at 4 warps spilled 360 bytes (ptxas,
        # sm_90): the int64 row offsets double the registers of every gathered element. SWIGLU
        # loads twice the tiles (gate and up): BM=8.
        rows = 8 if kind == "swiglu" else 16
        # A segment sum is a serial loop over a segment's slots per program, bound by the latency of
        # its dependent loads (slot -> the other side's row index -> its row): what pays is more
        # programs resident and more rows a loop step. On an H200 (bench/results/h200-run4), prefix +
        # suffix sums per chunk, kernels alone (bench/segment_sums.py): SWIGLU 0.48-0.55 ms at
        # BS=32 x 64 on 2 warps against 1.45-1.48 at the old 8 x 128 on 4, and the SwiGLU head's
        # torch-backend objective 90.9 ms against 134.6 side by side; "act" (a TextHead's gelu in
        # the triton backend) 0.19 against 0.29 ms, its objective 27.2 against 28.2 ms. 8 warps
        # were slowest everywhere, a pipelined loop (num_stages 3) no faster. Plain sums ("sum")
        # keep 16 x 128 on 4 warps: 64 x 32 on 2 halved the kernels alone (0.13 against 0.25 ms),
        # yet the objectives that use them ran slower with it in both side-by-side runs (TextHead
        # through the torch backend 32.3 against 27.7 ms and 27.4 against 26.3; cause not found).
        seg = (16, 128, 4) if kind == "sum" else (32, 64, 2)
        return dict(BM=rows, BK=min(128, triton.next_power_of_2(width)), hidden_warps=4,
                    BS=seg[0], seg_BK=min(seg[1], triton.next_power_of_2(width)), seg_warps=seg[2])
    # the interpreter: small blocks that still exercise every loop
    return dict(BM=16, BK=min(16, triton.next_power_of_2(width)), hidden_warps=4,
                BS=4, seg_BK=min(16, triton.next_power_of_2(width)), seg_warps=4)
