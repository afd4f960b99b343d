"""The "torch" backend: any head module, all pairs in large chunks across rows, each chunk's head
graph built by torch autograd, differentiated and freed before the next.

The pair set is one sorted flat list on the device (`_pairs.pair_list`: ia = row * L + i,
ib = row * L + j, built once without a loop over rows), cut into chunks of `chunk_pairs` pairs: no
host synchronisation per chunk. The head's work splits into parts computed once per position and a
per-pair tail (`pair_parts`, see head.py): TextHead splits its first layer, ResidualSwiGLUHead its
gate/up projection (a swiglu part); any other head gets [f ; 0] and [0 ; b], whose pair sum is
[f_i ; b_j]. Per chunk of n pairs, for each part (P, Q) of width w, and with es the logits' bytes:

    x      = P[ia] + Q[ib]                (n, w): summed in float32 (float64), rounded once to the
             part's dtype (_PairSum); for a swiglu part [gate | up], x = silu(gate) * up (n, w/2)
             from the float32 sums, rounded once (FUSED_SWIGLU; off: gate and up apart, then torch)
    logits = tail(x, ...)                 (n, 2V): the head's per-pair work, built by autograd
    CE     = float32 (float64) logsumexp; the logits become w·(softmax - onehot) in place
    grads  = autograd.grad(logits, parameters, that gradient); on the way back each pair sum adds
             x's gradient into the float32 (float64) d[P ; Q] itself: no per-chunk gradient of P or
             Q is made
    dparam += grads                       float32 (float64 for float64)

Two engines do the pair sums, their gradients and the cross-entropy:
- Triton (CUDA tensors, float32 accumulation; _TritonOps): the triton backend's kernels. The pair
  sum is pair_hidden_kernel without an activation: one read of two rows (L2 hits) and one write of
  n*w*es. Its gradient is the prefix and suffix segment sums: each reads x's gradient once
  (n*w*es), no atomics (these sums are reproducible; the head's own are torch's), and no float32
  copy of x or of its gradient is made. A swiglu part: the same kernels with SWIGLU, one write of
  n*w/2*es forward; backward each reads the (n, w/2) gradient once and recomputes gate and up from
  P and Q (L2 hits), so neither gate, up nor their gradients are ever stored. The cross-entropy
  kernel reads and writes the logits once (2 * n*2V*es).
- torch ops (the CPU, and float64; _TorchOps): one embedding_bag over [P ; Q] and a cast;
  index_add_ of x's gradient cast to the accumulator's dtype (atomic, so not reproducible on a
  GPU); a swiglu part's activation and its gradient (head.swiglu_grad, from the sums gathered
  again) in the accumulator's dtype; the cross-entropy on the logits in the accumulator's dtype (a
  copy of 16-bit logits), its gradient rounded once into them.

A chunk holds about CHUNK_BYTES in the per-pair tensors the backend makes: the parts' values and
the logits (the head's own intermediates come on top: for the SwiGLU head about twice as much).
Every part counts, not only the widest: the SwiGLU head's residual and SwiGLU output are each
narrower than its logits, but together wider.

The loss is the graph's last node, so the forward computes every gradient and the backward only
scales them by grad_output (autograd then maps the parts' gradients back to f, b and the split
weights). The cross-entropy's gradient carries the true pair weights, except in fp16, where they
are divided by the largest one and the chunk scaled (see the chunk loop) against underflow and
overflow, both multiplied back in the float32 accumulators.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch
import torch.nn.functional as F

from .._pairs import PairList, Pairs, pair_list
from ..head import PairParts, concat_parts, swiglu, swiglu_grad
from . import env_flag, env_mb, on_device
from .pair_loss_op import no_double_backward

# Bytes of a chunk's pair sums and logits. On a GPU: 256 MB (52k pairs of a TextHead with h=512 at
# V=1000 in bf16, 23k of the SwiGLU head at m=512); BST_FAST_TORCH_CHUNK_MB changes it. On the CPU
# a smaller chunk stays in cache.
CHUNK_BYTES = env_mb("BST_FAST_TORCH_CHUNK_MB", 256)
CPU_CHUNK_BYTES = 16 * 2**20
# A fixed number of pairs per chunk instead of the byte budget (tests set it).
CHUNK_PAIRS: Optional[int] = None
# The engine (_TritonOps or _TorchOps): None picks Triton for CUDA tensors; True forces it (the CPU through
# TRITON_INTERPRET=1, tests), False the torch ops. float64 always takes the torch ops.
TRITON_OPS: Optional[bool] = None
# torch.compile the head's per-pair tail, forward and backward (BST_FAST_TORCH_COMPILE=1). Two graphs:
# one at the full chunk's pair count and, from the first other count (the last chunk), one with a
# dynamic count; a new head, dtype or autocast state compiles anew. Off by default: on the CPU it was
# 2-7% faster once compiled, after seconds of compiling; on an H200 2% for the SwiGLU head (docs/backends.md).
COMPILE = env_flag("BST_FAST_TORCH_COMPILE")
# A swiglu part (pair_parts' `swiglu`) as one fused step: silu(gate) * up formed by the pair-sum engine
# from the float32 sums, and its gradient taken there from recomputed sums (the default). Off
# (BST_FAST_TORCH_UNFUSED_SWIGLU=1): gate and up summed apart, rounded, and combined by torch's silu
# and mul, as before the fused step (kept to measure one against the other).
FUSED_SWIGLU = not env_flag("BST_FAST_TORCH_UNFUSED_SWIGLU")
# Named settings of this backend, for benchmarks and checks that time or test them side by side.
VARIANTS = {"torch": dict(COMPILE=False, FUSED_SWIGLU=True),
            "torch+compile": dict(COMPILE=True, FUSED_SWIGLU=True),
            "torch+unfused": dict(COMPILE=False, FUSED_SWIGLU=False)}


@contextlib.contextmanager
def variant(name: str):
    """Runs the block with this backend's settings VARIANTS[name], then restores them."""
    if name not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {name!r}")
    old = {key: globals()[key] for key in VARIANTS[name]}
    globals().update(VARIANTS[name])
    try:
        yield
    finally:
        globals().update(old)


def _call_tail(tail, xs):
    return tail(xs)


@functools.lru_cache(maxsize=None)
def _compiled_tail():
    # one compiled trampoline: Dynamo inlines each head's tail and guards on it, so a new tail closure
    # per call (pair_parts makes one) hits the cache
    return torch.compile(_call_tail)


def chunk_pairs(per_pair_bytes: int, device: torch.device) -> int:
    """Pairs per chunk: CHUNK_PAIRS if set, else the byte budget over the bytes per pair."""
    if CHUNK_PAIRS is not None:
        return int(CHUNK_PAIRS)
    budget = CHUNK_BYTES if device.type != "cpu" else CPU_CHUNK_BYTES
    return max(1, budget // max(1, per_pair_bytes))


def _cross_entropy_(z, y, wl, need: bool, gscale: float = 1.0):
    """sum of wl * CE(z, y) over the (n, 2) rows of z (n, 2, V), in wl's dtype. With need, z is
    overwritten by gscale * wl * (softmax(z) - onehot(y)), computed in wl's dtype and rounded once
    to z's, as the Triton kernel does (16-bit steps in between rounded each product and sum again,
    and broke the 2x bound on small bias gradients). This engine runs on the CPU (and in float64):
    a float32 copy of a 16-bit chunk (16 MB of logits) is cheap there; the GPU engine makes none."""
    acc = wl.dtype
    x = z.to(acc)  # z itself when it is already float32 / float64: overwritten in place
    yi = y[..., None]
    zy = x.gather(2, yi)  # (n, 2, 1)
    mx = x.amax(2, keepdim=True)
    x = x.sub_(mx).exp_()
    # The label's term ey and the others' sum ry, apart: the loss is (mx - zy) + log1p(ry + (ey - 1))
    # and the label's gradient -ry / (ry + ey). For a confident model (the label on top, ey = 1) both
    # keep the tiny ry whole; mx + log(sum) - zy lost it to the rounding of mx and of 1 + ry
    # (float32 logits near 50 gave a 6% error on a 1e-5 loss).
    ey = x.gather(2, yi)
    x.scatter_(2, yi, 0.0)
    ry = x.sum(2, keepdim=True)
    s = ry + ey
    loss = (wl * ((mx - zy) + torch.log1p(ry + (ey - 1.0)))).sum()
    if need:
        x.mul_(gscale * wl / s)
        x.scatter_(2, yi, gscale * wl * (-ry / s))
        if x is not z:
            z.copy_(x)
    return loss


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


def _halves(t, what):
    """The columns of a part's table (or gradient) that `what` reads: the gate or up half, or all."""
    h = t.shape[-1] // 2
    return t[..., :h] if what == "gate" else t[..., h:] if what == "up" else t


class _TorchOps:
    """A chunk's work around the head through torch ops. The pair sums: x = P[ia] + Q[ib] as one
    embedding_bag over the stacked table [P ; Q] (rows ia and B*L + ib), cast to the part's dtype;
    the gradient cast to the accumulator's dtype and added into d[P ; Q] at both rows by
    index_add_. A swiglu part: the [gate | up] sums in the accumulator's dtype, swiglu of them
    rounded once; on the way back the sums are gathered again for swiglu_grad. The cross-entropy:
    _cross_entropy_."""

    writes_logits_without_grad = True  # the cross-entropy works in place on the logits

    def __init__(self, prefix, suffix, dtypes, swiglu_parts, pl: PairList, grads, tokens, next_weight):
        BL = prefix[0].shape[0] * prefix[0].shape[1]
        self.tables = [torch.cat([P.detach().reshape(BL, -1), Q.detach().reshape(BL, -1)]) for P, Q in zip(prefix, suffix)]
        for k in swiglu_parts:  # SwiGLU of the float32 (float64) sums: 16-bit tables are upcast first
            if self.tables[k].dtype != torch.float64:
                self.tables[k] = self.tables[k].float()
        self.dtypes, self.pl, self.grads, self.BL = dtypes, pl, grads, BL
        self.tok = tokens.reshape(-1)
        self.lam = torch.tensor([next_weight, 1.0 - next_weight], dtype=pl.w.dtype, device=tokens.device).reshape(1, 2, 1)
        self._rows = (None, None)

    def rows(self, chunk):
        if self._rows[0] != chunk[0]:  # one (n, 2) index per chunk, shared by the parts
            s0, n = chunk[:2]
            self._rows = (s0, torch.stack([self.pl.ia[s0 : s0 + n].long(), self.pl.ib[s0 : s0 + n].long() + self.BL], 1))
        return self._rows[1]

    def _sums(self, k, chunk, what):
        with torch.autocast(self.tables[k].device.type, enabled=False):
            return F.embedding_bag(self.rows(chunk), _halves(self.tables[k], what), mode="sum")

    def gather(self, k, chunk, what):
        x = self._sums(k, chunk, what)
        if what == "swiglu":
            x = swiglu(*x.chunk(2, dim=1))
        return x.to(self.dtypes[k])

    def add_grad(self, k, chunk, grad, scale, what):
        g = grad.to(self.grads[k].dtype)
        if scale != 1.0:
            g = g * scale
        rows = self.rows(chunk)
        if what == "swiglu":  # the gate's and up's gradients into the two halves
            pieces = zip(swiglu_grad(g, *self._sums(k, chunk, what).chunk(2, dim=1)), ("gate", "up"))
        else:
            pieces = [(g, what)]
        for g, half in pieces:
            dst = _halves(self.grads[k], half)
            dst.index_add_(0, rows[:, 0], g)
            dst.index_add_(0, rows[:, 1], g)

    def cross_entropy_(self, z, chunk, need, gscale):
        s0, n = chunk[:2]
        rows = self.rows(chunk)
        y = torch.stack([self.tok[rows[:, 0] + 1], self.tok[rows[:, 1] - self.BL - 1]], 1)  # Next, Prev labels
        if self.pl.meet_token is not None:  # a pair with j - i = 1 takes meet_token as both labels (contract §8)
            y = y.masked_fill((rows[:, 1] - self.BL - rows[:, 0] == 1)[:, None], self.pl.meet_token)
        wl = self.lam if self.pl.w_stride == 0 else self.lam * self.pl.w[s0 : s0 + n].reshape(-1, 1, 1)
        return _cross_entropy_(z.view(n, 2, -1), y, wl, need, gscale)


class _TritonOps:
    """A chunk's work around the head through the triton backend's kernels. The pair sums without
    an activation (float32 sums, rounded once to the part's dtype); their gradient reduced by the
    prefix and suffix segment kernels straight from x's gradient into the float32 dP and dQ, in a
    fixed order. A swiglu part: the same kernels with SWIGLU, silu(gate) * up from the float32
    sums, and on the way back gate and up recomputed from P and Q. The cross-entropy:
    pair_cross_entropy_ (one read and one write of the logits, float32 loss per pair). The
    launches are the triton backend's (kernels/)."""

    writes_logits_without_grad = False  # without gradients the cross-entropy only reads the logits

    def __init__(self, prefix, suffix, dtypes, swiglu_parts, pl: PairList, grads, tokens, next_weight):
        from ..kernels.activation import NO_ACT, SWIGLU, interpreted_bf16
        from .configs import gather_config

        BL = prefix[0].shape[0] * prefix[0].shape[1]
        self.P, self.Q = [], []
        for k, (P, Q) in enumerate(zip(prefix, suffix)):
            # rows may be ld apart (a column slice of a wider table), but each row contiguous and
            # both tables alike; otherwise a contiguous copy. A swiglu part's backward reads P and Q
            # with the row stride of its contiguous gradient, so it is always contiguous.
            P, Q = P.detach().reshape(BL, -1), Q.detach().reshape(BL, -1)
            if P.stride(1) != 1 or Q.stride() != P.stride() or k in swiglu_parts:
                P, Q = P.contiguous(), Q.contiguous()
            self.P.append(P)
            self.Q.append(Q)
        self.dtypes, self.pl, self.grads, self.BL = dtypes, pl, grads, BL
        # launch shapes by what a part's kernels do: its sum, a half (gate or up), or SWIGLU
        self.cfg = []
        for P in self.P:
            half = gather_config(P.device.type, P.shape[1] // 2, "sum")
            self.cfg.append(dict(sum=gather_config(P.device.type, P.shape[1], "sum"), gate=half, up=half,
                                 swiglu=gather_config(P.device.type, P.shape[1] // 2, "swiglu")))
        self.up = [interpreted_bf16(d) for d in dtypes]
        self.act = dict(swiglu=SWIGLU.value, gate=NO_ACT.value, up=NO_ACT.value, sum=NO_ACT.value)
        self.tok, self.lam = tokens.contiguous().reshape(-1), float(next_weight)
        self.loss_rows = torch.empty(max((c[1] for c in pl.chunks), default=1), dtype=torch.float32, device=tokens.device)

    def gather(self, k, chunk, what):
        from ..kernels.pair_hidden import pair_hidden

        s0, n = chunk[:2]
        P, Q = self.P[k], self.Q[k]
        if what != "swiglu":
            P, Q = _halves(P, what), _halves(Q, what)
        x = torch.empty(n, P.shape[1] // (2 if what == "swiglu" else 1), dtype=self.dtypes[k], device=P.device)
        pair_hidden(P, Q, self.pl, s0, n, x, self.act[what], self.cfg[k][what], self.up[k])
        return x

    def add_grad(self, k, chunk, grad, scale, what):
        from ..kernels.pair_hidden import segment_grads

        # without an activation the kernels read only the gradient and the index lists, never P or
        # Q; with SWIGLU they recompute gate and up from P and Q (both contiguous then)
        P, Q, dPQ = self.P[k], self.Q[k], self.grads[k]
        if what != "swiglu":
            P, Q, dPQ = _halves(P, what), _halves(Q, what), _halves(dPQ, what)
        segment_grads(grad.contiguous(), P, Q, self.pl, chunk, dPQ[: self.BL], dPQ[self.BL :], self.act[what], scale,
                      self.cfg[k][what])

    def cross_entropy_(self, z, chunk, need, gscale):
        from ..kernels.activation import interpreted_bf16
        from ..kernels.cross_entropy import pair_cross_entropy_
        from .configs import ce_config

        return pair_cross_entropy_(z, self.tok, self.pl, chunk[0], self.lam, gscale, need, self.loss_rows,
                                   ce_config(z.device.type, z.shape[1] // 2), interpreted_bf16(z.dtype))


def _use_triton(device: torch.device, acc) -> bool:
    if acc != torch.float32 or TRITON_OPS is False:
        return False
    if TRITON_OPS:
        return True
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # a CUDA machine without Triton: the torch ops
        return False
    return True


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


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, p, next_weight, vocab_size, tail, dtypes, swiglu_parts, n_parts, grad_enabled, *inputs):
        prefix, suffix, params = inputs[:n_parts], inputs[n_parts : 2 * n_parts], inputs[2 * n_parts :]
        acc = torch.float64 if any(t.dtype == torch.float64 for t in inputs[: 2 * n_parts]) else torch.float32
        dev = tokens.device
        Bn, L = tokens.shape
        BL = Bn * L
        # needs_input_grad ignores grad mode (inside forward it is always off): the caller's
        # grad_enabled decides whether any gradient is computed at all.
        need = [grad_enabled and n for n in ctx.needs_input_grad[9:]]
        need_parts = [a or b for a, b in zip(need[:n_parts], need[n_parts : 2 * n_parts])]
        need_params = need[2 * n_parts :]
        grads = [torch.zeros(2 * BL, P.shape[-1], dtype=acc, device=dev) if n else None
                 for P, n in zip(prefix, need_parts)]  # d[P ; Q] per part
        wrt_params = [q for q, n in zip(params, need_params) if n]
        grad_params = [None] * len(wrt_params)  # created at the first chunk that reaches them
        token = torch.zeros((), device=dev, requires_grad=True)
        backprop = any(need_parts) or bool(wrt_params)

        # the dtype of the head's matrix products: autocast's, else the parameters'
        compute = params[0].dtype if params else dtypes[0]
        if torch.is_autocast_enabled(dev.type) and compute != torch.float64:
            compute = torch.get_autocast_dtype(dev.type)
        es = compute.itemsize
        # a swiglu part makes one half-width tensor fused, the gate and up sums (and swiglu's) apart
        fused = FUSED_SWIGLU
        per_pair = 2 * vocab_size * es + sum(P.shape[-1] * d.itemsize // (2 if k in swiglu_parts and fused else 1)
                                             for k, (P, d) in enumerate(zip(prefix, dtypes)))
        pl = pair_list(p, Bn, L, chunk_pairs(per_pair, dev), dtype=acc)
        ops = (_TritonOps if _use_triton(dev, acc) else _TorchOps)(prefix, suffix, dtypes, swiglu_parts, pl, grads, tokens,
                                                                    next_weight)
        loss = torch.zeros((), dtype=acc, device=dev)
        param_storages = {q.untyped_storage().data_ptr() for q in params}
        fp16 = compute == torch.float16
        wscale = pl.wscale

        def pair_value(k, what, chunk, back):  # a part's per-pair value, in the graph if it needs a gradient
            if grads[k] is None:
                return ops.gather(k, chunk, what)
            return _PairSum.apply(token, ops, k, chunk, back, what)

        for chunk in pl.chunks:
            s0, n = chunk[:2]
            # The cross-entropy writes each pair's gradient times gs, the accumulators add the
            # chunk's gradients times back: gs * back = wscale, the pair weights' common scale.
            # bfloat16 and wider take the true weights (gs = wscale), as the materialised run
            # does: a 16-bit parameter gradient is then rounded once per chunk, not again after a
            # rescaling. float16 would underflow (1/|P| per pair): its parameter gradients are sums
            # over the chunk's pairs of O(1) per-pair terms (the weights are normalised), scaled
            # by 1/sqrt(n) they neither overflow 65504 nor fall to subnormals. Terms far above
            # O(1) (head activations in the hundreds at n ~ 30k pairs) still overflow where the
            # materialised run, scaled by 1/|P|, does not: smaller chunks or bf16 avoid it.
            gs, back = (n ** -0.5, wscale * n ** 0.5) if fp16 else (wscale, 1.0)
            saved = _SavedStorages()
            with torch.set_grad_enabled(backprop), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                # autograd numbers the nodes it makes in order: nodes after this one are the chunk's
                first = token.view(()).grad_fn._sequence_nr() if backprop else None
                xs = [pair_value(k, "sum", chunk, back) if k not in swiglu_parts
                      else pair_value(k, "swiglu", chunk, back) if fused
                      else swiglu(pair_value(k, "gate", chunk, back), pair_value(k, "up", chunk, back))
                      for k in range(n_parts)]
                logits = (_compiled_tail() if COMPILE else _call_tail)(tail, xs)
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
            loss += ops.cross_entropy_(z, chunk, backprop, gs)
            if not backprop:
                continue
            # The pair sums add into `grads` on the way. allow_unused: a head may hold
            # parameters its per-pair work does not use.
            gp = torch.autograd.grad(logits, [token] + wrt_params, grad_outputs=z, allow_unused=True)[1:]
            del logits, z
            for k, g in enumerate(gp):
                if g is not None:
                    if grad_params[k] is None:
                        grad_params[k] = torch.zeros(g.shape, dtype=acc, device=dev)
                    grad_params[k].add_(g, alpha=back)
        loss = loss * wscale
        it = iter(grad_params)
        grad_params = [next(it) if n else None for n in need_params]  # None: not used per pair
        halves = [(None, None) if g is None else g.split(BL) for g in grads]
        grad_prefix = [h[0] if n else None for h, n in zip(halves, need[:n_parts])]
        grad_suffix = [h[1] if n else None for h, n in zip(halves, need[n_parts : 2 * n_parts])]
        ctx.save_for_backward(*grad_prefix, *grad_suffix, *grad_params)
        ctx.shapes = [(t.shape, t.dtype) for t in inputs]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        no_double_backward("torch")
        out = [None if g is None else (grad_loss * g).to(dt).reshape(shape)
               for g, (shape, dt) in zip(ctx.saved_tensors, ctx.shapes)]
        return (None,) * 9 + tuple(out)


def _concat_parts(head):
    """The split of a head without pair_parts: [f ; 0] + [0 ; b] = [f_i ; b_j], then the head."""
    def tail(xs):
        return head(xs[0])

    def parts(f, b, lengths):
        xf, xb = concat_parts(f, b)
        return PairParts([xf], [xb], [f.dtype], tail)
    return parts


def pair_loss(f, b, tokens, head, p: Pairs, next_weight: float, vocab_size: int):
    """sum over pairs of weight * (lambda CE_next + (1 - lambda) CE_prev), a chunk of pairs at a time."""
    split = getattr(head, "pair_parts", None) or _concat_parts(head)
    parts = split(f, b, p.lengths)
    n = len(parts.prefix)
    for k in parts.swiglu:
        if not (isinstance(k, int) and 0 <= k < n and parts.prefix[k].shape[-1] % 2 == 0):
            raise ValueError(f"pair_parts: swiglu must list parts of even width ([gate | up]) among the {n} "
                             f"parts, got {k!r}")
    with on_device(f.device):  # the Triton engine's launches (the forward also takes every gradient)
        return _ChunkedLoss.apply(tokens, p, next_weight, vocab_size, parts.tail, list(parts.dtypes),
                                  tuple(parts.swiglu), n, torch.is_grad_enabled(), *parts.prefix, *parts.suffix,
                                  *head.parameters())
