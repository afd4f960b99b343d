"""Shared test helpers: random inputs at odd sizes, the float64 reference on upcast copies, and the
relative errors of docs/contract.md §6."""
from __future__ import annotations

import copy

import torch
from torch import nn

from bst_fast import ResidualSwiGLUHead, TextHead, belief_state_loss

# docs/contract.md §6 tolerances against the float64 reference.
TOL = {
    torch.float64: (1e-10, 1e-10),  # (loss, each gradient by norm)
    torch.float32: (1e-5, 1e-4),
}


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||, in float64 (absolute error where ref is exactly zero)."""
    x, ref = x.detach().double(), ref.detach().double()
    d = (x - ref).norm().item()
    n = ref.norm().item()
    return d / n if n > 0 else d


def make_head(m, V, hidden=9, n_layers=2, activation="gelu", seed=0, scale=0.6):
    """A TextHead with N(0, scale^2) weights: larger than nn.Linear's default, so the softmax is
    not flat and every layer matters."""
    g = torch.Generator().manual_seed(seed)
    head = TextHead(m, V, hidden=hidden, n_layers=n_layers, activation=activation)
    with torch.no_grad():
        for q in head.parameters():
            q.copy_(torch.randn(q.shape, generator=g) * scale)
    return head


def make_inputs(B=3, L=13, m=7, V=13, seed=0, dtype=torch.float32, **head_kw):
    """(f, b, tokens, head), fresh random values from `seed`; f, b and head in `dtype`."""
    g = torch.Generator().manual_seed(1000 + seed)
    f = torch.randn(B, L, m, generator=g).to(dtype)
    b = torch.randn(B, L, m, generator=g).to(dtype)
    tokens = torch.randint(0, V, (B, L), generator=g)
    head = make_head(m, V, seed=seed, **head_kw).to(dtype)
    return f, b, tokens, head


def loss_and_grads(f, b, tokens, head, grad_out, *, wrt=("f", "b", "head"), **opts):
    """The loss and the gradients of grad_out * loss with respect to f, b and every head parameter
    (those named in `wrt`; None for the others). f, b and head are used as given (no copies)."""
    f = f.detach().requires_grad_("f" in wrt)
    b = b.detach().requires_grad_("b" in wrt)
    params = list(head.parameters())
    for q in params:
        q.requires_grad_("head" in wrt)
    loss = belief_state_loss(f, b, tokens, head, **opts)
    inputs = ([f] if "f" in wrt else []) + ([b] if "b" in wrt else []) + (params if "head" in wrt else [])
    grads = torch.autograd.grad(loss, inputs, grad_outputs=torch.as_tensor(grad_out, dtype=loss.dtype)) if inputs else ()
    grads = list(grads)
    out = {
        "f": grads.pop(0) if "f" in wrt else None,
        "b": grads.pop(0) if "b" in wrt else None,
    }
    for (name, _), g in zip(head.named_parameters(), grads if "head" in wrt else [None] * len(params)):
        out[name] = g
    return loss.detach(), out


def reference64(f, b, tokens, head, grad_out, **opts):
    """The float64 reference on upcast copies of f, b and the head (the same values, no rounding)."""
    opts = {k: v for k, v in opts.items() if k != "backend"}
    return loss_and_grads(f.double(), b.double(), tokens, copy.deepcopy(head).double(), grad_out,
                          backend="reference", **opts)


def errors(loss, grads, ref_loss, ref_grads):
    """{'loss': rel err, name: rel err of each gradient} for the gradients that exist."""
    out = {"loss": rel_err(loss, ref_loss)}
    for name, g in grads.items():
        if g is not None:
            out[name] = rel_err(g, ref_grads[name])
    return out


def random_grad_out(seed) -> float:
    """A random grad_output, bounded away from 0 and 1 (and sometimes negative)."""
    g = torch.Generator().manual_seed(77 + seed)
    x = float(torch.rand((), generator=g)) * 1.5 + 0.5
    return -x if seed % 3 == 2 else x


def with_generator(opts):
    """opts with `generator_seed` replaced by a fresh torch.Generator of that seed, so that two
    runs draw the same subsample."""
    opts = dict(opts)
    if "generator_seed" in opts:
        opts["generator"] = torch.Generator().manual_seed(opts.pop("generator_seed"))
    return opts


def check_against_reference(f, b, tokens, head, *, backend, dtype=torch.float32, seed=0,
                            wrt=("f", "b", "head"), **opts):
    """Runs `backend` in `dtype` and the float64 reference on the same values; asserts docs/contract.md §6.

    `generator_seed=s` in opts gives each run its own generator seeded with s. Returns the errors."""
    f, b, head = f.to(dtype), b.to(dtype), copy.deepcopy(head).to(dtype)
    go = random_grad_out(seed)
    ref_loss, ref_grads = reference64(f, b, tokens, head, go, **with_generator(opts))
    loss, grads = loss_and_grads(f, b, tokens, head, go, wrt=wrt, backend=backend, **with_generator(opts))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == acc, f"loss dtype {loss.dtype}, expected {acc}"
    assert loss.dim() == 0
    for name, g in grads.items():
        if g is not None:
            assert g.dtype == dtype, f"grad of {name} has dtype {g.dtype}, expected {dtype}"
            assert g.shape == ref_grads[name].shape
    err = errors(loss, grads, ref_loss, ref_grads)
    tol_loss, tol_grad = TOL[dtype]
    assert err["loss"] < tol_loss, f"{backend} {dtype}: loss {loss.item()} vs reference {ref_loss.item()}: {err}"
    for name, e in err.items():
        if name != "loss":
            assert e < tol_grad, f"{backend} {dtype}: gradient of {name} has relative error {e}: {err}"
    return err


class SwiGLUHead(nn.Module):
    """A residual SwiGLU head like the official BST code's: not a TextHead, no vocab_size attribute."""

    def __init__(self, m, V, h=10, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.inp = nn.Linear(2 * m, h)
            self.gate = nn.Linear(h, 2 * h, bias=False)
            self.up = nn.Linear(h, 2 * h, bias=False)
            self.down = nn.Linear(2 * h, h, bias=False)
            self.norm = nn.LayerNorm(h)
            self.out = nn.Linear(h, 2 * V)

    def forward(self, x):
        x = self.inp(x)
        x = x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))
        return self.out(self.norm(x))


def switch(monkeypatch, **changes):
    """The backends' runtime switches changed for one test (runtime.SWITCHES, the one place they live):
    Switches' field names, e.g. chunk_pairs=13 or triton_ops=True."""
    import dataclasses

    from bst_fast.backends import runtime

    monkeypatch.setattr(runtime, "SWITCHES", dataclasses.replace(runtime.SWITCHES, **changes))


def tiny_weight_float16_errors(run, f, b, tokens, head, V, scale, grad_output=1.0):
    """(loss error, [gradient errors of f, b and the head's parameters]) of a backend's
    `run(f, b, tokens, head, p, LossOptions(next_weight=0.5, vocab_size=V))` in float16 against
    float64, every pair of the rows weighed by `scale` (tiny: a mean over very many pairs), the
    gradients those of grad_output * loss (a loss scale)."""
    from bst_fast import _pairs, reference
    from bst_fast.backends.runtime import LossOptions

    p = _pairs.prepare(f, b, tokens, V, lengths=None, prefix_start=0, min_gap=2, max_gap=None,
                       pairs=None, next_weight=0.5, reduction="sum", generator=None)
    p.scale = torch.tensor(scale, dtype=torch.float64)
    options = LossOptions(next_weight=0.5, vocab_size=V)
    h64 = copy.deepcopy(head).double()
    f64, b64 = f.double().requires_grad_(), b.double().requires_grad_()
    ref = reference.run(f64, b64, tokens, h64, p, options)
    ref_g = torch.autograd.grad(ref * grad_output, [f64, b64, *h64.parameters()])
    h16 = copy.deepcopy(head).half()
    f16, b16 = f.half().requires_grad_(), b.half().requires_grad_()
    out = run(f16, b16, tokens, h16, p, options)
    g = torch.autograd.grad(out * grad_output, [f16, b16, *h16.parameters()])
    return rel_err(out, ref), [rel_err(x, y) for x, y in zip(g, ref_g)]


def bf16_head_draw(seed):
    """(f, b, tokens, head), all bfloat16: B=3, L=12, m=6, V=37; a TextHead (hidden [9, 6], 3
    layers) for an even seed, the SwiGLU head with a LayerNorm for an odd one, parameters
    N(0, 0.36) (norm weights about 1). The draws of test_heads' bf16 gradient test, which
    bench/half_precision.py counts."""
    g = torch.Generator().manual_seed(1000 + seed)
    B, L, m, V = 3, 12, 6, 37
    f = torch.randn(B, L, m, generator=g, dtype=torch.float64).bfloat16()
    b = torch.randn(B, L, m, generator=g, dtype=torch.float64).bfloat16()
    tokens = torch.randint(0, V, (B, L), generator=g)
    torch.manual_seed(seed)
    head = TextHead(m, V, hidden=[9, 6], n_layers=3) if seed % 2 == 0 else ResidualSwiGLUHead(m, V, hidden=10, bias=True)
    with torch.no_grad():
        for name, q in head.named_parameters():
            q.copy_(torch.randn(q.shape) * 0.6 + (1.0 if name == "norm.weight" else 0.0))
    return f, b, tokens, head.bfloat16()


def brute_force(f, b, tokens, head, chosen, weights, meet_token, next_weight):
    """sum of w * (lambda CE(next) + (1 - lambda) CE(prev)) over the chosen (r, i, j), one pair at a
    time, from the contract's definitions (not from reference.py); a pair with j - i = 1 takes
    meet_token as both labels (docs/contract.md §8)."""
    total = torch.zeros((), dtype=torch.float64)
    for (r, i, j), w in zip(chosen, weights):
        z = head(torch.cat([f[r, i], b[r, j]]))
        V = z.shape[0] // 2
        y_next, y_prev = (meet_token, meet_token) if j - i == 1 else (int(tokens[r, i + 1]), int(tokens[r, j - 1]))
        ce_next = torch.logsumexp(z[:V], 0) - z[y_next]
        ce_prev = torch.logsumexp(z[V:], 0) - z[V + y_prev]
        total = total + w * (next_weight * ce_next + (1 - next_weight) * ce_prev)
    return total


def grads_of(loss, f, b, head, go):
    """[loss, d(go * loss)/df, /db, / every head parameter]."""
    return [loss.detach()] + list(torch.autograd.grad(loss, [f, b, *head.parameters()],
                                                      grad_outputs=torch.tensor(go, dtype=loss.dtype)))


def contract_weights(chosen, full, kind, reduction, B):
    """Each chosen pair's weight as docs/contract.md §4, §5 and §9 define it: `full[r]` = |P_r|, kind
    "all", "listed" or "sampled" (a sampled pair of row r stands for |P_r| / k_r pairs)."""
    n_r = {}
    for r, _, _ in chosen:
        n_r[r] = n_r.get(r, 0) + 1
    weights = []
    for r, _, _ in chosen:
        stands = full[r] / n_r[r] if kind == "sampled" else 1.0
        if reduction == "sum":
            weights.append(stands)
        elif reduction == "mean":
            weights.append(stands / (len(chosen) if kind == "listed" else sum(full)))
        else:  # row_mean: the row's mean over its pairs (all, listed or drawn), then over all B rows
            weights.append(1.0 / (n_r[r] * B))
    return weights


def checked_draw(p, sets, pairs):
    """The sampler's draw in `p` as (r, i, j), checked against docs/contract.md §5: distinct pairs,
    each in its row's set `sets[r]`, k_r of them (from the fraction or the count `pairs`)."""
    chosen = list(zip(p.row.tolist(), p.i.tolist(), p.j.tolist()))
    assert len(set(chosen)) == len(chosen), "drawn without replacement"
    for r, s in enumerate(sets):
        drawn = [(i, j) for rr, i, j in chosen if rr == r]
        assert set(drawn) <= set(s)
        k = min(max(1, round(pairs * len(s))) if isinstance(pairs, float) else pairs, len(s))
        assert len(drawn) == k, (r, drawn, k)
    return chosen


def star_fields_for(data) -> dict:
    """configs/tiny_test.yaml's star-graph fields at their defaults when `data` is text, which refuses
    them (TrainConfig.check: a text run does not read them); {} for star graphs."""
    from bst_fast.config import STAR_FIELDS, TrainConfig

    return {} if data == "star" else {k: TrainConfig.__dataclass_fields__[k].default for k in STAR_FIELDS}


# The end of a test's torchrun script: its group ended, then the process leaves without the
# interpreter's teardown, where gloo's threads aborted a finished rank about one loaded run in ten
# (SIGABRT, 'terminate called without an active exception'), as the CLI (bst_fast.__main__.cli) does.
DDP_SCRIPT_END = ("import os, sys, torch.distributed as dist\n"
                  "dist.destroy_process_group() if dist.is_initialized() else None\n"
                  "sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n")


def torchrun(script, *args, nproc: int = 2) -> list:
    """The command that runs `script` (with args) on nproc local DDP ranks. --standalone lets the
    rendezvous bind a free port: a fixed --master_port failed with EADDRINUSE whenever another
    process (a second test run, a previous test's socket) held it."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            str(script), *map(str, args)]
