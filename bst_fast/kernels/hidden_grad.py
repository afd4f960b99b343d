"""A hidden layer's activation gradient with its bias gradient's column sums, in one pass (the triton
backend's switch hidden_sums).

For a chunk's hidden layer k with pre-activation Z (n, h) (or, for relu, the activation's output
H: relu'(z) = [h > 0] = [z > 0]) and the gradient dH of its output:

    dH[r, c] <- round(dH[r, c] * act'(Z[r, c]))                  (dZ, in place, float32 math)
    dc_part[p, c] <- sum over the program's rows of dZ[r, c]     (as rounded, in float32)

so the layer's bias gradient is dc_part's column sum over programs, and no second pass re-reads dZ
(torch's column sum, which the backward otherwise runs after aten's activation backward).

A program takes BH columns and STEPS blocks of BR rows; every output has one writer, in a fixed
order (no atomics: bitwise reproducible).

Cost model per pair (h the layer's width, es its dtype's bytes): read 2 h es (dH and Z), write
h es; 12 to 40 FLOPs an element by activation (erf-GELU the most); h / (BR STEPS) * 4 bytes of
partial sums. Unfused: aten's backward reads 2 h es and writes h es, and the column sum reads h es
again (at the paper's chunk, n ~ 29k and h = 512: 30 MB a pass, ~11 us at 2.8 TB/s; torch's column
sums of the BST-original step ran at about 1.4 TB/s on the H100). Not timed on a GPU yet.
"""
import torch
import triton
import triton.language as tl

from .activation import act_grad, cast


@triton.jit
def act_grad_sums_kernel(dH, Z, dc_part, n, h, ldd, ldz, ACT: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr,
                         STEPS: tl.constexpr, VEC: tl.constexpr, UP: tl.constexpr):
    # Program (pr, ph): columns ph * BH + [0, BH), rows (pr * STEPS + st) * BR + [0, BR), st < STEPS.
    # h, ldd and ldz arrive divided by VEC (8 where it divides them all, else 1): Triton's launcher
    # marks only multiples of 16, and h = 200 rows of 16-bit values still move as 16-byte vectors.
    h, ldd, ldz = h * VEC, ldd * VEC, ldz * VEC
    pr = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    cm = cols < h
    acc = tl.zeros((BH,), dtype=tl.float32)
    for st in range(STEPS):
        r = (pr * STEPS + st) * BR + tl.arange(0, BR)
        m = (r < n)[:, None] & cm[None, :]
        g = tl.load(dH + r[:, None] * ldd + cols[None, :], mask=m, other=0.0).to(tl.float32)
        z = tl.load(Z + r[:, None] * ldz + cols[None, :], mask=m, other=0.0).to(tl.float32)
        if ACT == 0:  # relu as aten's threshold_backward selects: a NaN or inf gradient of a dead unit is 0
            d = cast(tl.where(z <= 0, 0.0, g), dH.dtype.element_ty, UP)
        else:
            d = cast(g * act_grad(z, ACT), dH.dtype.element_ty, UP)
        tl.store(dH + r[:, None] * ldd + cols[None, :], d, mask=m)
        acc += tl.sum(tl.where(m, d.to(tl.float32), 0.0), axis=0)
    tl.store(dc_part + pr * h + cols, acc, mask=cm)


def hidden_grad_programs(n: int, cfg) -> int:
    """Rows of partial sums act_grad_sums_ writes for n rows: one a program's hg_rows * hg_steps rows."""
    return triton.cdiv(n, cfg["hg_rows"] * cfg["hg_steps"])


def act_grad_sums_(dH, Z, act_id: int, dc_part, cfg, up):
    """dH (n, h) <- dH * act'(Z) in place (rounded once to dH's dtype), and dc_part[p] (a float32
    (>= hidden_grad_programs(n, cfg), h) buffer, contiguous) <- the column sums of program p's rows of
    it; returns dc_part[:programs], whose sum over rows is the layer's bias gradient. Z: the
    pre-activation (or relu's output), dH's shape and dtype; both with contiguous rows. act_id: the
    activation's index (kernels.activation.ACT); cfg: launch.hidden_grad_config's shapes."""
    if dH.dim() != 2 or dH.stride(1) != 1 or Z.shape != dH.shape or Z.stride(1) != 1 or Z.dtype != dH.dtype:
        raise ValueError(f"act_grad_sums_: dH and Z must be matrices of one shape and dtype with contiguous rows, got "
                         f"dH {dH.dtype} {tuple(dH.shape)} strides {dH.stride()}, Z {Z.dtype} {tuple(Z.shape)} "
                         f"strides {Z.stride()}")
    n, h = dH.shape
    programs = hidden_grad_programs(n, cfg)
    if (dc_part.dtype != torch.float32 or dc_part.device != dH.device or dc_part.dim() != 2
            or dc_part.stride() != (h, 1) or dc_part.shape[0] < programs or dc_part.shape[1] != h):
        raise ValueError(f"act_grad_sums_: dc_part must be a contiguous float32 ({programs} or more, {h}) buffer on "
                         f"{dH.device}, got {dc_part.dtype} {tuple(dc_part.shape)} strides {dc_part.stride()} on "
                         f"{dc_part.device}")
    vec = 8 if h % 8 == 0 and dH.stride(0) % 8 == 0 and Z.stride(0) % 8 == 0 else 1
    if n:
        act_grad_sums_kernel[(programs, triton.cdiv(h, cfg["hg_block"]))](
            dH, Z, dc_part, n, h // vec, dH.stride(0) // vec, Z.stride(0) // vec, ACT=act_id, BR=cfg["hg_rows"],
            BH=cfg["hg_block"], STEPS=cfg["hg_steps"], VEC=vec, UP=up, num_warps=cfg["hg_warps"])
    return dc_part[:programs]
