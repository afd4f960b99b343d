"""The pair loss's three GEMM shapes per chunk: cuBLAS (torch.mm, what the triton backend runs)
against a plain Triton tensor-core GEMM, side by side in one run.

Issue 23 asks whether the chunk's matrix products leave speed behind (K = h is a short main loop,
N = 2V = 2000 fills no 128- or 256-wide tile) and whether a Triton GEMM, the base that a fused
prologue (the pair gather) or epilogue (the cross-entropy) would build on, can match cuBLAS there.
Per chunk of n pairs, widths h (the last hidden layer) and V:

    logits  Z  = H W^T      (n, h) x (h, 2V)   -> (n, 2V) bf16    2 n h 2V FLOPs
    dH         = dZ W       (n, 2V) x (2V, h)  -> (n, h) bf16     2 n h 2V FLOPs
    dW         = dZ^T H     (2V, n) x (n, h)   -> (2V, h) float32 2 n h 2V FLOPs (K = n: long)

each also with 2V padded to 2048 (Switches.vocab_pad). n is the chunk the backend takes
(launch.chunk_config at the default 256 MB budget).

The Triton GEMM (`matmul_kernel`): a program computes a BM x BN tile of C = A B with float32
accumulation over K in BK steps (tl.dot: wgmma on sm_90 where the tile allows), programs grouped
GROUP_M tiles along M so that consecutive programs share B's column tiles in L2. Cost: 2 M N K
FLOPs; A read N / BN times and B M / BM times (mostly L2), C written once. No atomics, no split-K.
It is a measuring stick, not a backend: nothing in bst_fast calls it.

    python bench/gemm_shapes.py --device cuda                    # both widths, every config
    python bench/gemm_shapes.py --device cuda --quick            # three configs (gpu.sh's gemm step)
    python bench/gemm_shapes.py --compile-only                   # sm_90 registers, spills, wgmma (no GPU)
    TRITON_INTERPRET=1 python bench/gemm_shapes.py --device cpu --tiny   # correctness only
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

# bench/ is this script's folder, first on the path: pairs.py's timer (importing it puts the
# project root on the path)
from pairs import timed

# (BM, BN, BK, warps, stages): the Hopper tile shapes the Triton matmul tutorial and cuBLAS's
# picks in bench/results/h200-run3's profile (128x272, 192x128, 192x192) suggest
CONFIGS = [(128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4)]
QUICK = CONFIGS[:3]  # --quick: each layout and output dtype compiles once a config (~1-3 s each)


@triton.jit
def matmul_kernel(a, b, c, M, N, K, sam, sak, sbk, sbn, scm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    # C[M, N] = A[M, K] B[K, N], float32 accumulation, C in its own dtype (row stride scm, unit
    # column stride); A and B by strides, so a transposed operand is a view, never a copy
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pm = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pn = (pid % (GROUP_M * tiles_n)) // rows_in_group
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptr = a + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
    b_ptr = b + rk[:, None].to(tl.int64) * sbk + rn[None, :] * sbn
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        x = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] < K - k0), other=0.0)
        y = tl.load(b_ptr, mask=(rk[:, None] < K - k0) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, y, acc)
        a_ptr += BK * sak
        b_ptr += BK * sbk
    tl.store(c + rm[:, None].to(tl.int64) * scm + rn[None, :], acc.to(c.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_mm(a, b, out_dtype, config):
    """a @ b through matmul_kernel with `config` (BM, BN, BK, warps, stages)."""
    BM, BN, BK, warps, stages = config
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                        BM=BM, BN=BN, BK=BK, GROUP_M=8, num_warps=warps, num_stages=stages)
    return c


def shapes(n: int, h: int, V2: int, dtype):
    """(name, A shape, B shape, layout, out dtype) of the chunk's three products, operands in
    `dtype`: A (M, K) and B (K, N) are made as views of the tensors the backend holds."""
    return [("logits Z = H W^T", (n, h), (V2, h), "t", dtype),
            ("dH = dZ W", (n, V2), (V2, h), "n", dtype),
            ("dW = dZ^T H", (n, V2), (n, h), "at", torch.float32)]


def operands(spec, device, gen, dtype):
    _, sa, sb, kind, out = spec
    A = torch.randn(*sa, device=device, generator=gen).to(dtype)
    Bm = torch.randn(*sb, device=device, generator=gen).to(dtype)
    if kind == "t":  # H (n, h) times W^T: W is (2V, h)
        return A, Bm.t(), out
    if kind == "at":  # dZ^T (2V, n) times H (n, h)
        return A.t(), Bm, out
    return A, Bm, out


def cublas_mm(a, b, out_dtype):
    """What the triton backend runs (head.mm_f32 for the float32 dW)."""
    if not a.is_cuda:  # the interpreter's check: exact products, float32 sums
        return (a.float() @ b.float()).to(out_dtype)
    if out_dtype == torch.float32:
        from bst_fast.head import mm_f32
        return mm_f32(a, b)
    return a @ b


def timed_ms(fn, device, reps):
    """Median ms of fn() over reps runs after a warm-up (bench/pairs.py's timer)."""
    return timed(fn, device, reps)[0] * 1e3


def compile_only():
    """Compile every config for sm_90 (no GPU needed): registers, spills and whether wgmma appears."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    try:
        ptxas = get_ptxas(90).path
    except TypeError:  # older Triton: no arch argument
        ptxas = get_ptxas().path
    ints = {"M", "N", "K", "sam", "sak", "sbk", "sbn", "scm"}
    rows = []
    for out in ("*bf16", "*fp32"):
        for BM, BN, BK, warps, stages in CONFIGS:
            consts = dict(BM=BM, BN=BN, BK=BK, GROUP_M=8)
            sig = {nm: "constexpr" if nm in consts else "i32" if nm in ints else (out if nm == "c" else "*bf16")
                   for nm in ("a", "b", "c", "M", "N", "K", "sam", "sak", "sbk", "sbn", "scm", *consts)}
            # the unit strides and 16-divisible sizes a real launch specialises on
            names = list(sig)
            unit = {"sak", "sbn"}
            attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(names)
                     if nm not in consts and nm not in unit}
            consts.update({nm: 1 for nm in unit})
            for nm in unit:
                sig[nm] = "constexpr"
            k = triton.compile(ASTSource(fn=matmul_kernel, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as fh:
                fh.write(k.asm["ptx"])
                fh.flush()
                rep = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", fh.name, "-o", "/dev/null"],
                                     capture_output=True, text=True, check=True).stderr
            regs = max(int(x) for x in re.findall(r"Used (\d+) registers", rep))
            spills = max(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", rep))
            wgmma = "wgmma" in k.asm["ptx"]
            rows.append(dict(out=out, config=[BM, BN, BK, warps, stages], registers=regs, spills=spills, wgmma=wgmma))
            print(f"{out} {BM}x{BN}x{BK} w{warps} s{stages}: {regs} registers, {spills} bytes spilled, "
                  f"wgmma {'yes' if wgmma else 'NO'}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", action="store_true",
                    help="small shapes in float16 (the interpreter, whose tl.dot of bf16 is wrong: correctness only)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--quick", action="store_true", help=f"only the first {len(QUICK)} configs")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    if args.compile_only:
        rows = compile_only()
        if args.out:
            json.dump(dict(compile=rows), open(args.out, "w"), indent=1)
        bad = [r for r in rows if r["spills"] or not r["wgmma"]]
        raise SystemExit(1 if bad else 0)
    from bst_fast.backends.launch import chunk_config
    from bst_fast.backends.runtime import SWITCHES

    dev = args.device
    dtype = torch.float16 if args.tiny else torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.tiny:
        cases, configs = [("tiny", 70, 24, 2 * 13), ("tiny padded", 70, 24, 32)], [(16, 16, 16, 4, 1), (32, 16, 16, 4, 2)]
    else:
        cases, configs = [], QUICK if args.quick else CONFIGS
        for h in (512, 768):  # pairs-a's and the profile's width, V = 1000
            n = chunk_config("cuda", 1000, [h], torch.bfloat16, SWITCHES)["chunk"]
            cases += [(f"h={h}", n, h, 2000), (f"h={h} padded", n, h, 2048)]
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    print(f"device: {name}")
    rows, failed = [], []
    for case, n, h, V2 in cases:
        for spec in shapes(n, h, V2, dtype):
            a, b, out = operands(spec, dev, gen, dtype)
            M, K, N = a.shape[0], a.shape[1], b.shape[1]
            flops = 2 * M * N * K
            ref = cublas_mm(a, b, out)
            want = a.double() @ b.double()
            scale = want.abs().max().item()
            res = dict(case=case, product=spec[0], M=M, N=N, K=K, out=str(out).replace("torch.", ""))
            res["cublas_ms"] = timed_ms(lambda: cublas_mm(a, b, out), dev, args.reps)
            res["cublas_tflops"] = flops / res["cublas_ms"] / 1e9
            best = None
            for cfg in configs:
                try:
                    got = triton_mm(a, b, out, cfg)
                except Exception as e:  # a config over the card's shared memory
                    print(f"  {case} {spec[0]} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                err = ((got.double() - want).abs().max() / scale).item()
                ref_err = ((ref.double() - want).abs().max() / scale).item()
                if err > 2 * ref_err + 1e-6:
                    failed.append((case, spec[0], cfg, err, ref_err))
                    continue
                ms = timed_ms(lambda: triton_mm(a, b, out, cfg), dev, args.reps)
                if best is None or ms < best[0]:
                    best = (ms, cfg, err)
            if best:
                res.update(triton_ms=best[0], triton_config=list(best[1]), triton_tflops=flops / best[0] / 1e9,
                           triton_vs_cublas=res["cublas_ms"] / best[0], triton_err=best[2])
            rows.append(res)
            print(f"{case:12s} {spec[0]:18s} M={M:6d} N={N:5d} K={K:6d}: cuBLAS {res['cublas_ms']:8.3f} ms "
                  f"{res['cublas_tflops']:7.1f} TFLOP/s"
                  + (f" | Triton {best[0]:8.3f} ms {res['triton_tflops']:7.1f} TFLOP/s {tuple(best[1])} "
                     f"({res['triton_vs_cublas']:.2f}x cuBLAS's speed)" if best else " | Triton: no config"), flush=True)
    if args.out:
        json.dump(dict(device=name, rows=rows, failed=[list(map(str, f)) for f in failed]), open(args.out, "w"), indent=1)
    for f in failed:
        print("!! wrong result:", f)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
