"""Packed rows against unpacked rows at the same token count: the loss alone, forward + backward.

    python bench/packed.py                                   # CPU: B=24 documents, T=128, m=h=128
    python bench/packed.py --device cuda --dtype bfloat16 --docs 256 --T 256 --d-model 512 --hidden 512

The same documents (lengths drawn uniformly from [--min-len, T], fixed seed) are trained twice:
one document a row, padded to T (`lengths`), and packed greedily in order into rows of T
(`documents`, docs/contract.md §10). Both hold the same real tokens and the same pairs (the sum of
the documents' triangles), so the loss is the same number: the bench checks that (reduction
"sum", f and b copied position by position) before it times anything. It reports the median time
of --reps runs after a warm-up, pairs/s, the padding of each layout and the peak memory growth,
and writes JSON and markdown to bench/results/<device>/packed.{json,md} (or --out).

Then the encoders on the packed rows: both encoders of a BeliefStateTransformer (--enc-layers
blocks), forward + backward, with the block-diagonal attention as SDPA with a dense mask
(model.attention "sdpa") and as flex_attention with a block mask ("flex", compiled once, untimed).
On the CPU flex has no backward: both are timed forward only there.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bst_fast import (BeliefStateTransformer, ModelConfig, ResidualSwiGLUHead, TextHead,  # noqa: E402
                      belief_state_loss)
from bst_fast._pairs import pair_counts  # noqa: E402

# bench/pairs.py's timer, memory probe and device name, loaded by path (bench/ stays off sys.path:
# its profile.py would shadow the standard library's module)
_spec = importlib.util.spec_from_file_location("bench_pairs", ROOT / "bench" / "pairs.py")
bench_pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pairs)


def document_lengths(n, T, min_len, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min_len, T + 1, (n,), generator=g).tolist()


def pack(sizes, T):
    """Greedy in order: each document goes into the current row if it fits, else starts a new one.
    Returns, per row, the list of document indices."""
    rows, used = [[]], 0
    for d, n in enumerate(sizes):
        if used + n > T:
            rows.append([])
            used = 0
        rows[-1].append(d)
        used += n
    return rows


def layouts(sizes, T, m, V, dtype, device, seed):
    """(unpacked, packed): each a dict of f, b, tokens, lengths and (packed) documents, holding the
    same values at each document's positions."""
    g = torch.Generator().manual_seed(seed + 1)
    n = len(sizes)
    f = torch.randn(n, T, m, generator=g).to(dtype)
    b = torch.randn(n, T, m, generator=g).to(dtype)
    tokens = torch.randint(0, V, (n, T), generator=g)
    unpacked = dict(f=f, b=b, tokens=tokens, lengths=torch.tensor(sizes))
    rows = pack(sizes, T)
    pf, pb = torch.zeros(len(rows), T, m, dtype=dtype), torch.zeros(len(rows), T, m, dtype=dtype)
    pt = torch.zeros(len(rows), T, dtype=torch.long)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    lengths = []
    for r, docs in enumerate(rows):
        s = 0
        for d in docs:
            k = sizes[d]
            pf[r, s:s + k], pb[r, s:s + k], pt[r, s:s + k] = f[d, :k], b[d, :k], tokens[d, :k]
            ids[r, s:s + k] = d
            s += k
        ids[r, s:] = rows[r][-1]  # padding: the last document's id keeps the row non-decreasing
        lengths.append(s)
    packed = dict(f=pf, b=pb, tokens=pt, lengths=torch.tensor(lengths), documents=ids)
    move = lambda x: x.to(device)  # noqa: E731
    return ({k: move(v) for k, v in unpacked.items()}, {k: move(v) for k, v in packed.items()})


def once(fn, device) -> float:
    """Seconds of one fn() call, the GPU's work included."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def encoder_times(x, args, dtype):
    """{attention: median seconds} of both encoders over the packed rows `x`, forward + backward on
    a GPU (forward only on the CPU, where flex_attention has no backward), same weights."""
    T = x["tokens"].shape[1]
    cfg = ModelConfig(vocab_size=args.vocab, max_len=T, n_layer=args.enc_layers, d_model=args.d_model,
                      n_head=args.enc_heads)
    torch.manual_seed(args.seed)
    base = BeliefStateTransformer(cfg).to(args.device)
    train = args.device != "cpu"
    out = {}
    for attention in ("sdpa", "flex"):
        model = BeliefStateTransformer(ModelConfig(**{**cfg.__dict__, "attention": attention})).to(args.device)
        model.load_state_dict(base.state_dict())

        def step():
            with torch.autocast(args.device, dtype=dtype, enabled=dtype != torch.float32), \
                    torch.set_grad_enabled(train):
                f = model.prefix_states(x["tokens"], x["documents"])
                b = model.suffix_states(x["tokens"], x["lengths"], x["documents"])
            if train:
                model.zero_grad(set_to_none=True)
                (f.float().square().mean() + b.float().square().mean()).backward()
        step()  # flex compiles here, untimed
        out[attention] = bench_pairs.timed(step, args.device, args.reps)[0]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--docs", type=int, default=24, help="documents (= unpacked rows)")
    ap.add_argument("--T", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--head", default="mlp", choices=["mlp", "swiglu"])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--min-gap", type=int, default=1, help="1 trains meet pairs (meet token 0)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--enc-layers", type=int, default=2, help="blocks per encoder in the encoder timing (0: skip it)")
    ap.add_argument("--enc-heads", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder for packed.json and packed.md")
    args = ap.parse_args(argv)
    if args.min_len < 2 or args.min_len > args.T:
        ap.error(f"--min-len must lie in [2, T={args.T}], got {args.min_len}")

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    head = (TextHead(args.d_model, args.vocab, hidden=args.hidden) if args.head == "mlp"
            else ResidualSwiGLUHead(args.d_model, args.vocab)).to(args.device, dtype)
    sizes = document_lengths(args.docs, args.T, args.min_len, args.seed)
    unpacked, packed = layouts(sizes, args.T, args.d_model, args.vocab, dtype, args.device, args.seed)
    opts = dict(min_gap=args.min_gap, meet_token=0 if args.min_gap == 1 else None, backend=args.backend)

    def loss(x, reduction="mean"):
        return belief_state_loss(x["f"], x["b"], x["tokens"], head, lengths=x["lengths"],
                                 documents=x.get("documents"), reduction=reduction, **opts)

    # the same pairs, so the same sum: checked in float64 accumulation terms of the run's dtype
    with torch.no_grad():
        a, c = loss(unpacked, "sum").double(), loss(packed, "sum").double()
    agree = abs(a - c).item() / abs(a).item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not agree < tol:
        raise SystemExit(f"packed and unpacked losses differ: {c.item()} vs {a.item()} (rel {agree:.2e})")

    # The two layouts' steps alternate, rep by rep (a busy machine's drift hits both alike); the peak
    # memory is each one's first, untimed run.
    layouts_ = (("unpacked", unpacked), ("packed", packed))
    steps, times, mems = {}, {name: [] for name, _ in layouts_}, {}
    for name, x in layouts_:
        f, b = x["f"].clone().requires_grad_(), x["b"].clone().requires_grad_()

        def step(y=dict(x, f=f, b=b)):
            head.zero_grad(set_to_none=True)
            y["f"].grad = y["b"].grad = None
            loss(y).backward()
        steps[name] = step
        with bench_pairs.PeakMemory(args.device) as mem:
            once(step, args.device)
        mems[name] = mem.growth
    for _ in range(args.reps):
        for name, _ in layouts_:
            times[name].append(once(steps[name], args.device))
    results = []
    for name, x in layouts_:
        sec = statistics.median(times[name])
        B, T = x["tokens"].shape
        n_pairs = int(pair_counts(x["lengths"], torch.zeros_like(x["lengths"]), args.min_gap, T, T,
                                  documents=x.get("documents")).sum())
        real = int(x["lengths"].sum())
        results.append(dict(layout=name, rows=B, T=T, real_tokens=real, padding=1 - real / (B * T),
                            pairs=n_pairs, seconds=sec, pairs_per_s=n_pairs / sec, peak_mem_mb=mems[name] / 2**20))
    enc = encoder_times(packed, args, dtype) if args.enc_layers else {}
    device = bench_pairs.device_name(args.device)
    report = dict(device=device, dtype=args.dtype, head=args.head, backend=args.backend, d_model=args.d_model,
                  hidden=args.hidden, vocab=args.vocab, documents=args.docs, min_len=args.min_len,
                  min_gap=args.min_gap, reps=args.reps, loss_rel_diff=agree, results=results,
                  packed_over_unpacked=results[1]["seconds"] / results[0]["seconds"],
                  encoders=dict(layers=args.enc_layers, heads=args.enc_heads,
                                timed="forward" if args.device == "cpu" else "forward+backward",
                                seconds=enc) if enc else None)
    lines = [f"# Packed against unpacked rows: the loss alone, forward + backward ({device}, {args.dtype})", "",
             f"{args.docs} documents of {args.min_len}..{args.T} tokens, head {args.head} (m={args.d_model}, "
             f"h={args.hidden}, V={args.vocab}), backend {args.backend}, min_gap {args.min_gap}, median of "
             f"{args.reps}. Same pairs in both layouts; their summed losses agree to {agree:.1e}.", "",
             "| layout | rows x T | padding | pairs | ms | Mpairs/s | peak MB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['layout']} | {r['rows']} x {r['T']} | {r['padding']:.0%} | {r['pairs']} | "
                     f"{r['seconds'] * 1e3:.1f} | {r['pairs_per_s'] / 1e6:.2f} | {r['peak_mem_mb']:.0f} |")
    lines += ["", f"packed / unpacked time: {report['packed_over_unpacked']:.2f}"]
    if enc:
        e = report["encoders"]
        lines += ["", f"Both encoders on the packed rows ({args.enc_layers} blocks, {args.enc_heads} heads, "
                      f"{e['timed']}): SDPA with a dense mask {enc['sdpa'] * 1e3:.1f} ms, flex_attention with a "
                      f"block mask {enc['flex'] * 1e3:.1f} ms (flex / sdpa {enc['flex'] / enc['sdpa']:.2f})."]
    print("\n".join(lines))
    out = args.out or ROOT / "bench" / "results" / device
    out.mkdir(parents=True, exist_ok=True)
    (out / "packed.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "packed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
