"""The pair loss's speed levers, each timed against the code's defaults in one process, interleaved.

    python bench/levers.py --device cuda                     # B=32, T=256, m=h=512, V=1000, bf16, triton
    python bench/levers.py --device cpu --batch 2 --T 8 --d-model 8 --hidden 8 --vocab 19 --reps 2   # (interpreter)

A lever is a runtime switch (bst_fast/backends/runtime.py Switches) that changes how the objective
runs, not what it computes. Each stays off until this bench has timed it on a GPU; a lever that pays
becomes the default. The settings (LEVERS):

- "default": the switches as they are;
- "bias_in_gemm": the bias gradients as one more output column of the weight GEMMs ([H | 1]), no
  column sum re-reading each chunk's logits gradient (prediction: the sums took about 8% of the
  H200's all-pairs step at m=768, run 3's profile; the GEMM grows by 8 / h columns);
- "vocab_pad=128", "vocab_pad=256": each half of the last layer padded from V to a tile multiple
  (V = 1000 to 1024; 2.4% more GEMM FLOPs, in exchange for full 128 / 256-wide tiles);
- "structured_sums": the segment sums of an all-pairs list by structured_grad_kernel: a block of
  positions a program, walking the other side by arithmetic, one load of a block of dH rows a
  step, no index chains and no binary search (prediction: the listed sums were 63 of the 414 ms
  H200 step, bound by chains of dependent loads; at ~2 TB/s both sides take 15-20 ms there);
- "ce_bias_sums": the cross-entropy in blocks of rows, each half read once, writing the last
  layer's bias gradient as partial column sums; its first form, 16 rows a program one at a time,
  was 0.893x on the H100 (the column sum and the cross-entropy's second
  read of each row go, without bias_in_gemm's wider dW GEMM: its ones column adds a 128-wide
  tile for 8 columns at h = 512 or 768); with bias_in_gemm the hidden layers keep the fold;
- "all": bias_in_gemm, ce_bias_sums, vocab_pad=128 and structured_sums together;
- "fused_ce": the last layer's GEMM with the cross-entropy and the bias sums in its epilogue
  (kernels/logits_cross_entropy.py; prediction: the logits' separate passes, the cross-entropy's
  read and write and the column sum's read, go for a Triton GEMM in place of cuBLAS's: 28.4 ms to
  about 20-23 at this shape); with vocab_pad=128 (full column blocks) and with a 512 MB chunk;
- "relu_in_gemm", "hidden_sums" (a head with hidden layers only: --layers 3, the paper's relu head
  with --activation relu): a relu hidden layer's activation in cuBLASLt's GEMM epilogue, and the
  hidden layers' activation gradient with their bias sums in one kernel (prediction: about 9 of the
  BST original's ~19 ms of hidden-layer elementwise passes a step go); and all three together;
- "split_16bit": the split first layer's six GEMMs (A, B and their gradients over the B x T rows)
  with bf16 operands and float32 sums instead of float32 GEMMs off the tensor cores (prediction:
  12 B T m h1 FLOPs, 26 GFLOP at this shape, 39 at m = 768: 0.5-0.7 ms at float32's ~55 TFLOP/s,
  to under 0.1 ms);
- "chunk=384MB", "chunk=512MB": a larger chunk, fewer launches (H200 run 2: 384 MB 25.8 ms against
  128 MB 32.3), at the cost of memory;
- "device_sampler" (pairs=0.02 rows only): the subsample drawn on the device instead of by the
  C++ sampler on the host;
- "pairs=0.02 device pair list" (host_pairs off): the subsample's pair list built on the device
  (two host synchronisations, the draw's read of the lengths, device sorts) instead of on the host
  (docs/backends.md "Host pair lists"). Timed one call at a time, both rows include their host
  work; in a training step the host list is made while the GPU runs the encoders
  (bench/paper_speed.py's pair-loss phase: gpu.sh's paper step, its device-pairs variant against the
  column with the switches in force).

Every setting's loss and gradients are checked against the defaults' before timing (another
sampler's at pairs=1.0, where it must draw all pairs, against the all-pairs defaults; float32
relative error; bf16 GEMMs in another order differ by rounding, a wrong result by far more). The
reps run round-robin over the settings, so drift of the machine reaches all alike. Writes
<out>/levers.json and levers.md (out: bench/results/<device>/ by default).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bst_fast import TextHead, belief_state_loss  # noqa: E402
from bst_fast._pairs import pair_counts  # noqa: E402
from bst_fast.backends import runtime  # noqa: E402

# bench/pairs.py's memory probe and device name, loaded by path (bench/ stays off sys.path: its
# profile.py would shadow the standard library's module)
_spec = importlib.util.spec_from_file_location("bench_pairs", ROOT / "bench" / "pairs.py")
bench_pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pairs)

MB = 2**20
# name -> (Switches changes, whether the row subsamples pairs=0.02)
LEVERS = {
    "default": ({}, False),
    "bias_in_gemm": (dict(bias_in_gemm=True), False),
    "vocab_pad=128": (dict(vocab_pad=128), False),
    "vocab_pad=256": (dict(vocab_pad=256), False),
    "bias_in_gemm+vocab_pad=128": (dict(bias_in_gemm=True, vocab_pad=128), False),
    "structured_sums": (dict(structured_sums=True), False),
    "ce_bias_sums": (dict(ce_bias_sums=True), False),
    "ce_bias_sums+bias_in_gemm": (dict(ce_bias_sums=True, bias_in_gemm=True), False),
    "all": (dict(bias_in_gemm=True, ce_bias_sums=True, vocab_pad=128, structured_sums=True), False),
    "fused_ce": (dict(fused_ce=True), False),
    "fused_ce+vocab_pad=128": (dict(fused_ce=True, vocab_pad=128), False),
    "fused_ce+chunk=512MB": (dict(fused_ce=True, triton_chunk_bytes=512 * MB), False),
    "relu_in_gemm": (dict(relu_in_gemm=True), False),
    "hidden_sums": (dict(hidden_sums=True), False),
    "relu_in_gemm+hidden_sums": (dict(relu_in_gemm=True, hidden_sums=True), False),
    "fused_ce+relu_in_gemm+hidden_sums": (dict(fused_ce=True, relu_in_gemm=True, hidden_sums=True), False),
    "split_16bit": (dict(split_16bit=True), False),
    "chunk=384MB": (dict(triton_chunk_bytes=384 * MB), False),
    "chunk=512MB": (dict(triton_chunk_bytes=512 * MB), False),
    "pairs=0.02": ({}, True),
    "pairs=0.02 device_sampler": (dict(device_sampler=True), True),
    "pairs=0.02 device pair list": (dict(host_pairs=False), True),
}


def _rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--activation", default="gelu", help="the TextHead's (the paper's head: relu)")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--levers", nargs="+", default=list(LEVERS), choices=list(LEVERS))
    ap.add_argument("--out", default=None, help="folder (default bench/results/<device>/)")
    args = ap.parse_args(argv)
    # the baselines the asked settings compare with: the defaults, and pairs=0.02 for subsampled rows
    baselines = ["default"] + (["pairs=0.02"] if any(LEVERS[n][1] for n in args.levers) else [])
    levers = list(dict.fromkeys(baselines + args.levers))

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    B, T, m, V = args.batch, args.T, args.d_model, args.vocab
    head = TextHead(m, V, hidden=args.hidden, n_layers=args.layers, activation=args.activation).to(dev, dtype)
    f = torch.randn(B, T, m, generator=g).to(dev, dtype).requires_grad_()
    b = torch.randn(B, T, m, generator=g).to(dev, dtype).requires_grad_()
    tokens = torch.randint(0, V, (B, T), generator=g).to(dev)
    leaves = [f, b, *head.parameters()]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(name, fraction=0.02):
        changes, sub = LEVERS[name]
        # the trainer's generator is a CPU one (a device generator's seed draw would synchronise);
        # the device sampler draws from one on the device
        gen_dev = dev if "device_sampler" in changes else "cpu"
        opts = dict(pairs=fraction, generator=torch.Generator(device=gen_dev).manual_seed(1)) if sub else {}
        with runtime.switched(**changes):
            loss = belief_state_loss(f, b, tokens, head, backend=args.backend, **opts)
            return loss.detach(), torch.autograd.grad(loss, leaves)

    # each setting against the defaults on the same rows; the subsampled rows on the same draw, and
    # another sampler (its own draw) at pairs=1.0, where every sampler draws all pairs: the defaults'
    # A setting that raises or differs is reported and not timed; the others still are (one GPU run
    # must not lose every lever to one of them).
    ref = {LEVERS[name][1]: run(name) for name in baselines}  # False: all pairs, True: pairs=0.02
    checks, failed = {name: 0.0 for name in baselines}, {}
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for name in levers[len(baselines):]:
        other_sampler = "device_sampler" in LEVERS[name][0]
        try:
            loss, grads = run(name, 1.0) if other_sampler else run(name)
        except Exception as e:  # noqa: BLE001  (reported below, with the others' timings)
            failed[name] = f"raised {type(e).__name__}: {str(e)[:300]}"
            continue
        want = ref[False] if other_sampler else ref[LEVERS[name][1]]
        err = max([_rel(loss, want[0])] + [_rel(x, y) for x, y in zip(grads, want[1])])
        checks[name] = err
        if not err < bound:
            failed[name] = f"differs from the defaults by {err:.3g} (bound {bound})"
        del grads
    for name, why in failed.items():
        print(f"levers: {name} {why}: not timed", file=sys.stderr)
    levers = [name for name in levers if name not in failed]

    times = {name: [] for name in levers}
    peaks = {}
    device = bench_pairs.device_name(args.device)
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / device.lower()
    out.mkdir(parents=True, exist_ok=True)
    shape = dict(B=B, T=T, m=m, hidden=args.hidden, layers=args.layers, V=V,
                 pairs=int(pair_counts(torch.full((B,), T), torch.zeros(B, dtype=torch.long), 2, T, T).sum()))

    def report(done: int, final: bool = False):
        """levers.json and levers.md with the checks and the first `done` rounds of reps: written
        after the checks and after every round, so a run cut short by its time box (gpu.sh) leaves
        what it measured, marked incomplete."""
        base = statistics.median(times["default"]) if done else None
        sub_base = statistics.median(times["pairs=0.02"]) if done and "pairs=0.02" in times else None
        rows = []
        for name in levers:
            ms = statistics.median(times[name]) * 1e3 if done else None
            ref_ms = sub_base if LEVERS[name][1] else base
            rows.append(dict(name=name, ms=ms, speedup_vs_default=None if ms is None else ref_ms * 1e3 / ms,
                             fraction_of_all_pairs=None if ms is None else ms / (base * 1e3),
                             peak_mem_mb=peaks.get(name), max_rel_err_vs_default=checks[name],
                             times_ms=[t * 1e3 for t in times[name]]))
        result = dict(device=device, torch=torch.__version__, dtype=args.dtype, backend=args.backend, shape=shape,
                      reps=done, reps_asked=args.reps, complete=done == args.reps, failed=failed, rows=rows)
        part = out / "levers.json.part"
        part.write_text(json.dumps(result, indent=1) + "\n")
        part.replace(out / "levers.json")
        state = "" if done == args.reps else f" **Incomplete: {done} of {args.reps} reps** (the run was cut short)."
        lines = [f"# Pair-loss levers on {device}", "",
                 f"torch {torch.__version__}, {args.dtype}, backend {args.backend}, B={B} T={T} m={m} h={args.hidden} "
                 f"layers={args.layers} V={V}, median of {done} interleaved reps after a warm-up. "
                 "Subsampled rows compare with `pairs=0.02`, the rest with `default`." + state, "",
                 "| setting | ms | speedup vs default | of all-pairs time | peak MB | max rel. err vs default |",
                 "| --- | --- | --- | --- | --- | --- |"]
        fmt = lambda v, spec, unit="": "-" if v is None else f"{v:{spec}}{unit}"
        for r in rows:
            lines.append(f"| {r['name']} | {fmt(r['ms'], '.2f')} | {fmt(r['speedup_vs_default'], '.3f', 'x')} "
                         f"| {fmt(r['fraction_of_all_pairs'], '.3f')} | {fmt(r['peak_mem_mb'], '.1f')} "
                         f"| {r['max_rel_err_vs_default']:.2e} |")
        for name, why in failed.items():
            lines += ["", f"**Not timed: {name}** {why}."]
        part = out / "levers.md.part"
        part.write_text("\n".join(lines) + "\n")
        part.replace(out / "levers.md")
        if final:
            print("\n".join(lines))
            print(f"wrote {out / 'levers.json'} and {out / 'levers.md'}")
        else:
            print(f"levers: {done} of {args.reps} reps written to {out / 'levers.json'}", flush=True)

    report(0)
    for name in levers:  # one warm-up each, with its peak memory
        with bench_pairs.PeakMemory(args.device) as mem:
            run(name)
            sync()
        peaks[name] = mem.growth / MB
    for rep in range(args.reps):
        for name in levers:
            t = time.perf_counter()
            run(name)
            sync()
            times[name].append(time.perf_counter() - t)
        report(rep + 1, final=rep + 1 == args.reps)
    if failed:
        raise SystemExit(f"levers: {len(failed)} setting(s) failed their check: {', '.join(failed)}")


if __name__ == "__main__":
    main()
