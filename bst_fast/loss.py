"""belief_state_loss and BeliefStateLoss: the public entry points, checking inputs and picking a backend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import _pairs
from ._checks import ArgumentTypeError, plain_number, short
from ._pairs import separated_documents  # noqa: F401  (public: the official packed layout's documents)
from .backends import NAMES, pick, runtime
from .backends.runtime import LossOptions

BACKENDS = ("auto",) + NAMES


def _vocab_size(head, m, device, dtype):
    """V from the head: its vocab_size attribute, else a probe with one zero pair in eval mode (so
    that it draws no dropout randomness and updates no running statistics)."""
    v = getattr(head, "vocab_size", None)
    if isinstance(v, int):
        return v
    # Every submodule's own mode is restored: head.train(was) would also switch back a Dropout or a
    # BatchNorm the caller had put in eval mode inside a training head.
    modes = [(module, module.training) for module in head.modules()]
    head.eval()
    try:
        with torch.no_grad():
            out = head(torch.zeros(1, 2 * m, device=device, dtype=dtype))
    finally:
        for module, training in modes:
            module.training = training
    if out.dim() != 2 or out.shape[-1] % 2:
        raise ValueError(f"head must map (..., 2m) to (..., 2V), got an output of shape {tuple(out.shape)}")
    return out.shape[-1] // 2


def _check_head_type(head):
    if not isinstance(head, nn.Module):
        raise ArgumentTypeError(f"head must be an nn.Module, got {type(head).__name__}")


def _check_head(head, f):
    _check_head_type(head)
    d = getattr(head, "d_model", None)  # TextHead's and ResidualSwiGLUHead's width m
    if isinstance(d, int) and d != f.shape[-1]:
        raise ValueError(f"head.d_model ({d}) must equal the last dimension m of f ({f.shape[-1]})")
    for name, q in head.named_parameters():
        if q.dtype != f.dtype:
            raise ValueError(f"head parameter {name} must have the dtype of f ({f.dtype}), got {q.dtype}")
        if q.device != f.device:
            raise ValueError(f"head parameter {name} must be on the device of f ({f.device}), got {q.device}")


def _no_pair_loss(f, b, head):
    """An exact 0 in the loss's dtype whose gradients are zeros of f, b and every head parameter
    that requires one (a sum over empty slices: no 0 * inf, and each parameter gets its gradient,
    as DDP waits for)."""
    parts = [f, b] + [q for q in head.parameters() if q.requires_grad]
    zero = sum(t.reshape(-1)[:0].sum() for t in parts)
    return zero.to(torch.float64 if f.dtype == torch.float64 else torch.float32)


def belief_state_loss(f: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor, head: nn.Module, *,
                      lengths=None, prefix_start=0, min_gap: int = 2, max_gap: Optional[int] = None,
                      meet_token: Optional[int] = None, documents=None, pairs=None, next_weight: float = 0.5,
                      reduction: str = "mean", generator: Optional[torch.Generator] = None,
                      backend: str = "auto", deterministic: bool = False) -> torch.Tensor:
    """The Belief State Transformer objective over prefix/suffix pairs (docs/contract.md §2-§5, §8-§10).

    Args:
        f: (B, L, m) forward-encoder states; f[r, i] has read tokens[r, :i+1].
        b: (B, L, m) backward-encoder states aligned with tokens; b[r, j] has read tokens[r, j:len_r].
        tokens: (B, L) integer token ids; labels are tokens[r, i+1] (Next) and tokens[r, j-1] (Prev).
        head: a TextHead, or (torch and reference backends) any module mapping (..., 2m) to (..., 2V).
        lengths: None, an int or (B,) valid positions per row (BOS and EOS included).
        prefix_start: an int or (B,): the first prefix position i trained on.
        min_gap, max_gap: the pair's j - i lies in [min_gap, max_gap] (both inclusive: the official
            code's exclusive bst_pair_maximum_gap G is max_gap = G - 1); min_gap >= 2, or 1 with
            meet_token; max_gap None is no limit.
        meet_token: None, or the token id in [0, V) that is both labels of a pair with j - i = 1
            (docs/contract.md §8; the official single-gap 'eos' mode is the EOS id). Needed by min_gap=1.
        documents: None (a row is one document), or packed rows (docs/contract.md §10): a (B, L) integer
            tensor of document ids, non-decreasing along each row's valid positions, a pair (i, j)
            taking both ends in one document; or a (prefix_ids, suffix_ids) pair of such tensors, a
            pair taking prefix_ids[r, i] == suffix_ids[r, j] (the official layout, where a separator
            ends one document and starts the next: `separated_documents`).
        pairs: None (all pairs), a float fraction or an int count of pairs per row (unbiased subsample,
            docs/contract.md §5), or an explicit (row, i, j) triple of int64 (n,) tensors.
        next_weight: lambda, the weight of the Next cross-entropy; Prev gets 1 - lambda.
        reduction: "mean" (divide by |P|), "sum", or "row_mean" (each row's mean over its pairs, then
            the mean over the B rows, a row with no pair adding 0: docs/contract.md §9). A batch with no
            valid pair raises for "mean" and gives 0 (zero gradients) for "sum" and "row_mean".
        generator: the torch.Generator the subsample is drawn from. Under activation checkpointing
            around this call, the recomputation draws again from the generator's later state (torch
            restores the global RNG, not a generator passed in): the gradients would then belong to
            another subsample than the loss. Pass generator=None there, or draw the (row, i, j)
            triple outside the checkpointed function.
        backend: "auto" (triton on a GPU, cpp on the CPU, torch for other heads or float64,
            reference for a head with a backward hook), "reference", "torch", "cpp" or "triton"
            (see bst_fast.backends).
        deterministic: kept for compatibility, it changes nothing: triton is always bitwise
            reproducible (no atomics), cpp for a fixed thread count; torch adds no atomics of its
            own on a GPU (in float64 it uses index_add_, atomic there).

    Returns:
        A 0-dim loss, float32 (float64 for float64 inputs); gradients reach f, b and the head's parameters.
    """
    runtime.check_environment()
    deterministic = plain_number(deterministic)
    if not isinstance(deterministic, bool):  # it changes nothing, but a typo'd value must not pass for one
        raise ArgumentTypeError(f"deterministic must be True or False, got {short(deterministic)}")
    _pairs.check_f(f)  # the head's checks read f's width and dtype
    lengths, prefix_start, min_gap, max_gap, meet_token, pairs, next_weight = map(
        plain_number, (lengths, prefix_start, min_gap, max_gap, meet_token, pairs, next_weight))
    _check_head(head, f)
    chosen = pick(backend, head, f)
    V = _vocab_size(head, f.shape[-1], f.device, f.dtype)
    p = _pairs.prepare(f, b, tokens, V, lengths=lengths, prefix_start=prefix_start, min_gap=min_gap,
                       max_gap=max_gap, pairs=pairs, next_weight=next_weight, reduction=reduction,
                       generator=generator, meet_token=meet_token, documents=documents, op_checks=chosen.FUSED,
                       host_pairs=chosen.HOST_PAIRS and runtime.SWITCHES.host_pairs,
                       device_sampler=runtime.SWITCHES.device_sampler)
    if p is None:  # reduction "sum" or "row_mean" over no pair: 0 (docs/contract.md §2)
        return _no_pair_loss(f, b, head)
    tokens = tokens.long()
    if not chosen.FUSED:
        return chosen.run(f, b, tokens, head, p, LossOptions(next_weight=next_weight, vocab_size=V))
    # The fused engines choose their own precision (docs/contract.md §6); autocast must not recast inside them.
    # Under CUDA autocast the GPU kernels take the autocast dtype for their matrix operands (fp32
    # accumulation), as the materialised head would.
    autocast_dtype = (torch.get_autocast_dtype("cuda")
                      if f.is_cuda and torch.is_autocast_enabled("cuda") else None)
    options = LossOptions(next_weight=next_weight, vocab_size=V, compute_dtype=autocast_dtype)
    with torch.autocast(device_type=f.device.type, enabled=False):
        return chosen.run(f, b, tokens, head, p, options)


class BeliefStateLoss(nn.Module):
    """Module form of belief_state_loss: holds the head and the options; forward(f, b, tokens, **overrides)."""

    def __init__(self, head: nn.Module, **options):
        super().__init__()
        bad = set(options) - {"lengths", "prefix_start", "min_gap", "max_gap", "meet_token", "documents", "pairs",
                              "next_weight", "reduction", "generator", "backend", "deterministic"}
        if bad:  # a TypeError, as the call's own unknown keyword is
            raise ArgumentTypeError(f"BeliefStateLoss got unknown options {sorted(bad)}")
        _check_head_type(head)  # now, not at the first forward
        self.head = head
        self.options = options

    def forward(self, f, b, tokens, **overrides):
        return belief_state_loss(f, b, tokens, self.head, **{**self.options, **overrides})
