"""The head's activations (docs/contract.md §3) and their derivatives as Triton device functions, plus the
bf16 helpers every kernel of the package shares.

The index of each activation is its position in `_pairs.ACTIVATIONS`; torch's side of the same
table is `head.activation` / `head.activation_grad`, the C++ one `csrc/pair_loss.cpp`.
"""
import os

import torch
import triton
import triton.language as tl

from .._pairs import ACTIVATIONS

ACT = {name: k for k, name in enumerate(ACTIVATIONS)}
# No activation: the kernels then sum a pair's two rows and reduce plain gradients (the "torch"
# backend's pair sums, backends/torch_chunks.py), and skip the recompute of z.
# NO_ACT.value at a launch; NO_ACT itself in kernel code (a constexpr global).
NO_ACT = tl.constexpr(len(ACTIVATIONS))
# SwiGLU over a [gate | up] table (the residual SwiGLU head's gate/up projection): a pair's value is
# silu(g) * u with g, u its two h-wide halves' sums, h wide (the "torch" backend's gated parts).
SWIGLU = tl.constexpr(len(ACTIVATIONS) + 1)
SILU = tl.constexpr(ACT["silu"])


def interpreted_bf16(dtype) -> bool:
    """True when a bf16 kernel runs under the CPU interpreter, whose bf16 dot is wrong and whose
    float32 -> bf16 cast truncates (Triton 3.9): kernels then upcast and round by hand (UP=1)."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def act(z, ACT: tl.constexpr):
    # act(z) in float32; every activation has act(0) = 0, so zero-padded hidden units stay zero.
    if ACT == 0:
        # a NaN stays NaN, as torch.relu keeps it (tl.maximum(nan, 0) is 0: a NaN state gave a finite loss)
        return tl.where(z <= 0.0, 0.0, z)
    elif ACT == 1:
        return tl.where(z > 0, z, 0.01 * z)
    elif ACT == 2:
        return 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    elif ACT == 3:
        # 0.5 (1 + tanh(u)) = sigmoid(2u): no 1 + t cancelling in the negative tail (1 - 2 / (1 + e^{2u})
        # lost 2e-3 relative at z = -4, 5x torch's error). No clamp: far in the tail e^{-2u} is inf and
        # the value -0 (a clamp kept sigmoid at 1.8e-35, so z^3-sized terms leaked through)
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        return z / (1.0 + tl.exp(-2.0 * u))
    elif ACT == 4:
        # no clamp of e^{-z} (as gelu_tanh): a clamp at e^80 left sigmoid at 1.8e-35, so the gradient's
        # z (1 - s) s grew with z far in the tail (-1.4e-6 at z = -7.8e28, torch: -0)
        return z / (1.0 + tl.exp(-z))
    else:
        return z


@triton.jit
def act_grad(z, ACT: tl.constexpr):
    # d act / dz in float32 (relu'(0) = 0, as autograd has it).
    if ACT == 0:
        # a NaN z passes the gradient, as aten's threshold_backward does (z <= 0 selects 0)
        return tl.where(z <= 0.0, 0.0, 1.0)
    elif ACT == 1:
        return tl.where(z > 0, 1.0, 0.01)
    elif ACT == 2:
        # 0.5 (1 + erf(z / sqrt 2)) + z * phi(z), phi the standard normal density
        return 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)
    elif ACT == 3:
        # with s = sigmoid(2u) = 0.5 (1 + tanh u): 0.5 (1 - tanh^2 u) = 2 s (1 - s). In the negative tail s
        # is small and exact, 1 - s near 1; near s = 1 the rounding of 1 - s costs a few ulp(1) of a
        # derivative near 1 (16 at z = 4.96, torch's float32 9). (e^{-2u} s for 1 - s is exact everywhere, but one more live value spilled
        # prefix_grad_kernel at 168 registers on sm_90.) Where s is 0 or 1 the derivative is s (the
        # product's 0 times u' would be NaN once z^2 overflows); a NaN z keeps its NaN.
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        s = 1.0 / (1.0 + tl.exp(-2.0 * u))
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        w = s * (1.0 - s)  # 0 exactly where s is 0 or 1
        return tl.where(w == 0.0, s, s + 2.0 * z * w * du)
    elif ACT == 4:
        s = 1.0 / (1.0 + tl.exp(-z))
        return s * (1.0 + z * (1.0 - s))
    else:
        return 1.0


@triton.jit
def swiglu_grad(d, g, u):
    # d times (d silu(g) u / dg, d silu(g) u / du) in float32: head.swiglu_grad's formula
    return d * u * act_grad(g, SILU), d * act(g, SILU)


@triton.jit
def cast(x, DT: tl.constexpr, UP: tl.constexpr):
    # x (float32) as type DT. Under UP (interpreter, bfloat16) the value stays float32 and is
    # rounded to bfloat16 by hand, round-to-nearest-even as on the GPU: the interpreter's own
    # float32 -> bfloat16 cast truncates. Storing the result into a bfloat16 buffer is then exact.
    if UP:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    return x.to(DT)
