"""The "torch" backend: any head module, all pairs in large chunks across rows, each chunk's head
graph built by torch autograd, differentiated and freed before the next. On CUDA it runs the triton
backend's Triton kernels for the pair sums, their gradients and the cross-entropy (the chunk engine
torch_chunks.TritonOps): "torch" names what computes the head, torch autograd over any module, not
the per-pair work around it.

The pair set is one sorted flat list on the device (`_pairs.pair_list`: ia = row * L + i,
ib = row * L + j, built once without a loop over rows), cut into chunks of `chunk_pairs` pairs: no
host synchronisation per chunk. The head's work splits into parts computed once per position and a
per-pair tail (`pair_parts`, see head.py): TextHead splits its first layer, ResidualSwiGLUHead its
gate/up projection (a swiglu part); any other head gets [f ; 0] and [0 ; b], whose pair sum is
[f_i ; b_j], and so does one of ours changed so that its split no longer says what it computes
(head.split_changes: a subclass's forward, an adapter, a forward hook). Per chunk of n pairs, for each part (P, Q) of width w, and with es the logits' bytes:

    x      = P[ia] + Q[ib]                (n, w): summed in float32 (float64), rounded once to the
             part's dtype (_PairSum); for a swiglu part [gate | up], x = silu(gate) * up (n, w/2)
             from the float32 sums, rounded once (Switches.fused_swiglu; off: gate and up apart,
             then torch)
    logits = tail(x, ...)                 (n, 2V): the head's per-pair work, built by autograd
    CE     = float32 (float64) logsumexp; the logits become w·(softmax - onehot) in place
    grads  = autograd.grad(logits, parameters, that gradient); on the way back each pair sum adds
             x's gradient into the float32 (float64) d[P ; Q] itself: no per-chunk gradient of P or
             Q is made
    dparam += grads                       float32 (float64 for float64)

The pair sums, their gradients and the cross-entropy are a chunk engine's (backends/torch_chunks.py:
the Triton kernels for CUDA tensors, torch ops on the CPU and in float64).

The parts are made a window of rows at a time, not for the batch: the chunks are grouped into
windows of about runtime.window_rows rows (a sixteenth of the chunk budget's bytes of tables and
gradient sums, or a sixteenth of the batch if more; one chunk's rows if more), and for each the
head's pair_parts runs on its rows of f and b (under autograd), its chunks run, and its gradient
sums d[P ; Q] are then mapped at once through the parts' graph (the head's own backward) to f, b
and the split parameters, and dropped. (The SwiGLU head's float32 [gate | up] tables and sums are
16 * 8192 bytes a position at m = 768: 8.7 GB for a batch of 256 rows of 258.) A row that one chunk
ends in and the next begins in lies in two windows: its parts are made twice (at most one row a
window more of the split products) and its sums mapped in two pieces, which add. In float16 the
head's backward rounds what it maps to float16 before grad_output (a loss scale) reaches it, so the
sums are mapped twice, in units that keep each result near 1: for the split parameters the
window's total pair weight (their gradients are then weighted means of per-pair terms), for f and
b L times the weights' geometric mean of largest (wscale) and average (a position's sum has at
most L pairs: with equal weights wscale * L; with rows of unequal weight, row_mean's, the heavy
rows' and the light rows' sums equally far above and below 1). Tiny pair weights would fall to
subnormals in true units, and a window's parameter sums past 65504 in the side's units. Where the
largest result still lies below 2**-4 (terms of random sign average out) or overflowed, the window
is mapped again in units read from it (_mapped_float16: one synchronisation a window).

A chunk holds about the switches' byte budget in the per-pair tensors the backend makes: the parts'
values and the logits (the head's own intermediates come on top: for the SwiGLU head about twice as
much). Every part counts, not only the widest: the SwiGLU head's residual and SwiGLU output are each
narrower than its logits, but together wider.

The loss is the graph's last node, so the forward computes every gradient, those of f, b and the
split weights included, and the backward only scales them by grad_output (f's and b's are kept in
pair_loss_op.side_grad_dtype's dtype, as the triton op keeps them). The cross-entropy's gradient
carries the true pair weights, except in fp16, where they are divided by the largest one and the
chunk scaled (see the chunk loop) against underflow and overflow, both multiplied back in the
float32 accumulators. fp16 computes its gradients in the backward instead, where grad_output (a
GradScaler's loss scale) is known and sets the chunks' scale: the forward computes the loss alone,
and the backward runs it again with its gradients, from the forward's RNG state and under its
autocast (_ChunkedLoss; the loss's forward work once more, in fp16 only).
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from .._pairs import Pairs, pair_list
from ..head import PairParts, concat_parts, has_backward_hooks, split_changes, swiglu
from . import pair_loss_op, runtime
from .pair_loss_op import no_double_backward
from .runtime import LossOptions, Switches, on_device
from .torch_chunks import TritonOps, engine

NAME = "torch"
FUSED = False
HOST_PAIRS = False

# Named settings of this backend, for benchmarks and checks that time or test them side by side.
VARIANTS = {"torch": dict(compile_tail=False, fused_swiglu=True),
            "torch+compile": dict(compile_tail=True, fused_swiglu=True),
            "torch+unfused": dict(compile_tail=False, fused_swiglu=False)}


@contextlib.contextmanager
def variant(name: str):
    """Runs the block with this backend's settings VARIANTS[name] in force (runtime.switched)."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    with runtime.switched(**VARIANTS[name]):
        yield


def supports(head, device: torch.device, dtype: torch.dtype):
    """Any head module, dtype and device, but a head with a backward hook: the gradients are made
    inside the loss's forward, where such a hook cannot run (autograd refuses it, obscurely)."""
    if has_backward_hooks(head):
        return ("backend='torch' computes the head's gradients inside the loss's forward, where a backward hook "
                "registered on the head cannot run; use backend='reference'")
    return None


def _call_tail(tail, xs):
    return tail(xs)


@functools.lru_cache(maxsize=None)
def _compiled_tail():
    # One compiled trampoline: Dynamo inlines each head's tail and guards on it, so a new tail closure
    # per call (pair_parts makes one) hits the cache. Two graphs: one at the full chunk's pair count
    # and, from the first other count (the last chunk), one with a dynamic count; a new head, dtype or
    # autocast state compiles anew.
    return torch.compile(_call_tail)


def _budget(device: torch.device, switches: Switches) -> int:
    """A chunk's byte budget on `device`."""
    return switches.torch_chunk_bytes if device.type != "cpu" else switches.torch_cpu_chunk_bytes


def chunk_pairs(per_pair_bytes: int, device: torch.device, switches: Switches) -> int:
    """Pairs per chunk: switches.chunk_pairs if set, else the byte budget over the bytes per pair."""
    if switches.chunk_pairs is not None:
        return int(switches.chunk_pairs)
    return max(1, _budget(device, switches) // max(1, per_pair_bytes))


class _SavedStorages:
    """Records the storages autograd saves while a graph is built: the logits may be overwritten
    with their own gradient only if no backward node reads them."""

    def __init__(self):
        self.ptrs = set()

    def pack(self, t):
        try:
            self.ptrs.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # no plain storage: assume it may be the logits
            self.ptrs.add(None)
        return t

    def holds(self, t) -> bool:
        return None in self.ptrs or t.untyped_storage().data_ptr() in self.ptrs


class _PairSum(torch.autograd.Function):
    """x_k of a chunk (ops.gather); the backward adds x's gradient, times `scale`, into the part's
    accumulator itself (ops.add_grad) and returns none. `what`: "sum" (the part's pair sum),
    "gate" or "up" (one half of a swiglu part's sum), "swiglu" (swiglu of both). `token` (a leaf
    that requires grad) puts this node in the graph."""

    @staticmethod
    def forward(ctx, token, ops, k, chunk, scale, what):
        ctx.ops, ctx.k, ctx.chunk, ctx.scale, ctx.what = ops, k, chunk, scale, what
        return ops.gather(k, chunk, what)

    @staticmethod
    def backward(ctx, grad):
        ctx.ops.add_grad(ctx.k, ctx.chunk, grad, ctx.scale, ctx.what)
        return None, None, None, None, None, None


@dataclass(frozen=True, eq=False)
class _Call:
    """What a _ChunkedLoss computes besides its tensor inputs (f, b and the head's parameters,
    which follow it in apply)."""

    tokens: torch.Tensor  # (B, L) int64
    pairs: Pairs
    options: LossOptions
    split: Callable  # the head's pair_parts: (f, b, lengths) of some rows -> their PairParts
    grad_enabled: bool  # the caller's grad mode (inside forward it is always off)
    head: torch.nn.Module  # a float16 backward reruns split with the forward's tensors in place (_state)


def _parts(split, f, b, lengths) -> PairParts:
    """split(f, b, lengths), its swiglu list checked (once a call: the probe's)."""
    parts = split(f, b, lengths)
    n = len(parts.prefix)
    for k in parts.swiglu:
        if not (isinstance(k, int) and 0 <= k < n and parts.prefix[k].shape[-1] % 2 == 0):
            raise ValueError(f"pair_parts: swiglu must list parts of even width ([gate | up]) among the {n} "
                             f"parts, got {k!r}")
    return parts


def _windows(chunks, L: int, rows: int):
    """The chunks grouped into windows of rows: [(ra, rb, chunks)], each window's chunks reading rows
    ra..rb, a window taking every chunk that begins within `rows` rows of its first (so its last
    chunk may take it past them). A row that one chunk ends in and the next begins in belongs to both
    windows: its parts are made twice and its gradient sums mapped in two pieces, which add up."""
    out = []
    for c in chunks:
        ra, rb = c.pre_lo // L, (c.pre_hi - 1) // L  # the list is sorted by row: a pair's positions share it
        if out and ra < out[-1][0] + rows:
            out[-1][1] = max(out[-1][1], rb)
            out[-1][2].append(c)
        else:
            out.append([ra, rb, [c]])
    return out


def _check_reaches_only(outs, allowed):
    """Raise if the parts' graph reaches a leaf that requires grad besides `allowed` (a window's f and
    b, the head's parameters): the backend maps the parts' gradients to those alone, so another's
    would be silently lost. The walk goes through nodes made before the window too (autocast's
    cached casts of the parameters; a tensor computed before the loss, down to its own leaves)."""
    ids = {id(t) for t in allowed}
    stack = [t.grad_fn if t.grad_fn is not None else t for t in outs]
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = node if isinstance(node, torch.Tensor) else getattr(node, "variable", None)  # AccumulateGrad's
        if leaf is None:
            stack.extend(n for n, _ in node.next_functions if n is not None)
        elif id(leaf) not in ids:
            raise ValueError(f"pair_parts uses a tensor that requires grad besides f, b and the head's parameters "
                             f"(a leaf of shape {tuple(leaf.shape)}): the torch backend maps the parts' gradients "
                             "to those alone; make it a parameter of the head, or detach it")


def _power_of_two(x: float) -> float:
    """The power of two nearest x (1 for x <= 0): a scale that multiplies exactly."""
    return 2.0 ** round(math.log2(x)) if x > 0 else 1.0


def _times(got, unit: float):
    """Gradients mapped in `unit`'s units back in true units, in float32 or wider."""
    if unit == 1.0:
        return list(got)
    return [None if g is None else g.to(torch.promote_types(g.dtype, torch.float32)) * unit for g in got]


def _grad_in_units(outs, sums, inputs, unit: float, retain: bool):
    """The gradients of `inputs` for the gradient sums `sums` of the tensors `outs` (a window's
    parts), the sums divided by `unit` on the way in (None where an input does not reach the outs)."""
    if not inputs:
        return []
    grad_outputs = [(s if unit == 1.0 else s / unit).to(t.dtype) for t, s in zip(outs, sums)]
    return torch.autograd.grad(outs, inputs, grad_outputs, allow_unused=True, retain_graph=retain)


def _mapped_float16(outs, sums, inputs, unit: float):
    """The gradients of float16 `inputs` (in true units, float32), which the head's backward rounds
    to float16 in `unit`'s units. Where the largest result lies below 2**-4 (terms of random sign
    averaging out, so that the smaller elements near float16's subnormals, 2**-14, lose digits) the
    sums are mapped again in units that put it at 2**8; where every result fell to zero from sums
    that are not all zero (a last layer of tiny weights), in units 2**24 smaller; where it
    overflowed, in units 2**16 larger (not for a nan, which larger units would not mend, and which
    cost the finite rows their digits). At most three mappings, each with one read of the results'
    peak (a synchronisation), in float16 only."""
    for attempt in range(3):
        got = _grad_in_units(outs, sums, inputs, unit, retain=True)  # the graph dies with the window
        peaks = [g.abs().amax().float() for g in got if g is not None and g.numel()]
        if not peaks:
            break
        peak, sums_peak = torch.stack([torch.stack(peaks).max(), torch.stack([s.abs().amax() for s in sums]).max()]).tolist()
        if 2.0**-4 <= peak < math.inf or math.isnan(peak) or peak == 0.0 == sums_peak or attempt == 2:
            break
        del got
        unit *= 2.0**-24 if peak == 0.0 else _power_of_two(peak) * 2.0**-8 if math.isfinite(peak) else 2.0**16
    return _times(got, unit)


def _loss_scale(chunk, wscale: float, go: float, lower: float = 1.0):
    """A float16 chunk's gradient scale (see the chunk loop): Chunk.half_scale's times `lower`, or
    the scale the materialised run's per-pair gradients have, grad_output times the pair weights
    (a GradScaler's loss scale), if larger."""
    gs = chunk.half_scale(summed=True) * lower
    mat = abs(go) * wscale
    return max(gs, mat) if mat < math.inf else gs


def _rng_state(dev: torch.device):
    return torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None


def _set_rng_state(state, dev: torch.device):
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], dev)


def _finite(tensors) -> bool:
    """Whether every element of the tensors (None: none) is finite: one synchronisation."""
    flags = [torch.isfinite(t).all() for t in tensors if t is not None]
    return bool(torch.stack(flags).all()) if flags else True


def _compute(call: _Call, f, b, params, need, go=None):
    """(loss, [df, db, *parameter gradients], deferred): the loss and the gradients of the inputs
    `need` names (f, b, params; None where not needed), in true units. float16 (the head's compute
    dtype) defers its gradients to the backward unless grad_output `go` is given (a float): the
    loss alone is computed then, and `deferred` is True (the chunk loop says why)."""
    tokens, switches, vocab_size = call.tokens, call.options.switches, call.options.vocab_size
    dev = tokens.device
    Bn, L = tokens.shape
    lengths = call.pairs.lengths
    need_f, need_b, need_params = need[0], need[1], need[2:]
    with torch.no_grad():  # the parts' widths and dtypes, from one row
        probe = _parts(call.split, f[:1], b[:1], lengths[:1])
    dtypes, swiglu_parts = list(probe.dtypes), tuple(probe.swiglu)
    widths = [P.shape[-1] for P in probe.prefix]
    acc = torch.float64 if any(t.dtype == torch.float64 for t in probe.prefix + probe.suffix) else torch.float32
    table_bytes = sum(P.shape[-1] * (P.dtype.itemsize + Q.dtype.itemsize) for P, Q in zip(probe.prefix, probe.suffix))
    del probe

    # the dtype of the head's matrix products: autocast's, else the parameters'
    compute = params[0].dtype if params else dtypes[0]
    if torch.is_autocast_enabled(dev.type) and compute != torch.float64:
        compute = torch.get_autocast_dtype(dev.type)
    fp16 = compute == torch.float16
    deferred = fp16 and go is None and any(need)
    # the first window's parts are still checked (_check_reaches_only) where no gradient is computed
    # now: float16's deferred ones, or none asked for under grad mode (a frozen head whose parts read
    # another tensor that requires grad would give a loss without its gradient)
    check_only = deferred or call.grad_enabled and not any(need)
    if deferred:  # the loss alone now; the gradients in the backward, at grad_output's scale
        need_f = need_b = False
        need_params = [False] * len(need_params)
    wrt_params = [q for q, n in zip(params, need_params) if n]
    grad_params = [None] * len(wrt_params)  # created at the first chunk or window that reaches them
    token = torch.zeros((), device=dev, requires_grad=True)
    backprop = need_f or need_b or bool(wrt_params)
    es = compute.itemsize
    # a swiglu part makes one half-width tensor fused, the gate and up sums (and swiglu's) apart
    fused = switches.fused_swiglu
    per_pair = 2 * vocab_size * es + sum(w * d.itemsize // (2 if k in swiglu_parts and fused else 1)
                                         for k, (w, d) in enumerate(zip(widths, dtypes)))
    Ops = engine(dev, acc, switches.triton_ops)
    # the structured walk is the Triton engine's (its segment kernels); the torch ops take none
    pl = pair_list(call.pairs, Bn, L, chunk_pairs(per_pair, dev, switches), dtype=acc,
                   structured=switches.structured_sums and Ops is TritonOps)
    # the parts' tables and (backprop) their gradient sums, a window of rows at a time
    # (the deferred float16 forward counts the sums too: its windows are the backward's, whose
    # random draws (a head's dropout in pair_parts) they must replay)
    per_row = L * (table_bytes + (2 * sum(widths) * acc.itemsize if backprop or deferred else 0))
    # (a GPU chunk's budget on any device: the CPU's small one is for its cache, and each small
    # window costs its shared row's parts again)
    windows = _windows(pl.chunks, L, runtime.window_rows(Bn, per_row, switches.torch_chunk_bytes, switches))
    loss = torch.zeros((), dtype=acc, device=dev)
    param_storages = {q.untyped_storage().data_ptr() for q in params}
    wscale = pl.wscale
    half = fp16 or f.dtype == torch.float16
    # f's and b's gradients as the triton op keeps them (float32 for float16; scaled in float32)
    df, db = (torch.zeros(x.shape, dtype=pair_loss_op.side_grad_dtype(x.dtype), device=dev) if n else None
              for x, n in ((f, need_f), (b, need_b)))

    def add_params(into, gs, alpha=1.0):
        for k, g in enumerate(gs):
            if g is not None:
                if into[k] is None:
                    into[k] = torch.zeros(g.shape, dtype=acc, device=dev)
                into[k].add_(g, alpha=alpha)

    def run_chunk(chunk, ops, tail, grads, into, lower):  # the chunk's loss; its gradients added on the way
        n = chunk.n

        def pair_value(k, what, back):  # a part's per-pair value, in the graph if it needs a gradient
            if grads[k] is None:
                return ops.gather(k, chunk, what)
            return _PairSum.apply(token, ops, k, chunk, back, what)

        # The cross-entropy writes each pair's gradient times gs, the accumulators add the
        # chunk's gradients times back: gs * back = wscale, the pair weights' common scale.
        # bfloat16 and wider take the true weights (gs = wscale), as the materialised run
        # does: a 16-bit parameter gradient is then rounded once per chunk, not again after a
        # rescaling. float16 would underflow (1/|P| per pair): its parameter gradients are sums
        # over the chunk's pairs of O(1) per-pair terms, scaled so that the weights average
        # 1/sqrt(n) (Chunk.half_scale; rows of unequal weight included) they neither overflow
        # 65504 nor fall to subnormals; or, if larger, the materialised run's per-pair scale,
        # |grad_output| times the weights (in the backward, _loss_scale), so that a loss scale
        # protects the per-pair float16 gradients as it does the materialised run's. Terms far
        # above O(1) (head activations in the hundreds at n ~ 30k pairs) overflow where the
        # materialised run, scaled by 1/|P|, does not: their window runs again (run_window).
        gs = _loss_scale(chunk, wscale, go or 0.0, lower) if fp16 else wscale
        back = wscale / gs
        saved = _SavedStorages()
        with torch.set_grad_enabled(backprop), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            # autograd numbers the nodes it makes in order: nodes after this one are the chunk's
            first = token.view(()).grad_fn._sequence_nr() if backprop else None
            xs = [pair_value(k, "sum", back) if k not in swiglu_parts
                  else pair_value(k, "swiglu", back) if fused
                  else swiglu(pair_value(k, "gate", back), pair_value(k, "up", back))
                  for k in range(len(grads))]
            logits = (_compiled_tail() if switches.compile_tail else _call_tail)(tail, xs)
            del xs
        if logits.shape != (n, 2 * vocab_size):
            raise ValueError(f"the head must map (n, 2m) to (n, 2V) = ({n}, {2 * vocab_size}), "
                             f"got {tuple(logits.shape)}")
        z = logits.detach()
        # z becomes its own gradient in place: not where a backward node reads it, nor in a
        # parameter's storage, nor in a view of a tensor made outside this chunk's graph (a
        # head may return a slice or an expand of a parameter, a buffer or an earlier result).
        # A view of a tensor the chunk computed (ResidualSwiGLUHead's flatten of lm_head's
        # output) is overwritten.
        base = logits._base
        made_here = base is None or (first is not None and base.grad_fn is not None
                                     and base.grad_fn._sequence_nr() > first)
        overwrites = backprop or ops.writes_logits_without_grad
        if not z.is_contiguous() or overwrites and (saved.holds(z) or not made_here
                                                     or z.untyped_storage().data_ptr() in param_storages):
            z = z.clone(memory_format=torch.contiguous_format)
        chunk_loss = ops.cross_entropy_(z, chunk, backprop, gs)
        if backprop:
            # The pair sums add into the window's accumulators on the way. allow_unused: a head
            # may hold parameters its per-pair work does not use.
            gp = torch.autograd.grad(logits, [token] + wrt_params, grad_outputs=z, allow_unused=True)[1:]
            del logits, z
            add_params(into, gp, back)
        return chunk_loss

    def run_window(ra, rb, chunks, check):  # the window's loss; its locals die with it
        rows = slice(ra, rb + 1)
        graph = check and check_only  # the deferred float16 forward builds the first window's graph to check it
        # float16's gradients (the backward): a window whose chunks overflowed at a scale above the
        # materialised run's runs again at scales 2**8 times smaller (_loss_scale's `lower`; at most
        # twice): its parameter gradients are added apart until then (one read of their
        # finiteness, a synchronisation a window)
        retry = fp16 and go is not None and backprop
        rng = _rng_state(dev) if retry else None  # an attempt draws (a head's dropout) what the first drew
        lower = 1.0
        for attempt in range(3):
            if attempt:
                _set_rng_state(rng, dev)
            with torch.set_grad_enabled(backprop or graph):
                fw = f[rows].detach().requires_grad_(need_f or graph and need[0])
                bw = b[rows].detach().requires_grad_(need_b or graph and need[1])
                parts = call.split(fw, bw, lengths[rows])  # the probe checked their swiglu list
            if graph:
                _check_reaches_only([t for t in parts.prefix + parts.suffix if t.requires_grad], [fw, bw, *params])
            BLw = (rb + 1 - ra) * L
            grads = [torch.zeros(2 * BLw, P.shape[-1], dtype=acc, device=dev)
                     if backprop and (P.requires_grad or Q.requires_grad) else None
                     for P, Q in zip(parts.prefix, parts.suffix)]  # d[P ; Q] per part
            ops = Ops(parts.prefix, parts.suffix, dtypes, swiglu_parts, pl, grads, tokens, call.options.next_weight,
                      pos0=ra * L)
            into = [None] * len(wrt_params) if retry else grad_params
            window_loss = sum(run_chunk(chunk, ops, parts.tail, grads, into, lower) for chunk in chunks)
            lowest = max(_loss_scale(c, wscale, go or 0.0, lower) for c in chunks) <= abs(go or 0.0) * wscale
            if not retry or attempt == 2 or lowest or _finite([*into, *grads]):
                break
            del parts, grads, ops, into
            lower *= 2.0**-8
        if into is not grad_params:
            add_params(grad_params, into)
        # The window's sums are complete: map them through the parts' graph to f, b and the
        # split parameters (the head's own backward), then drop the window.
        outs, sums = [], []
        for P, Q, g in zip(parts.prefix, parts.suffix, grads):
            for t, gt in ((P, None if g is None else g[:BLw]), (Q, None if g is None else g[BLw:])):
                if gt is not None and t.requires_grad:
                    outs.append(t)
                    sums.append(gt.view(t.shape))
        del ops  # the torch ops' stacked copy of the tables, before the mapping
        leaves = [x for x, n in ((fw, need_f), (bw, need_b)) if n]
        if not outs:
            return window_loss
        if check:
            _check_reaches_only(outs, [fw, bw, *params])
        if not half:
            got = _grad_in_units(outs, sums, leaves + wrt_params, 1.0, retain=False)
            side_got, param_got = got[: len(leaves)], got[len(leaves) :]
        else:  # float16: units that keep each result near 1 (the module docstring)
            n, wsum = sum(c.n for c in chunks), sum(c.wsum for c in chunks)
            side_got = _mapped_float16(outs, sums, leaves, _power_of_two(wscale * L * (wsum / n) ** 0.5))
            param_got = _mapped_float16(outs, sums, wrt_params, _power_of_two(wscale * wsum))
        for d, g in zip([d for d in (df, db) if d is not None], side_got):
            if g is not None:
                d[rows] += g.to(d.dtype)
        add_params(grad_params, param_got)
        return window_loss

    for k, (ra, rb, chunks) in enumerate(windows):
        loss += run_window(ra, rb, chunks, check=k == 0)
    loss = loss * wscale
    it = iter(grad_params)
    grad_params = [next(it) if n else None for n in need_params]  # None: not used at all
    return loss, [df, db, *grad_params], deferred


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, f, b, *params):
        # needs_input_grad ignores grad mode (inside forward it is always off): the caller's
        # grad_enabled decides whether any gradient is computed at all.
        need = [call.grad_enabled and n for n in ctx.needs_input_grad[1:]]  # after `call`: f, b, params
        dev = call.tokens.device
        rng = _rng_state(dev)
        loss, grads, ctx.deferred = _compute(call, f, b, params, need)
        ctx.dtypes = [t.dtype for t in (f, b, *params)]
        if ctx.deferred:  # float16: the same computation again in the backward, as the forward ran it
            ctx.call, ctx.need, ctx.rng = call, need, rng
            ctx.autocast = torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type)
            ctx.save_for_backward(f, b, *params)  # params saved too: autograd's check of in-place changes
            # the head's own parameters, which its forward reads: a saved-tensor hook (checkpointing,
            # save_on_cpu) unpacks copies, which it never reads (their gradients would be refused or lost)
            ctx.params = params
            ctx.state = _state(call.head)  # the tensors the forward read (functional_call swaps them back)
        else:
            ctx.save_for_backward(*grads)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        no_double_backward("torch")
        grads = ctx.saved_tensors
        if ctx.deferred:
            f, b, params = grads[0], grads[1], ctx.params
            dev = ctx.call.tokens.device
            with torch.random.fork_rng([dev] if dev.type == "cuda" else []), torch.enable_grad(), \
                    torch.autocast(dev.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]), \
                    _as_in_forward(ctx.call.head, ctx.state):
                _set_rng_state(ctx.rng, dev)  # a head's dropout draws what the forward drew
                # (one read of grad_output: the chunks' scale)
                grads = _compute(ctx.call, f, b, params, ctx.need, go=float(grad_loss))[1]
        out = [None if g is None else pair_loss_op.scaled(grad_loss, g).to(dt)
               for g, dt in zip(grads, ctx.dtypes)]
        return (None,) + tuple(out)  # none for `call`


def _state(head: torch.nn.Module) -> dict:
    """Every name of the head's parameters and buffers, tied and shared ones and those set to None
    included, -> its tensor (or None)."""
    state = {}
    for prefix, module in head.named_modules(remove_duplicate=False):
        for name, t in (*module._parameters.items(), *module._buffers.items()):
            state[f"{prefix}.{name}" if prefix else name] = t
    return state


def _as_in_forward(head: torch.nn.Module, state: dict):
    """The head as its forward read it (`state`, _state's) for the backward's rerun: torch.func's
    functional_call swaps other tensors (parameters, tied names, buffers) in for the forward and puts
    the module's own back before the backward runs. Matched by name, each name given, so that tied
    and reordered ones come back as they were. A no-op when nothing was swapped."""
    now = _state(head)
    if now.keys() != state.keys():
        raise ValueError(f"the head's parameters and buffers changed between its float16 forward and backward: "
                         f"{sorted(now.keys() ^ state.keys())[:5]}")
    if all(now[name] is t for name, t in state.items()):
        return contextlib.nullcontext()
    # stack_weights: restored in reverse order, so that a submodule reached under two names ends as it was
    return torch.nn.utils.stateless._reparametrize_module(head, state, stack_weights=True)


def _concat_parts(head):
    """The split of a head without pair_parts: [f ; 0] + [0 ; b] = [f_i ; b_j], then the head."""
    def tail(xs):
        return head(xs[0])

    def parts(f, b, lengths):
        xf, xb = concat_parts(f, b)
        return PairParts([xf], [xb], [f.dtype], tail)
    return parts


def run(f, b, tokens, head, pairs: Pairs, options: LossOptions):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), a chunk of pairs at a time."""
    split = getattr(head, "pair_parts", None)
    if split_changes(head):
        split = None  # our heads' splits read weights alone, which no longer say what this head computes
    split = split or _concat_parts(head)
    call = _Call(tokens=tokens, pairs=pairs, options=options, split=split, grad_enabled=torch.is_grad_enabled(),
                 head=head)
    with on_device(f.device):  # the Triton engine's launches (the forward also takes every gradient)
        return _ChunkedLoss.apply(call, f, b, *head.parameters())
