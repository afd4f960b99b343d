"""The backends of belief_state_loss behind one interface, and the registry the public function
dispatches through.

One module per backend: cpp_backend, torch_backend, triton_backend (reference.py, the executable
spec, sits at the package's top). Every backend is called as
`run(f, b, tokens, head, p, next_weight, vocab_size, compute_dtype)` with the checked pair set `p`
(`_pairs.Pairs`) and `compute_dtype` (the CUDA autocast dtype a fused engine takes for an fp32
model, or None); it returns the 0-dim loss with autograd attached. `unsupported(head, f)` says why
a backend cannot take an input (None if it can).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..head import TextHead


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


@dataclass(frozen=True)
class Backend:
    name: str
    run: Callable
    unsupported: Callable  # (head, f) -> Optional[str]
    # A fused engine: a registered op that chooses its own precision (autocast is off around it)
    # and repeats the value checks itself (so belief_state_loss skips them while compiling).
    fused: bool


def _any(head, f) -> Optional[str]:
    return None


def _fused(name):
    def unsupported(head, f):
        if not isinstance(head, TextHead):
            return f"backend={name!r} needs a TextHead; use backend='torch' for {type(head).__name__}"
        if f.dtype == torch.float64:
            return (f"backend={name!r} takes float32, float16 or bfloat16 inputs; float64 runs through "
                    "'torch' or 'reference'")
        return None
    return unsupported


def _cpu(name):
    fused = _fused(name)

    def unsupported(head, f):  # the head and dtype first: their advice ('torch') holds on any device
        if f.device.type != "cpu" and fused(head, f) is None:
            return f"backend={name!r} runs on the CPU; use backend='triton' for {f.device.type} tensors"
        return fused(head, f)
    return unsupported


def _gpu(name):
    fused = _fused(name)

    def unsupported(head, f):
        # The Triton kernels run on a CUDA GPU, or on the CPU under TRITON_INTERPRET=1 (tests).
        if not f.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and fused(head, f) is None:
            return (f"backend={name!r} runs on a CUDA device (or on the CPU under TRITON_INTERPRET=1); "
                    "use backend='cpp' on the CPU")
        return fused(head, f)
    return unsupported


def _reference(f, b, tokens, head, p, next_weight, V, compute_dtype):
    from .. import reference
    return reference.pair_loss(f, b, tokens, head, p, next_weight, V)


def _torch(f, b, tokens, head, p, next_weight, V, compute_dtype):
    from . import torch_backend
    return torch_backend.pair_loss(f, b, tokens, head, p, next_weight, V)


def _cpp(f, b, tokens, head, p, next_weight, V, compute_dtype):
    from . import cpp_backend
    return cpp_backend.pair_loss(f, b, tokens, head, p, next_weight)


def _triton(f, b, tokens, head, p, next_weight, V, compute_dtype):
    from . import triton_backend
    return triton_backend.pair_loss(f, b, tokens, head, p, next_weight, compute_dtype=compute_dtype)


REGISTRY = {
    x.name: x
    for x in (
        # every pair materialised, plain autograd (the executable spec)
        Backend("reference", _reference, _any, fused=False),
        # any head module, pairs in chunks through torch autograd
        Backend("torch", _torch, _any, fused=False),
        # the C++ pair-tile engine (CPU)
        Backend("cpp", _cpp, _cpu("cpp"), fused=True),
        # GPU: chunks of pairs, cuBLAS GEMMs with Triton gather, cross-entropy and reduction kernels
        Backend("triton", _triton, _gpu("triton"), fused=True),
    )
}


def on_device(device: torch.device):
    """Triton launches on the current CUDA device, not the tensors': make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def pick(backend: str, head, f) -> Backend:
    """The named backend, or for "auto" the fastest one that takes this head, dtype and device."""
    if backend == "auto":
        order = ("triton", "torch") if f.is_cuda else ("cpp", "torch")
        for name in order:
            if REGISTRY[name].unsupported(head, f) is None:
                return REGISTRY[name]
    if backend not in REGISTRY:
        raise ValueError(f"backend must be one of {('auto',) + tuple(REGISTRY)}, got {backend!r}")
    chosen = REGISTRY[backend]
    why = chosen.unsupported(head, f)
    if why is not None:
        raise ValueError(why)
    return chosen
