"""Time the pair cross-entropy kernel (bst_fast/kernels/cross_entropy.py) alone on one chunk of logits,
over its launch shapes, with and without the column sums (Switches.ce_bias_sums), against the column
sum the triton backend otherwise runs (torch's float32 sum over the chunk's rows).

On the H100 (bench/results/nvidia-h100-80gb-hbm3) the kernel took 47 ms of the BST original's
408 ms step, one row a program with a two-pass half. That is 287 chunks of about 29k rows at 1.4
TB/s, and the column sums of the logits' gradient took another 32 ms. The shapes, by name
ROWSxWARPS, with "2pass" for a half re-read from L1/L2 as a second pass:

- 1x4-2pass: the default (the shape measured on the H100), one row a program, two passes over each half;
- 1x4: one row, a half read once;
- 2x8, 4x8, 4x16: blocks of rows (8x16 spilled registers, ptxas sm_90);
- each with "+sums": the column sums of 64 rows a program written as partial rows and then summed.
  Compare it with the shape alone plus "column sum".

Every shape's loss rows and gradient are checked against the first shape's. Rows are ordered
fastest first, with GB/s counting 2V logits read and written a row.

    python bench/cross_entropy.py                     # a chunk of the paper's step (V = 1000, bf16)
    python bench/cross_entropy.py --rows 4096 --vocab 32000
    python bench/cross_entropy.py --device cpu --rows 9 --vocab 19 --reps 1   # interpreter smoke test
"""
from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from pairs import timed as timed_s  # bench/pairs.py's timer; it puts the project root on the path
from bst_fast.backends.launch import ce_config, chunk_config
from bst_fast.backends.runtime import SWITCHES
from bst_fast.kernels.activation import interpreted_bf16
from bst_fast.kernels.cross_entropy import ce_sum_programs, pair_cross_entropy_

SHAPES = [(1, 4, False), (1, 4, True), (2, 8, True), (4, 8, True), (4, 16, True)]  # 8 x 16 spilled (ptxas sm_90)


def chunk_arguments(description: str) -> argparse.ArgumentParser:
    """The options of a bench on one chunk of the paper's step (this one and bench/logits_ce.py)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=None,
                    help="rows of the chunk (default: the triton backend's chunk for a 3-layer head 512 wide)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    return ap


def chunk(args):
    """(device, V, dtype, rows n, generator, flat tokens, pair list) of one chunk: n pairs (ia, ia + 2)
    at random positions of 64 rows of 258 tokens, one weight for all."""
    dev, V, dtype = args.device, args.vocab, getattr(torch, args.dtype)
    n = args.rows or chunk_config(dev, V, [512, 512], dtype, SWITCHES)["chunk"]
    g = torch.Generator().manual_seed(0)
    L = 258
    tok = torch.randint(0, V, (64 * L,), generator=g).to(dev)
    ia = torch.randint(0, 64 * L - 3, (n,), generator=g)
    pl = SimpleNamespace(ia=ia.int().to(dev), ib=(ia + 2).int().to(dev), w=torch.ones(1, device=dev), w_stride=0,
                         meet_token=None)
    return dev, V, dtype, n, g, tok, pl


def report(title: str, rows, columns, out, **meta):
    """Print rows fastest first as a markdown table of columns ((header, key, format) each) under
    title, and write them with meta as JSON to out (None: not written)."""
    print(f"# {title}\n")
    print("| " + " | ".join(h for h, _, _ in columns) + " |\n|" + " --- |" * len(columns))
    for row in sorted(rows, key=lambda x: x["ms"]):
        print("| " + " | ".join(format(row[k], f) for _, k, f in columns) + " |")
    if out:
        with open(out, "w") as fh:
            json.dump(dict(**meta, results=rows), fh, indent=1)


def main():
    args = chunk_arguments(__doc__).parse_args()
    dev, V, dtype, n, g, tok, pl = chunk(args)
    Z0 = (torch.randn(n, 2 * V, generator=g) * 3).to(dev, dtype)
    Z, loss_rows = Z0.clone(), torch.empty(n, device=dev)
    up = interpreted_bf16(dtype)
    base = ce_config(dev, V)
    dc_part = torch.zeros(ce_sum_programs(n, base), 2 * V, device=dev)
    shapes = SHAPES if dev == "cuda" else [(1, 4, False), (2, 4, True)]
    gbytes = 2 * n * 2 * V * Z.element_size() / 1e9
    rows, first = [], None
    inner = 10 if dev == "cuda" else 1  # launches a timed sample: a ~0.1 ms kernel's launch amortised
    for r, w, one in shapes:
        one = one and V <= base["BV"]  # a half wider than a block takes two passes whatever the shape
        for sums in ((False, True) if one else (False,)):
            name = f"{r}x{w}" + ("" if one else "-2pass") + ("+sums" if sums else "")
            if any(row["shape"] == name for row in rows):
                continue

            # the shape as the backend's config; the column sums keep its rows a program
            cfg = dict(base, ce_sum_block=r, ce_sum_warps=w) if sums else dict(base, ce_rows=r, ce_warps=w, ce_one=one)

            def run():
                _, parts = pair_cross_entropy_(Z, tok, pl, 0, 0.5, 1.0, True, loss_rows, cfg, up, V,
                                               dc_part if sums else None)
                return parts.sum(0) if sums else None

            Z.copy_(Z0)
            got = (run(), loss_rows.clone(), Z.clone())
            if first is None:
                first = got
            err = max((got[1] - first[1]).abs().max().item(), (got[2].float() - first[2].float()).abs().max().item())
            if sums:  # the partial sums against a float32 column sum of the gradient written
                err = max(err, (got[0] - got[2].float().sum(0)).abs().max().item())
            # timed on its own output as logits (the same bytes and work): INNER launches a sample
            ms = timed_s(lambda: [run() for _ in range(inner)], dev, args.reps)[0] / inner * 1e3
            rows.append(dict(shape=name, ms=ms, gb_s=gbytes / ms * 1e3, err=err))
    Z.copy_(Z0)
    col = timed_s(lambda: [Z.sum(0, dtype=torch.float32) for _ in range(inner)], dev, args.reps)[0] / inner * 1e3
    rows.append(dict(shape="column sum (torch, float32)", ms=col, gb_s=gbytes / 2 / col * 1e3, err=0.0))
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    report(f"The pair cross-entropy on one chunk: {name}, {n} rows, V = {V}, {args.dtype}, median of {args.reps} "
           f"samples of {inner} launches", rows,
           [("shape", "shape", ""), ("ms", "ms", ".3f"), ("GB/s", "gb_s", ".0f"), ("max err vs the first", "err", ".1e")],
           args.out, device=name, rows_per_chunk=n, V=V, dtype=args.dtype)


if __name__ == "__main__":
    main()
