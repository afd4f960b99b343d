"""Launch shapes of the GPU backends' Triton kernels, in one place, and the triton backend's chunk size.

The measurements behind each shape are in docs/backends.md ("Launch shapes"). Under the interpreter
(the CPU, tests) the blocks are small, so that every loop of every kernel runs.
"""
from __future__ import annotations

import torch
import triton


def chunk_config(device_type: str, V: int, widths, dtype, switches) -> dict:
    """Chunk size and Triton block shapes for the triton backend; widths = hidden widths, h1 first;
    switches: the runtime.Switches that set the chunk (its pairs, or its byte budget)."""
    es = dtype.itemsize
    # per pair: logits 2V; H of every hidden layer and Z of every one after the first (the first
    # layer's z1 = A_i + B_j is recomputed); dH and dZ of the widest; the loss row (float32)
    per_pair = es * (2 * V + sum(widths) + sum(widths[1:]) + 2 * max(widths)) + 4
    chunk = switches.chunk_pairs or max(1, switches.triton_chunk_bytes // per_pair)
    return dict(chunk=chunk, **gather_config(device_type, widths[0], "act"), **ce_config(device_type, V),
                **logits_ce_config(device_type, dtype, widths[-1]))


def logits_ce_config(device_type: str, dtype, K: int) -> dict:
    """Block shape of the last layer's GEMM with the cross-entropy in its epilogue (the switch
    fused_ce, kernels/logits_cross_entropy.py) for operands of `dtype` and K inputs: lce_BM rows by
    lce_BN logits a program's block (two accumulators of lce_BN / 2), a K-loop of lce_BK, lce_warps
    warps, lce_stages pipeline stages."""
    if device_type == "cuda":
        if dtype == torch.float32:  # full-float32 products on the FMA units (no wgmma): a small block
            return dict(lce_BM=32, lce_BN=32, lce_BK=16, lce_warps=4, lce_stages=2)
        # Two warpgroups of wgmma on two 128 x 64 float32 accumulators (64 registers a thread), the
        # epilogue's exponentials on one at a time; 3 stages of 128 x 64 tiles of H and W are 96 KB
        # of shared memory. ptxas (sm_90): 246-255 registers, no spills, so one program an SM. Per
        # pair it reads 16 KB of W and 16 KB of H from L2 (64 x 128 on 4 warps, two programs an SM,
        # would read 48 KB). Where 8 does not divide K, H's and W's rows are not 16-byte aligned and
        # the K-loop's scalar loads spilled (764 bytes at K = 30): blocks of 128 x 64 logits and
        # K-steps of 32 instead. bench/logits_ce.py times the shapes; not yet timed on a GPU.
        if K % 8:
            return dict(lce_BM=128, lce_BN=64, lce_BK=32, lce_warps=8, lce_stages=3)
        return dict(lce_BM=128, lce_BN=128, lce_BK=64, lce_warps=8, lce_stages=3)
    # the interpreter: blocks of 16 rows and 2 x 16 logits (tl.dot's smallest), so that K-loops,
    # column blocks and row blocks all take several steps at the tests' sizes
    return dict(lce_BM=16, lce_BN=32, lce_BK=16, lce_warps=4, lce_stages=1)


def hidden_grad_config(device_type: str, h: int) -> dict:
    """Block shape of a hidden layer's activation gradient with its column sums (the switch
    hidden_sums, kernels/hidden_grad.py) for a layer h wide: hg_block columns by hg_rows rows a
    step, hg_steps steps a program, hg_warps warps."""
    if device_type == "cuda":
        # 8 x 256 elements a step on 4 warps: 16 a thread, 8 KB of dH and Z in flight a program;
        # 64 rows a program, so at the paper's chunk (29k rows, h = 512) 920 programs and 0.9 MB of
        # partial sums. Not timed on a GPU yet.
        return dict(hg_rows=8, hg_block=min(256, triton.next_power_of_2(h)), hg_steps=8, hg_warps=4)
    # the interpreter: small blocks, so that row blocks, column blocks and programs all repeat
    return dict(hg_rows=2, hg_block=min(16, triton.next_power_of_2(h)), hg_steps=3, hg_warps=4)


def ce_config(device_type: str, V: int) -> dict:
    """Block shape of the cross-entropy kernel (kernels/cross_entropy.py) for V logits a half: BV
    logits a block; ce_rows rows a block on ce_warps, each half read once where ce_one and V <= BV
    (else two passes); with the column sums (ce_bias_sums, V <= BV only) ce_sum_block rows a block
    on ce_sum_warps, ce_sum_rows rows a program."""
    if device_type == "cuda":
        BV = min(4096, triton.next_power_of_2(max(V, 1)))
        # The default is the shape measured on the H100 (bench/results/nvidia-h100-80gb-hbm3): one
        # row a program, two passes over a half, at most 8 logits a thread (at 16 the kernel sat at
        # sm_90's 64-register cap). Blocks of rows read once (ce_rows > 1, ce_one) are built and
        # checked but not yet timed on a GPU: bench/cross_entropy.py sweeps them.
        # The column sums take blocks of up to 4096 logits (16 KB of bf16 in flight a program, both
        # halves), 8 logits a thread: 4 rows x 1024 on 16 warps is 92-108 registers (ptxas sm_90;
        # on 8 warps it spilled), 64 rows a program.
        block = max(1, min(16, 4096 // BV))
        return dict(BV=BV, ce_rows=1, ce_warps=max(4, BV // 256), ce_one=False, ce_sum_block=block,
                    ce_sum_warps=min(16, max(4, block * BV // 256)), ce_sum_rows=max(64, block))
    # the interpreter: a half of up to 32 logits in one block, wider ones in blocks of 16 (every loop
    # runs), blocks of 2 rows; the default GPU shape is bench/cross_entropy.py's and the kernel test's
    BV = triton.next_power_of_2(V) if V <= 32 else 16
    return dict(BV=BV, ce_rows=2, ce_warps=4, ce_one=True, ce_sum_block=2, ce_sum_warps=4, ce_sum_rows=6)


SEGMENT_KINDS = ("sum", "act", "swiglu")


def gather_config(device_type: str, width: int, kind: str) -> dict:
    """Block shapes of the pair_hidden kernels (kernels/pair_hidden.py) for rows `width` wide (for
    "swiglu": outputs `width` wide). `kind` is what the segment sums read per slot besides dH:
    "sum" nothing (NO_ACT), "act" the other side's row (an activation's z), "swiglu" its two
    halves. BM, BK, hidden_warps shape the forward gather; BS, seg_BK, seg_warps the segment sums
    of a listed pair list; block_* structured_grad_kernel's (a structured list: block_BO own
    positions by block_BK units a program, the walk cut into pieces for about block_programs
    programs, each piece at least block_min_steps long)."""
    if kind not in SEGMENT_KINDS:
        raise ValueError(f"kind must be one of {SEGMENT_KINDS}, got {kind!r}")
    if device_type == "cuda":
        # The forward gather is memory-bound and fully parallel: 16 elements a thread (BM x BK over
        # 4 warps) keeps registers low enough for several blocks per SM (the int64 row offsets
        # double the registers of every gathered element); SWIGLU loads twice the tiles: BM=8.
        rows = 8 if kind == "swiglu" else 16
        # A segment sum is a serial loop over a segment's slots per program, bound by the latency of
        # its dependent loads (slot -> the other side's row index -> its row): more programs
        # resident and more rows a loop step pay, so "act" and "swiglu" run 32 x 64 on 2 warps.
        # Plain sums keep 16 x 128 on 4 warps: the objectives that use them measured faster so.
        seg = (16, 128, 4) if kind == "sum" else (32, 64, 2)
        # The structured kernel holds its own rows' z (and SWIGLU's up half) and the sums in
        # registers, BO x BK each: 16 elements a thread per table on 4 warps, SWIGLU's four tables
        # at BO = 16. Its walk has no dependent loads but the suffix side's three scalars, so a
        # program streams BO rows of dH a step. ~1024 programs fill a 132-SM H100 once or twice (4
        # resident an SM at 96-126 registers, 8 for plain sums), the walks cut into pieces where a
        # chunk has fewer. On the H100 its best shape took 0.195 ms a chunk (pairs-a, both sides)
        # against the listed kernels' 0.126 (bench/segment_sums.py --structured): the switch is off.
        return dict(BM=rows, BK=min(128, triton.next_power_of_2(width)), hidden_warps=4,
                    BS=seg[0], seg_BK=min(seg[1], triton.next_power_of_2(width)), seg_warps=seg[2],
                    block_BO=16 if kind == "swiglu" else 32, block_BK=min(64, triton.next_power_of_2(width)),
                    block_warps=4, block_programs=1024, block_min_steps=16)
    # the interpreter: small blocks that still exercise every loop, and walks in pieces
    return dict(BM=16, BK=min(16, triton.next_power_of_2(width)), hidden_warps=4,
                BS=4, seg_BK=min(16, triton.next_power_of_2(width)), seg_warps=4,
                block_BO=4, block_BK=min(16, triton.next_power_of_2(width)), block_warps=4, block_programs=64,
                block_min_steps=2)
