"""What every backend takes at run time besides the tensors and the pair set.

The options of a run (`LossOptions`), the process's runtime switches (`Switches`, read once from the
environment into `SWITCHES`), and the CUDA device guard of Triton launches. It imports no other
module of the package, so that any (the heads' split_linear too) can read the switches.

`SWITCHES` is the one place the switches live: tests and benchmarks change them with `switched`
(or monkeypatch `runtime.SWITCHES`); a `LossOptions` made without switches takes the ones in force.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import typing
from dataclasses import dataclass
from typing import Optional

import torch


def env_mb(name: str, default: float) -> int:
    """Bytes from the environment variable `name`, in MB (a positive number), else `default` MB."""
    text = os.environ.get(name)
    try:
        mb = default if text is None else float(text)
    except ValueError:
        mb = None
    if mb is None or not mb > 0 or mb == float("inf"):
        raise ValueError(f"{name} must be a positive number of MB, got {text!r}")
    return max(1, int(mb * 2**20))


def env_flag(name: str) -> bool:
    """The environment variable `name` as a switch: unset or "0" is off, "1" is on."""
    text = os.environ.get(name, "0")
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def env_count(name: str) -> int:
    """The environment variable `name` as a count: unset is 0, else an int >= 0."""
    text = os.environ.get(name, "0")
    if not text.isdigit():
        raise ValueError(f"{name} must be an int >= 0, got {text!r}")
    return int(text)


# The least value of each int switch (0 for any other).
SWITCH_LOWEST = {"triton_chunk_bytes": 1, "torch_chunk_bytes": 1, "torch_cpu_chunk_bytes": 1, "chunk_pairs": 1}


def switch_kind(field, cls=None) -> tuple:
    """("bool" or "int", whether None is allowed) of a field of Switches (or of `cls`, a subclass),
    from its type hint (resolved, so that a string annotation and a typing object read alike)."""
    hint = _switch_hints(cls or Switches)[field.name]
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), None) if optional and len(args) == 2 else hint
    if base not in (bool, int):
        raise TypeError(f"Switches.{field.name}: a switch is a bool or an int (or Optional of one), not {hint}")
    return base.__name__, optional


@functools.lru_cache(maxsize=None)
def _switch_hints(cls) -> dict:
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Switches:
    """How the chunked backends run; none changes what they compute (docs/backends.md)."""

    # Bytes of one triton-backend chunk's working set (its H, Z and logits), BST_FAST_CHUNK_MB: GEMMs
    # of tens of thousands of pairs at a small fraction of the materialised objective's memory.
    triton_chunk_bytes: int = 256 * 2**20
    # Bytes of one torch-backend chunk's pair values and logits on a GPU, BST_FAST_TORCH_CHUNK_MB: 52k
    # pairs of a TextHead with h=512 at V=1000 in bf16, 23k of the SwiGLU head at m=512.
    torch_chunk_bytes: int = 256 * 2**20
    # The same on the CPU, where a smaller chunk stays in cache.
    torch_cpu_chunk_bytes: int = 16 * 2**20
    # A fixed number of pairs per chunk instead of the byte budgets, in both chunked backends (tests).
    chunk_pairs: Optional[int] = None
    # A fixed number of rows in a window of per-position tables (the triton backend's first layer,
    # triton_backend._FirstLayer; the torch backend's parts) instead of window_rows' rule (tests:
    # windows that move often). A window still holds at least one chunk's rows.
    window_rows: Optional[int] = None
    # The torch backend's chunk engine (backends/torch_chunks.py): None takes the Triton kernels for
    # CUDA tensors, True forces them (the CPU through TRITON_INTERPRET=1, tests), False the torch ops.
    # float64 always takes the torch ops.
    triton_ops: Optional[bool] = None
    # torch.compile the torch backend's per-pair tail, forward and backward (BST_FAST_TORCH_COMPILE=1):
    # off, since compiling takes seconds and was not measured faster by enough to pay for it.
    compile_tail: bool = False
    # A swiglu part (head.PairParts.swiglu) as one fused step: silu(gate) * up formed by the pair-sum
    # engine from the float32 sums, its gradient from recomputed sums. Off
    # (BST_FAST_TORCH_UNFUSED_SWIGLU=1): gate and up summed apart, rounded, then torch's silu and mul,
    # kept to measure against the fused step.
    fused_swiglu: bool = True
    # The triton backend's bias gradients as one more output column of the weight gradients' GEMMs
    # ([H | 1]: no separate column sum re-reading each chunk's logits gradient), BST_FAST_BIAS_IN_GEMM=1.
    # Off: 1.015x on the H100 (bench/results/nvidia-h100-80gb-hbm3/levers.md), within noise.
    bias_in_gemm: bool = False
    # The triton backend's last layer with each half of the vocabulary padded with zero rows to a
    # multiple of this (0: none), BST_FAST_VOCAB_PAD: V = 1000 fills no 128- or 256-wide GEMM tile,
    # 1024 does. Off: 0.976x (128) and 0.969x (256) on the H100.
    vocab_pad: int = 0
    # The segment sums of an all-pairs list by structured_grad_kernel (PairList.jlo, alo): a program
    # owns a block of positions and walks the other side by arithmetic, one load of a block of dH
    # rows a step, instead of a segment a program through ib / perm / ia and a binary search,
    # BST_FAST_STRUCTURED_SUMS=1. Off: 0.938x on the H100, where the listed kernels are already fast.
    structured_sums: bool = False
    # The triton backend's cross-entropy also writing the column sums of the gradient as partial
    # rows (blocks of rows, each half read once): the last layer's bias gradient without a column
    # sum over the (n, 2V) gradient (V <= 4096), BST_FAST_CE_BIAS_SUMS=1. Its first form (16 rows a
    # program one at a time) was 0.893x on the H100; the current one is not timed yet: off.
    ce_bias_sums: bool = False
    # Subsampled pairs of rows without documents drawn on the tensors' device (_device_sampler.sample_on_device)
    # instead of by the C++ sampler on the host, BST_FAST_DEVICE_SAMPLER=1. Off: 0.895x against the
    # C++ sampler at pairs=0.02 on the H100 (B = 32).
    device_sampler: bool = False
    # The triton backend's last layer as one kernel: its GEMM with the cross-entropy and the bias
    # gradient's column sums in the epilogue (kernels/logits_cross_entropy.py), BST_FAST_FUSED_CE=1.
    # It replaces the logits GEMM, the cross-entropy kernel and the column sum; not timed on a GPU yet: off.
    fused_ce: bool = False
    # The triton backend's relu hidden layers with the activation in the GEMM's epilogue (cuBLASLt's,
    # torch._addmm_activation), BST_FAST_RELU_IN_GEMM=1: no separate relu pass, and the gradient
    # reads the activation's output in place of the pre-activation. cuBLASLt's epilogue may turn a NaN
    # pre-activation into 0 where torch.relu keeps it (not checked on a GPU). Not timed yet: off.
    relu_in_gemm: bool = False
    # The triton backend's hidden layers' activation gradient and their bias gradients' column sums
    # in one kernel (kernels/hidden_grad.py), BST_FAST_HIDDEN_SUMS=1. Not timed on a GPU yet: off.
    hidden_sums: bool = False
    # A listed pair set (a subsample, or explicit pairs on the CPU) resolved on the host where the
    # lengths are host-known: drawn, checked and listed with no device sync (prepare's host_pairs,
    # docs/backends.md "Host pair lists"). On: it only removes synchronisations; not timed on a GPU
    # yet. BST_FAST_DEVICE_PAIR_LIST=1 lists it on the device as before, to time the two.
    host_pairs: bool = True
    # The split first layer's GEMMs (head.split_linear: A = f W1f^T + c1, B = b W1b^T and their
    # gradients) with 16-bit operands, the unsplit layer's compute dtype, and float32 accumulation
    # and result (float16: the forward's only), BST_FAST_SPLIT_16BIT=1. Off: float32 operands,
    # float32 GEMMs (not the tensor cores'; no TF32 unless the user allows it): at the paper's shape
    # about 0.3 TFLOP a step for the MLP head and 5 for the SwiGLU head's gate_up (8192 wide). Not
    # timed on a GPU yet.
    split_16bit: bool = False

    def __post_init__(self):
        # switched(), a test or a benchmark's --variant set them in code: a -4 vocab_pad failed deep in
        # the backend, and a chunk_pairs of -1 ran one pair a chunk, silently (review helper-102).
        # Each field by its annotation: bool, int (>= SWITCH_LOWEST's bound, else 0) or Optional of one.
        for f in dataclasses.fields(self):
            kind, optional = switch_kind(f, type(self))
            value = getattr(self, f.name)
            if value is None and optional:
                continue
            # numpy's bools and ints (and a 0-d integer tensor) as Python's
            if kind == "bool" and type(value).__name__ in ("bool_", "bool"):
                value = bool(value)
            elif kind == "int" and not isinstance(value, bool):
                try:
                    value = operator.index(value)
                except TypeError:
                    pass
            lowest = SWITCH_LOWEST.get(f.name, 0)
            ok = isinstance(value, bool) if kind == "bool" else \
                isinstance(value, int) and not isinstance(value, bool) and value >= lowest
            if not ok:
                want = "True or False" if kind == "bool" else f"an int >= {lowest}"
                none = ("None, " if kind == "bool" else "None or ") if optional else ""
                raise ValueError(f"switch {f.name} must be {none}{want}, got {value!r}")
            object.__setattr__(self, f.name, value)

    @classmethod
    def from_environment(cls) -> "Switches":
        return cls(triton_chunk_bytes=env_mb("BST_FAST_CHUNK_MB", 256),
                   torch_chunk_bytes=env_mb("BST_FAST_TORCH_CHUNK_MB", 256),
                   compile_tail=env_flag("BST_FAST_TORCH_COMPILE"),
                   fused_swiglu=not env_flag("BST_FAST_TORCH_UNFUSED_SWIGLU"),
                   bias_in_gemm=env_flag("BST_FAST_BIAS_IN_GEMM"),
                   vocab_pad=env_count("BST_FAST_VOCAB_PAD"),
                   structured_sums=env_flag("BST_FAST_STRUCTURED_SUMS"),
                   ce_bias_sums=env_flag("BST_FAST_CE_BIAS_SUMS"),
                   device_sampler=env_flag("BST_FAST_DEVICE_SAMPLER"),
                   fused_ce=env_flag("BST_FAST_FUSED_CE"),
                   relu_in_gemm=env_flag("BST_FAST_RELU_IN_GEMM"),
                   hidden_sums=env_flag("BST_FAST_HIDDEN_SUMS"),
                   host_pairs=not env_flag("BST_FAST_DEVICE_PAIR_LIST"),
                   split_16bit=env_flag("BST_FAST_SPLIT_16BIT"))


# The switches in force: the environment's, read once when bst_fast is imported. A bad value does not
# fail the import (the CLI could not report it as its one-line error): SWITCHES is then left unset, and
# its first use (or check_environment, which the CLI, train and belief_state_loss call first) raises it.
try:
    SWITCHES, _ENVIRONMENT_ERROR = Switches.from_environment(), None
except ValueError as _e:
    _ENVIRONMENT_ERROR = _e


def check_environment():
    """Raises the ValueError of a BST_FAST_* variable that bst_fast's import found bad."""
    if _ENVIRONMENT_ERROR is not None:
        raise ValueError(str(_ENVIRONMENT_ERROR))


def __getattr__(name):  # runtime.SWITCHES, or `from runtime import SWITCHES`, under a bad environment
    if name == "SWITCHES":
        check_environment()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def switched(**changes):
    """Runs the block with SWITCHES changed as named (Switches' fields), then restores them."""
    global SWITCHES
    check_environment()
    old = SWITCHES
    SWITCHES = dataclasses.replace(old, **changes)
    try:
        yield SWITCHES
    finally:
        SWITCHES = old


def window_rows(B: int, per_row: int, budget: int, switches: Switches) -> int:
    """Rows of a window of per-position tables of `per_row` bytes a row (a backend's split first
    layer or parts, and their gradient sums): switches.window_rows if set, else a sixteenth of the
    chunk budget's bytes, or a sixteenth of the batch if more, so that a batch takes at most about
    sixteen windows (each some launches and a few GEMMs over its rows)."""
    if switches.window_rows is not None:
        return switches.window_rows
    return max(1, -(-B // 16), budget // 16 // max(1, per_row))


def _switches_in_force() -> Switches:
    check_environment()
    return SWITCHES


@dataclass(frozen=True)
class LossOptions:
    """What a backend's run takes besides f, b, tokens, the head and the pair set."""

    next_weight: float  # lambda: the Next cross-entropy's weight, Prev's 1 - lambda
    vocab_size: int  # V: the head's output is 2V logits, Next first
    # The matrix operands' dtype of a fused engine (the CUDA autocast dtype for an fp32 model), or None:
    # the inputs' dtype. The other backends leave precision to the head and autocast.
    compute_dtype: Optional[torch.dtype] = None
    switches: Switches = dataclasses.field(default_factory=_switches_in_force)


def on_device(device: torch.device):
    """Triton launches on the current CUDA device, not the tensors': make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
