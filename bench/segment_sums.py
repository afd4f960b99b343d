"""Time the pair-hidden kernels (bst_fast/kernels/pair_hidden.py) alone, at one chunk of the SwiGLU
head's torch-backend shape, over a sweep of the segment kernels' launch configs.

In a training step of the SwiGLU head (m=512, hidden 2688, B=32, T=256, bf16) on an H200 the two
segment kernels took 68 ms of 142 (bench/results/h200-run4): ~0.75 ms a chunk each, against
~0.1 ms for the forward gather over the same rows. This script measures each kernel per chunk for
every config (the old one first, then the default, then a sweep of block shapes and warps), checks
that every config gives the first one's sums (up to float32 reassociation), and prints a table per
part, fastest first. Parts: the SwiGLU head's swiglu and residual sums (torch backend), a TextHead's
gelu sums (triton backend) and its first-layer sums (torch backend).

    python bench/segment_sums.py                                 # the sweep (CUDA)
    python bench/segment_sums.py --quick                         # two block shapes, then warps
    python bench/segment_sums.py --parts residual --configs 16x128x4 64x32x2   # just these
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

# bench/ is this script's folder, first on the path: segment_configs (the launch shapes by name)
# first, then pairs (its timer), which takes bench/ off the path and puts the project root on it
from segment_configs import CONFIGS
from pairs import timed as timed_s
from bst_fast._pairs import Pairs, pair_list
from bst_fast.backends import torch_backend
from bst_fast.backends.launch import chunk_config, gather_config
from bst_fast.backends.runtime import SWITCHES
from bst_fast.head import swiglu_hidden
from bst_fast.kernels.activation import ACT, NO_ACT, SWIGLU
from bst_fast.kernels.pair_hidden import pair_hidden, segment_grads

INNER = 10  # launches per timed sample on a GPU: a ~0.1 ms kernel's launch and the host clock amortised


def timed(fn, device, reps):
    """Median ms of one fn(): bench/pairs.py's timer over INNER calls a sample on a GPU, one on the
    CPU (the interpreter, a smoke test only); its warm-up sample compiles."""
    inner = INNER if device == "cuda" else 1
    return timed_s(lambda: [fn() for _ in range(inner)], device, reps)[0] / inner * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", nargs="+", default=None, help="only these parts (swiglu residual text-gelu text-sum)")
    ap.add_argument("--configs", nargs="+", default=None, metavar="BSxBKxWARPS",
                    help="time these configs (e.g. 16x128x4) after the old one and the default, no sweep")
    ap.add_argument("--structured", action="store_true",
                    help="structured_grad_kernel (Switches.structured_sums: PairList.jlo / alo) at every config, "
                         "BS x BK x WARPS its block_BO x block_BK x block_warps")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    B, T, m, V = args.batch, args.T, args.d_model, args.vocab
    hid = swiglu_hidden(m)
    BL = B * T
    # the torch backend's chunk for this head in bf16: its budget over (logits 2V, the residual
    # part 2m, the fused swiglu output hid) bf16 elements a pair (as _ChunkedLoss counts per_pair)
    chunk = torch_backend.chunk_pairs(2 * (2 * V + 2 * m + hid), dev, SWITCHES)
    lengths = torch.full((B,), T, dtype=torch.int64, device=dev)
    p = Pairs(lengths=lengths, prefix_start=torch.zeros_like(lengths), min_gap=2, max_gap=T,
              scale=torch.ones((), dtype=torch.float64, device=dev))
    # and the triton backend's for a TextHead (h = m, gelu, V, bf16)
    text_chunk = chunk_config(dev.type, V, [m, m], torch.bfloat16, SWITCHES)["chunk"]
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreted)"
    print(f"{name}: B={B} T={T} torch {torch.__version__}")

    # (part, kind, act, table width, output width, table dtype, chunk pairs): the SwiGLU head's two
    # parts in the torch backend, then a TextHead's first layer in the triton backend
    parts = [("swiglu", "swiglu", SWIGLU.value, 2 * hid, hid, torch.float32, chunk),
             ("residual", "sum", NO_ACT.value, 2 * m, 2 * m, torch.bfloat16, chunk),
             ("text-gelu", "act", ACT["gelu"], m, m, torch.float32, text_chunk),
             # the torch backend's TextHead: its first layer's pair sums, m wide, bf16 (chunk: its
             # budget over the logits and that sum)
             ("text-sum", "sum", NO_ACT.value, m, m, torch.bfloat16, torch_backend.chunk_pairs(2 * (2 * V + m), dev, SWITCHES))]
    if args.parts:
        parts = [q for q in parts if q[0] in args.parts]
    old = CONFIGS["old"]  # the shapes before bench/results/h200-run4 (BS, BK, warps), timed first
    rows = []
    for part, kind, act, wide, h, tdt, chunk in parts:
        pl = pair_list(p, B, T, chunk, structured=args.structured)
        mid = pl.chunks[len(pl.chunks) // 2]
        s0, n = mid.s0, mid.n
        print(f"{part}: pairs={pl.ia.numel()} chunks={len(pl.chunks)} chunk={n} pairs "
              f"(prefix segments {mid.pre_hi - mid.pre_lo}, suffix {mid.suf_hi - mid.suf_lo})")
        A = torch.randn(BL, wide, device=dev).to(tdt)
        Bm = torch.randn(BL, wide, device=dev).to(tdt)
        H = torch.empty(n, h, dtype=torch.bfloat16, device=dev)
        dH = torch.randn(n, h, device=dev).to(torch.bfloat16)
        base = gather_config("cuda", h, kind)
        if act == NO_ACT.value:  # a plain reference for the same sums: torch's index_add_ (atomics)
            dA = torch.zeros(2 * BL, wide, dtype=torch.float32, device=dev)
            ia, ib = pl.ia[s0 : s0 + n].long(), pl.ib[s0 : s0 + n].long()
            for side, idx in (("prefix", ia), ("suffix", ib)):
                ms = timed(lambda: dA.index_add_(0, idx, dH.float()), dev.type, args.reps)
                print(f"{part}: torch index_add_ of dH.float() ({side} rows) {ms:.3f} ms")
        fwd = timed(lambda: pair_hidden(A, Bm, pl, s0, n, H, act, base, False), dev.type, args.reps)
        gbytes = n * h * 2 / 1e9
        print(f"{part}: forward gather {fwd:.3f} ms ({gbytes / fwd * 1e3:.0f} GB/s of H written); default {base}")
        ref = None
        # the old config, the default, then block shapes at 2 warps, then the three fastest with 1
        # and 4 warps (each config compiles anew: well under a second each on the GPU machine)
        shapes = [(16, 64), (32, 32)] if args.quick else list(itertools.product((16, 32, 64, 128), (32, 64, 128)))
        default = ((base["block_BO"], base["block_BK"], base["block_warps"]) if args.structured
                   else (base["BS"], base["seg_BK"], base["seg_warps"]))
        sweep = [old[kind], default]
        if args.configs:
            sweep += [tuple(int(x) for x in c.split("x")) for c in args.configs]
        else:
            sweep += [(BS, BK, 2) for BS, BK in shapes]
        # each shape once, its block no wider than the rows (old and default can coincide)
        sweep = list(dict.fromkeys((BS, min(BK, base["BK"]), w) for BS, BK, w in sweep))
        first = len(sweep) + 1 if args.configs else len(sweep)  # explicit configs: no second round
        for BS, BK, warps in sweep:  # grows once, after the first round
            cfg = dict(base, BS=BS, seg_BK=BK, seg_warps=warps, block_BO=BS, block_BK=BK, block_warps=warps)
            dA = torch.zeros(2 * BL, wide, dtype=torch.float32, device=dev)
            only = {}
            for side in ("prefix", "suffix"):  # one side's kernel at a time (the structured suffix walk
                # reads the chunk's prefix range: the chunk stays whole)
                try:
                    only[side] = timed(lambda: segment_grads(dH, A, Bm, pl, mid, dA[:BL], dA[BL:], act, 1.0, cfg,
                                                             sides=(side,)), dev.type, args.reps)
                except Exception as e:  # a config that does not compile (shared memory, registers)
                    only[side] = None
                    print(f"  {BS}x{BK} w{warps} {side}: {type(e).__name__}: {str(e)[:120]}")
            dA.zero_()
            segment_grads(dH, A, Bm, pl, mid, dA[:BL], dA[BL:], act, 1.0, cfg)
            if ref is None:
                ref = dA.clone()
            err = ((dA - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
            row = dict(part=part, walk="structured" if args.structured else "listed", chunk=n, BS=BS, BK=BK, warps=warps, prefix_ms=only["prefix"],
                       suffix_ms=only["suffix"], forward_ms=fwd, rel_err_vs_first=err)
            rows.append(row)
            print(f"  {BS:3d}x{BK:<4d} w{warps}: prefix {only['prefix'] or float('nan'):.3f} ms  "
                  f"suffix {only['suffix'] or float('nan'):.3f} ms  err {err:.1e}", flush=True)
            if sum(r["part"] == part for r in rows) == first == len(sweep):
                best = sorted((r for r in rows if r["part"] == part and r["prefix_ms"] and r["suffix_ms"]),
                              key=lambda r: r["prefix_ms"] + r["suffix_ms"])[:3]
                sweep += [(r["BS"], r["BK"], w) for r in best for w in (1, 4) if (r["BS"], r["BK"], w) not in sweep]
    print()
    for part, kind, *_ in parts:
        ok = [r for r in rows if r["part"] == part and r["prefix_ms"] and r["suffix_ms"] and r["rel_err_vs_first"] < 1e-4]
        ok.sort(key=lambda r: r["prefix_ms"] + r["suffix_ms"])
        print(f"| {part} | BS | BK | warps | prefix ms | suffix ms | sum |\n| --- | --- | --- | --- | --- | --- | --- |")
        for r in ok[:6] + [r for r in ok[6:] if (r["BS"], r["BK"], r["warps"]) == old[kind]]:
            print(f"| | {r['BS']} | {r['BK']} | {r['warps']} | {r['prefix_ms']:.3f} | {r['suffix_ms']:.3f} "
                  f"| {r['prefix_ms'] + r['suffix_ms']:.3f} |")
        print()
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=name, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
