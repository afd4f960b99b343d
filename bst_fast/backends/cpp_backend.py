"""The "cpp" backend: the C++ op bst_fast::pair_loss and its fake and autograd rules."""
from __future__ import annotations

import torch

from .. import _ext  # noqa: F401  (loads the library; TORCH_LIBRARY registers the ops)
from .._pairs import Pairs
from . import pair_loss_op
from .pair_loss_op import fused_problem
from .runtime import LossOptions

NAME = "cpp"
FUSED = True
HOST_PAIRS = False  # a CPU op: its pair set is on the host anyway

if _ext.LOAD_ERROR is None:
    pair_loss_op.register("bst_fast::pair_loss", NAME)


def supports(head, device: torch.device, dtype: torch.dtype):
    missing = _ext.problem(f"backend={NAME!r}")
    if missing is not None:  # auto then takes the torch backend
        return missing
    # the head and dtype first: their advice ('torch') holds on any device
    problem = fused_problem(NAME, head, dtype)
    if problem is None and device.type != "cpu":
        advice = {"cuda": "; use backend='triton' for cuda tensors", "meta": ""}.get(device.type, "; use backend='torch'")
        return f"backend={NAME!r} runs on the CPU, got {device.type} tensors{advice}"
    return problem


def run(f, b, tokens, head, pairs: Pairs, options: LossOptions):
    """The split first layer in torch, everything per pair in the C++ engine (float32 layers)."""
    args = pair_loss_op.text_head_arguments(f, b, tokens, head, pairs, options.next_weight, torch.float32)
    return torch.ops.bst_fast.pair_loss(*args, meet_token=pairs.meet_token)[0]
