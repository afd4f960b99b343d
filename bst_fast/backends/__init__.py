"""The registry of belief_state_loss's backends: their names, their modules, and `pick`.

Every backend module (bst_fast.reference, the executable spec, and backends/cpp_backend,
torch_backend, triton_backend) has the same names:

    run(f, b, tokens, head, pairs, options) -> the 0-dim loss, with autograd attached
    supports(head, device, dtype) -> None when it takes them, else the reason it does not
    FUSED: a registered op that chooses its own precision (autocast is off around it) and repeats
           the value checks itself (so belief_state_loss skips them while compiling)
    HOST_PAIRS: its op takes a listed pair set on the host and checks the tokens itself (prepare's
           host_pairs: a subsample is then drawn and listed without reading the GPU)
    NAME: its name here

`pairs` is the checked pair set (`_pairs.Pairs`), `options` a `runtime.LossOptions` (docs/backends.md).
"""
from __future__ import annotations

NAMES = ("reference", "torch", "cpp", "triton")


def module(name: str):
    """The backend module `name`, imported on first use (the triton backend imports Triton)."""
    # import statements, not importlib: torch.compile traces belief_state_loss through here
    if name == "reference":
        from .. import reference as chosen  # every pair materialised, plain autograd (the spec)
    elif name == "torch":
        from . import torch_backend as chosen  # any head module, pairs in chunks through torch autograd
    elif name == "cpp":
        from . import cpp_backend as chosen  # the C++ pair-tile engine (CPU)
    elif name == "triton":
        # GPU: chunks of pairs, cuBLAS GEMMs with Triton gather, cross-entropy and reduction kernels
        from . import triton_backend as chosen
    else:
        raise ValueError(f"backend must be one of {('auto',) + NAMES}, got {name!r}")
    return chosen


def under_torch_func() -> bool:
    """Inside a torch.func transform (grad, vjp, vmap, jacrev, ...): the fused backends are
    autograd.Functions without functorch rules (and without a second derivative, which grad's
    create_graph asks for); the reference backend is plain autograd. Not asked while compiling."""
    import torch

    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None


def pick(backend: str, head, f):
    """The backend module named, or for "auto" the fastest one that takes this head, dtype and device
    (the reference inside a torch.func transform)."""
    if under_torch_func():
        if backend not in ("auto", "reference"):
            raise ValueError(f"backend {backend!r} cannot run inside a torch.func transform (grad, vmap, jacrev, ...): "
                             f"its fused engine has no functorch rule; use backend='reference' (or 'auto', which "
                             f"takes it there), or torch.autograd outside torch.func")
        backend = "reference"
    if backend == "auto":
        for name in ("triton", "torch") if f.is_cuda else ("cpp", "torch"):
            if module(name).supports(head, f.device, f.dtype) is None:
                return module(name)
        return module("reference")  # none of the fast ones takes it (a backward hook): every pair materialised
    chosen = module(backend)
    why = chosen.supports(head, f.device, f.dtype)
    if why is not None:
        raise ValueError(why)
    return chosen
