"""Time the last layer's logits, cross-entropy and bias-gradient sums on one chunk: the unfused path the
triton backend runs by default (cuBLAS's addmm, pair_cross_entropy_kernel, torch's float32 column
sum), the same with the cross-entropy's column sums (ce_bias_sums), and the fused kernel
(kernels/logits_cross_entropy.py, the switch fused_ce) under several block shapes.

On the H100 (bench/results/nvidia-h100-80gb-hbm3) the BST original's step spent about 86 us a chunk in
the logits GEMM, 164 us in the cross-entropy and about 90 us in the column sums (287 chunks of ~29k
rows, V = 1000, K = 512). Prediction for the fused kernel: 130-200 us a chunk (the GEMM on Triton's
wgmma at 0.55-0.89x cuBLAS, bench/gemm_shapes.py, with the softmax and the gradient's write in its
epilogue), so 40-60 ms less a step.

Shapes by name BMxBN/BK wWARPS sSTAGES. Every row's loss, gradient and bias sums are checked against
the unfused default's; "GEMM TFLOP/s" counts the 2 n K 2V FLOPs of the logits.

    python bench/logits_ce.py                       # a chunk of the paper's step (V = 1000, K = 512, bf16)
    python bench/logits_ce.py --device cpu --rows 37 --vocab 19 --K 24 --reps 1   # interpreter smoke test
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cross_entropy import chunk, chunk_arguments, report  # bench/cross_entropy.py's chunk and table
from pairs import timed as timed_s  # bench/pairs.py's timer; it puts the project root on the path
from bst_fast.backends.launch import ce_config, logits_ce_config
from bst_fast.kernels.activation import interpreted_bf16
from bst_fast.kernels.cross_entropy import ce_sum_programs, pair_cross_entropy_
from bst_fast.kernels.logits_cross_entropy import logits_ce_programs, pair_logits_cross_entropy_

# (BM, BN, BK, warps, stages); ptxas sm_90 at K = 512, V = 1000, bf16, none spilling: 246, 250, 176,
# 168, 255 and 168 registers (64 x 128 on 4 warps fits two programs an SM, the first two one)
CUDA_SHAPES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 8, 3), (128, 64, 32, 8, 3),
               (64, 128, 64, 4, 3), (64, 64, 64, 4, 3)]


def main():
    ap = chunk_arguments(__doc__)
    ap.add_argument("--K", type=int, default=512, help="the last layer's input width")
    args = ap.parse_args()
    dev, V, dtype, n, g, tok, pl = chunk(args)
    K = args.K
    H = torch.randn(n, K, generator=g).relu().to(dev, dtype)  # a ReLU layer's output
    W = (torch.randn(2 * V, K, generator=g) * 3 / K**0.5).to(dev, dtype)
    c = (torch.randn(2 * V, generator=g) * 0.1).to(dev, dtype)
    up = interpreted_bf16(dtype)
    base = ce_config(dev, V)
    Z = torch.empty(n, 2 * V, dtype=dtype, device=dev)
    loss_rows = torch.empty(2 * n, device=dev)
    dc_ce = torch.zeros(ce_sum_programs(n, base), 2 * V, device=dev)
    inner = 5 if dev == "cuda" else 1  # launches a timed sample
    gflop = 2 * n * K * 2 * V / 1e9

    def unfused(sums):
        torch.addmm(c, H, W.t(), out=Z)
        _, parts = pair_cross_entropy_(Z, tok, pl, 0, 0.5, 1.0, True, loss_rows, base, up, V, dc_ce if sums else None)
        return parts.sum(0) if sums else Z.sum(0, dtype=torch.float32)

    variants = [("unfused (addmm, cross-entropy, column sum)", lambda: unfused(False), None),
                ("unfused, ce_bias_sums", lambda: unfused(True), None)]
    shapes = CUDA_SHAPES if dev == "cuda" else [None]
    for shape in shapes:
        cfg = logits_ce_config(dev, dtype, K) if shape is None else dict(zip(
            ("lce_BM", "lce_BN", "lce_BK", "lce_warps", "lce_stages"), shape))
        dc_part = torch.empty(logits_ce_programs(n, cfg), 2 * V, device=dev)

        def fused(cfg=cfg, dc_part=dc_part):
            _, parts = pair_logits_cross_entropy_(H, W, c, Z, tok, pl, 0, 0.5, 1.0, True, loss_rows, dc_part, cfg, up, V)
            return parts.sum(0)

        name = "fused {lce_BM}x{lce_BN}/{lce_BK} w{lce_warps} s{lce_stages}".format(**cfg)
        variants.append((name + (" (default)" if cfg == logits_ce_config(dev, dtype, K) else ""), fused, cfg))

    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    meta = dict(device=name, rows_per_chunk=n, K=K, V=V, dtype=args.dtype)
    # a different order of bf16 products (cuBLAS's, the fused kernel's wgmma) moves results by
    # rounding; a wrong result by far more (float32: exact on the CPU, TF32 products on a GPU)
    bound = 2e-2 if dtype != torch.float32 else (1e-5 if dev == "cpu" else 5e-3)
    rows, first, failed = [], None, {}

    def save(complete: bool):
        """The rows so far as JSON (rewritten after each variant: a run cut short by its time box,
        gpu.sh's, leaves what it measured, marked incomplete)."""
        if args.out:
            part = Path(str(args.out) + ".part")
            part.write_text(json.dumps(dict(**meta, complete=complete, bound=bound, failed=failed, results=rows),
                                       indent=1))
            part.replace(args.out)

    for variant, run, cfg in variants:
        try:
            dc = run()
        except Exception as e:  # noqa: BLE001  (one block shape that fails to compile or launch costs its row only)
            failed[variant] = f"raised {type(e).__name__}: {str(e)[:300]}"
            print(f"logits_ce: {variant} {failed[variant]}", file=sys.stderr, flush=True)
            save(False)
            continue
        per_row = loss_rows[:n] + loss_rows[n : 2 * n] if cfg else loss_rows[:n].clone()
        got = (dc, per_row, Z.clone())
        if first is None:  # the reference: the unfused default, unless it raised
            first = got
            meta["reference"] = variant
        err = max((got[0] - first[0]).abs().max().item() / first[0].abs().max().clamp_min(1e-30).item(),
                  (got[1] - first[1]).abs().max().item() / first[1].abs().max().clamp_min(1e-30).item(),
                  (got[2].float() - first[2].float()).abs().max().item() / first[2].float().abs().max().item())
        if not err < bound:  # timed all the same, and named: the exit status says so
            failed[variant] = f"differs from the first variant by {err:.3g} (bound {bound})"
            print(f"logits_ce: {variant} {failed[variant]}", file=sys.stderr, flush=True)
        ms = timed_s(lambda: [run() for _ in range(inner)], dev, args.reps)[0] / inner * 1e3
        rows.append(dict(variant=variant + (" FAIL" if variant in failed else ""), ms=ms, gemm_tflop_s=gflop / ms,
                         rel_err_vs_first=err, **(cfg or {})))
        print(f"logits_ce: {rows[-1]['variant']}: {ms:.3f} ms, error {err:.1e}", flush=True)
        save(False)
    ms = timed_s(lambda: [torch.addmm(c, H, W.t(), out=Z) for _ in range(inner)], dev, args.reps)[0] / inner * 1e3
    rows.append(dict(variant="addmm alone (cuBLAS logits)", ms=ms, gemm_tflop_s=gflop / ms, rel_err_vs_first=0.0))
    report(f"The last layer's logits and cross-entropy on one chunk: {name}, {n} rows, K = {K}, V = {V}, "
           f"{args.dtype}, median of {args.reps} samples of {inner} calls", rows,
           [("variant", "variant", ""), ("ms", "ms", ".3f"), ("GEMM TFLOP/s", "gemm_tflop_s", ".0f"),
            ("max rel. err vs the first", "rel_err_vs_first", ".1e")], None)
    save(True)
    if failed:
        raise SystemExit(f"logits_ce: {len(failed)} variant(s) failed: " + "; ".join(f"{k} {v}" for k, v in failed.items()))


if __name__ == "__main__":
    main()
