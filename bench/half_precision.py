"""How often the torch backend breaks docs/contract.md §6's half-precision bound on tiny random heads,
against the same count for the materialised objective run against itself with its pairs in reverse
order (the noise of a per-draw comparison on tensors of a few elements). CPU, bf16.

    python bench/half_precision.py [--draws 80] [--window-rows N --chunk-pairs N] [--out bench/results/half_precision_cpu.md]

Two sets of draws:
- "heads": B=3, L=12, m=6, V=37, TextHead (hidden [9, 6], 3 layers) and the SwiGLU head with a
  LayerNorm in turn, parameters N(0, 0.36); reductions mean and sum, grad_output 1 and 0.7. The
  bound plain, and with §6's one extra rounding (2**-8) on every gradient at 0.7 (the head's
  parameters, f and b: all are mapped before grad_output reaches them).
- "tiny": an independent review's TextHeads: B <= 2, L <= 10, m <= 6, hidden <= 8, V <= 11, every
  activation, 2 or 3 layers, next_weight 0, 0.5 or 1, grad_output 1.
--window-rows 1 --chunk-pairs 7 runs the torch backend a window of one row at a time (Switches.window_rows;
a window holds at least one chunk's rows): the split layer's parameter gradients are then sums of one
rounded piece a window, and a row shared by two windows gets two.
"""
import argparse
import copy
import random
import sys
from pathlib import Path

import torch

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _helpers import bf16_head_draw  # noqa: E402
from bst_fast import TextHead, belief_state_loss  # noqa: E402
from bst_fast._pairs import ACTIVATIONS  # noqa: E402
from bst_fast.backends import runtime  # noqa: E402


def rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


def loss_and_grads(f, b, tokens, head, dtype, go, backend, **opts):
    h = copy.deepcopy(head).to(dtype)
    f, b = f.to(dtype).detach().clone().requires_grad_(), b.to(dtype).detach().clone().requires_grad_()
    loss = belief_state_loss(f, b, tokens, h, backend=backend, **opts)
    grads = torch.autograd.grad(loss * go, [f, b, *h.parameters()])
    return [loss.detach(), *grads], ["loss", "f", "b"] + [n for n, _ in h.named_parameters()]


def breaks(f, b, tokens, head, go, extra, **opts):
    """(torch backend breaks the bound, the reversed-pair materialised run breaks it)."""
    ref, names = loss_and_grads(f, b, tokens, head, torch.float64, go, "reference", **opts)
    mat, _ = loss_and_grads(f, b, tokens, head, torch.bfloat16, go, "reference", **opts)
    B, L = tokens.shape
    lengths = opts.get("lengths", torch.full((B,), L))
    pairs = [(r, i, j) for r in range(B) for i in range(int(lengths[r])) for j in range(i + 2, int(lengths[r]))][::-1]
    rev = {**opts, "pairs": tuple(torch.tensor(x) for x in zip(*pairs))}  # every pair: the same loss
    control, _ = loss_and_grads(f, b, tokens, head, torch.bfloat16, go, "reference", **rev)
    out, _ = loss_and_grads(f, b, tokens, head, torch.bfloat16, go, "torch", **opts)
    bound = [2 * rel(m, r) + 1e-3 + (extra if n != "loss" else 0.0) for m, r, n in zip(mat, ref, names)]
    return (any(rel(x, r) > q for x, r, q in zip(out, ref, bound)),
            any(rel(x, r) > q for x, r, q in zip(control, ref, bound)))


def heads_set(draws):
    counts = {}
    for seed in range(draws):
        f, b, tokens, head = bf16_head_draw(seed)  # the tests' draws (bf16 values; each run casts them)
        for red in ("mean", "sum"):
            for go in (1.0, 0.7):
                for extra in ((0.0,) if go == 1.0 else (0.0, 2.0 ** -8)):
                    key = (red, go, extra)
                    t, c = breaks(f, b, tokens, head, go, extra, lengths=torch.tensor([12, 6, 9]), next_weight=0.3,
                                  reduction=red)
                    counts[key] = [x + y for x, y in zip(counts.get(key, [0, 0]), (t, c))]
    return counts


def tiny_set(draws):
    rng, counts = random.Random(123), [0, 0]
    for c in range(draws):
        B, L, m, V, hid = rng.randint(1, 2), rng.randint(4, 10), rng.randint(1, 6), rng.randint(2, 11), rng.randint(1, 8)
        n_layers, act = rng.choice([2, 3]), ACTIVATIONS[c % 5]
        opts = dict(next_weight=rng.choice([0.5, 0.0, 1.0]), reduction=rng.choice(["mean", "sum"]))
        g = torch.Generator().manual_seed(1000 + c)
        f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
        tokens = torch.randint(0, V, (B, L), generator=g)
        torch.manual_seed(1000 + c)
        head = TextHead(m, V, hidden=hid, n_layers=n_layers, activation=act)
        with torch.no_grad():
            for q in head.parameters():
                q.mul_(2.0)
        t, k = breaks(f.bfloat16().double(), b.bfloat16().double(), tokens, head.bfloat16().double(), 1.0, 0.0, **opts)
        counts = [counts[0] + t, counts[1] + k]
    return counts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=80, help="draws of the heads set (the tiny set takes 150)")
    ap.add_argument("--window-rows", type=int, default=None, help="the torch backend's window of rows (Switches.window_rows)")
    ap.add_argument("--chunk-pairs", type=int, default=None, help="pairs a chunk (Switches.chunk_pairs)")
    ap.add_argument("--out", default=None, help="also write the tables (markdown) here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with runtime.switched(window_rows=args.window_rows, chunk_pairs=args.chunk_pairs):
        lines = tables(args)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("# Half-precision bound, counted on random tiny heads (`bench/half_precision.py`)\n\n"
                                  + "\n".join(lines) + "\n")


def tables(args):
    window = "" if args.window_rows is None else f", the torch backend in windows of {args.window_rows} row(s)"
    window += "" if args.chunk_pairs is None else f" and chunks of {args.chunk_pairs} pairs"
    lines = [f"torch {torch.__version__}, bf16 on the CPU{window}; draws breaking the bound (torch backend / the materialised run, pairs reversed)", "",
             f"Heads set, {args.draws} draws per row:", "", "| reduction | grad_output | bound | torch backend | control |",
             "| --- | --- | --- | --- | --- |"]
    for (red, go, extra), (t, c) in sorted(heads_set(args.draws).items()):
        lines.append(f"| {red} | {go} | 2x + 1e-3{' + 2**-8 (gradients)' if extra else ''} | {t} | {c} |")
    t, c = tiny_set(150)
    lines += ["", "Tiny set, 150 draws, grad_output 1, the plain bound:", "", "| torch backend | control |", "| --- | --- |",
              f"| {t} | {c} |"]
    return lines


if __name__ == "__main__":
    main()
