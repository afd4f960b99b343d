"""GPU correctness of the triton backend (TextHead) and of the torch backend with its Triton pair sums
(ResidualSwiGLUHead, TextHead; also its variants "torch+compile" and "torch+unfused")
against the float64 reference (docs/contract.md §6), and their bitwise reproducibility; prints one
line per case and exits nonzero on any failure.

    python bench/gpu_check.py                 # needs a CUDA GPU
    python bench/gpu_check.py cuda torch      # one device, only the named backends
    python bench/gpu_check.py --levers        # every case with every lever on, twice (docs/backends.md)

With the triton backend it also counts the device synchronisations of a subsampled loss whose
lengths are on the host (torch.cuda.set_sync_debug_mode): one, the op's token check after its
kernels (prepare's host_pairs: the pairs are drawn, checked and listed on the host).

A case that raises (e.g. a sampled-pairs case while the C++ extension, which samples, is not
built) is counted as a failure and the others still run.
"""
import argparse
import contextlib
import copy
import math
import sys
import traceback
import warnings
from pathlib import Path

import torch

# bench/ holds profile.py, which would shadow the standard library's profile module (torch._dynamo
# imports cProfile): take bench/ off the path, put the project root on it.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bst_fast import ResidualSwiGLUHead, TextHead, belief_state_loss  # noqa: E402
from bst_fast.backends import runtime, torch_backend  # noqa: E402


def rel(x, y):
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-300)).item()


def run(f, b, tokens, head, dtype, scale, backend, **opts):
    """dtype: the model's, or "autocast": a float32 model under CUDA bf16 autocast (the trainer's)."""
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "autocast" else contextlib.nullcontext()
    dtype = torch.float32 if dtype == "autocast" else dtype
    h = copy.deepcopy(head).to(dtype)
    f = f.detach().to(dtype).requires_grad_()
    b = b.detach().to(dtype).requires_grad_()
    with cast:
        loss = belief_state_loss(f, b, tokens, h, backend=backend, **opts)
    return loss.detach(), torch.autograd.grad(loss * scale, [f, b, *h.parameters()])


# every lever of docs/backends.md: fused_ce takes the last layer where ce_bias_sums would have, so
# --levers runs the cases twice, without fused_ce (ce_bias_sums acts) and with all nine
ALL_LEVERS = dict(bias_in_gemm=True, ce_bias_sums=True, vocab_pad=128, structured_sums=True, device_sampler=True,
                  fused_ce=True, relu_in_gemm=True, hidden_sums=True, split_16bit=True)
LEVER_RUNS = [dict(ALL_LEVERS, fused_ce=False), ALL_LEVERS]


def main(argv=None):
    names = _backend_names()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("device", nargs="?", default="cuda", choices=["cuda", "cpu"])
    # checked below, not by choices=: Python 3.11's argparse refuses an empty list against choices
    ap.add_argument("backends", nargs="*", default=[], help=f"only these (default: all of {names})")
    ap.add_argument("--levers", action="store_true",
                    help="run every case with every lever on: " + ", ".join(f"{k}={v}" for k, v in ALL_LEVERS.items())
                         + " (and once more without fused_ce, under which ce_bias_sums has nothing to do)")
    args = ap.parse_args(argv)
    bad = [n for n in args.backends if n not in names]
    if bad:
        ap.error(f"argument backends: invalid choice: {bad[0]!r} (choose from {', '.join(map(repr, names))})")
    if not args.levers:
        return _check_all(args)
    failed = 0
    for levers in LEVER_RUNS:
        with runtime.switched(**levers):
            print(f"levers on: {runtime.SWITCHES}", flush=True)
            failed |= _check_all(args)
    return failed


# The head shapes every backend is checked on (_check_all adds the torch backend's variants, host
# pair lists and float16 cases built from them)
BASE_CASES = [
    dict(B=3, L=37, m=24, V=101, hidden=40, n_layers=2, act="gelu", opts={}),
    dict(B=2, L=53, m=32, V=3001, hidden=200, n_layers=3, act="silu",
         opts=dict(lengths=[53, 41], prefix_start=[0, 3], max_gap=17, next_weight=0.3)),
    dict(B=4, L=29, m=16, V=64, hidden=[48, 24, 40], n_layers=4, act="gelu_tanh", opts=dict(reduction="sum")),
    dict(B=2, L=40, m=16, V=77, hidden=96, n_layers=2, act="relu", opts=dict(explicit=True)),
    dict(B=2, L=40, m=16, V=77, hidden=96, n_layers=2, act="leaky_relu", opts=dict(pairs=0.3)),
    # relu with a hidden layer after the split one: where relu_in_gemm (cuBLASLt's epilogue) and
    # hidden_sums' relu branch act; no other case reaches them
    dict(B=2, L=40, m=16, V=77, hidden=[96, 40], n_layers=3, act="relu", opts=dict(reduction="row_mean")),
]


def _backend_names():
    return ["triton", *torch_backend.VARIANTS]


def _check_all(args):
    dev, only = args.device, set(args.backends) or set(_backend_names())
    failures = ran = 0
    cases = list(BASE_CASES)
    # the torch backend (its Triton pair sums on a GPU) with the official head, and with a TextHead
    cases += [dict(c, backend="torch", swiglu=True, bias=k == 1) for k, c in enumerate(cases)]
    cases += [dict(cases[1], backend="torch")]
    # the torch backend with the heads' per-pair tail under torch.compile, and with the SwiGLU
    # head's gate and up summed apart (torch_backend.VARIANTS)
    cases += [dict(cases[1], backend="torch+compile", swiglu=True, bias=False), dict(cases[0], backend="torch+compile")]
    cases += [dict(cases[2], backend="torch+unfused", swiglu=True, bias=True)]
    # listed pair sets on the host (lengths and pairs kept on the CPU: the op lists them there)
    cases += [dict(B=3, L=45, m=16, V=300, hidden=64, n_layers=3, act="gelu",
                   opts=dict(pairs=0.4, lengths=[45, 30, 12], prefix_start=[0, 2, 1], host=True)),
              dict(cases[3], opts=dict(explicit=True, lengths=[40, 40], host=True))]
    # float16 under a loss scale of 2**8 (2**16 overflows the materialised run's gradients of the
    # short row), row_mean over rows of unequal length: a pair of the long rows weighs 1/32385 of
    # the short row's (_pairs.Chunk.half_scale)
    uneven = dict(B=3, L=256, m=64, V=1000, hidden=128, n_layers=2, act="gelu", dtypes=(torch.float16,),
                  scale=2.0**8, opts=dict(reduction="row_mean", lengths=[256, 3, 200]))
    cases += [uneven, dict(uneven, backend="torch"), dict(uneven, backend="torch", swiglu=True, bias=True)]
    for chunk in (None, 97):
        for k, c in enumerate(cases):
            g = torch.Generator().manual_seed(k)
            backend = c.get("backend", "triton")
            if backend not in only:
                continue
            if c.get("swiglu"):
                head = ResidualSwiGLUHead(c["m"], c["V"], hidden=c["hidden"] if isinstance(c["hidden"], int) else 64,
                                          bias=c["bias"])
            else:
                head = TextHead(c["m"], c["V"], hidden=c["hidden"], n_layers=c["n_layers"], activation=c["act"])
            with torch.no_grad():
                for name, q in head.named_parameters():  # norm weights near 1
                    q.copy_(torch.randn(q.shape, generator=g) * 0.5 + (name == "norm.weight"))
            head = head.to(dev)
            f = torch.randn(c["B"], c["L"], c["m"], generator=g).to(dev)
            b = torch.randn(c["B"], c["L"], c["m"], generator=g).to(dev)
            tokens = torch.randint(0, c["V"], (c["B"], c["L"]), generator=g).to(dev)
            opts = dict(c["opts"])
            on = "cpu" if opts.pop("host", False) else dev
            for key in ("lengths", "prefix_start"):
                if key in opts:
                    opts[key] = torch.tensor(opts[key], device=on)
            if opts.pop("explicit", False):
                row = torch.randint(0, c["B"], (300,), generator=g)
                i = torch.randint(0, c["L"] - 3, (300,), generator=g)
                j = i + 2 + (torch.rand(300, generator=g) * (c["L"] - 2 - i)).long()
                opts["pairs"] = (row.to(on), i.to(on), j.to(on))
            if isinstance(opts.get("pairs"), float):
                opts["generator"] = torch.Generator(device="cpu").manual_seed(5)
            scale = c.get("scale", 1.7)
            regen = lambda: {**opts, **({"generator": torch.Generator().manual_seed(5)} if "generator" in opts else {})}
            ran += 1
            try:
                with runtime.switched(chunk_pairs=chunk):  # both chunked backends' chunks
                    failures += check_case(f, b, tokens, head, scale, regen, backend, f"chunk={chunk} case {k}",
                                           c.get("dtypes"))
            except Exception:  # one broken case must not hide the others' results
                traceback.print_exc()
                print(f"{backend:13} {type(head).__name__:18} chunk={chunk} case {k} raised: FAIL", flush=True)
                failures += 1
    if dev == "cuda" and "triton" in only:
        ran += 1
        try:
            failures += check_synchronisations(dev)
        except Exception:
            traceback.print_exc()
            failures += 1
    if not ran:
        print("no case ran")
        return 1
    print(f"all {ran} cases ok" if not failures else f"{failures} FAILED of {ran} cases")
    return 1 if failures else 0


def check_synchronisations(dev):
    """A subsampled loss (forward and backward) with the lengths on the host synchronises once: the
    op's token check, read after its kernels are queued. With host_pairs off, for comparison, the
    pair list is cut on the device (more)."""
    g = torch.Generator().manual_seed(0)
    B, L, m, V = 8, 128, 64, 500
    head = TextHead(m, V, hidden=128, n_layers=2).to(dev, torch.bfloat16)
    f = torch.randn(B, L, m, generator=g).to(dev, torch.bfloat16).requires_grad_()
    b = torch.randn(B, L, m, generator=g).to(dev, torch.bfloat16).requires_grad_()
    tokens = torch.randint(0, V, (B, L), generator=g).to(dev)

    def count(host_pairs):
        lengths = torch.full((B,), L)  # on the host
        step = lambda: belief_state_loss(f, b, tokens, head, lengths=lengths, pairs=0.05, backend="triton",
                                         generator=torch.Generator().manual_seed(1)).backward()
        with runtime.switched(host_pairs=host_pairs):
            return _synchronisations(step)

    host, device = count(True), count(False)
    ok = host == 1
    print(f"synchronisations of a subsampled loss: {host} with its pair list made on the host (want 1, the op's "
          f"token check after its kernels), {device} made on the device: {'ok' if ok else 'FAIL'}", flush=True)
    return 0 if ok else 1


def _synchronisations(step):
    """The device synchronisations of one call of step(), after a warm-up call (compiled kernels)."""
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_case(f, b, tokens, head, scale, regen, backend, label, dtypes=None):
    """float32, bf16 and (on a GPU) autocast runs of one case (or those of `dtypes`) against the
    float64 reference: the number that failed. Autocast, a float32 model with bf16 matrix operands
    (docs/contract.md §6), takes the bf16 bound against the materialised objective under the same
    autocast; float16 takes it against the materialised float16 run."""
    failures = 0
    ref_l, ref_g = run(f, b, tokens, head, torch.float64, scale, "reference", **regen())
    for dtype in dtypes or (torch.float32, torch.bfloat16) + (("autocast",) if f.is_cuda else ()):
        name = "torch" if backend in torch_backend.VARIANTS else backend
        with torch_backend.variant(backend if backend in torch_backend.VARIANTS else "torch"):
            l1, g1 = run(f, b, tokens, head, dtype, scale, name, **regen())
            l2, g2 = run(f, b, tokens, head, dtype, scale, name, **regen())
        same = torch.equal(l1, l2) and all(torch.equal(x, y) for x, y in zip(g1, g2))
        el, eg = rel(l1, ref_l), max(rel(x, y) for x, y in zip(g1, ref_g))
        if dtype == torch.float32:
            ok = el < 1e-5 and eg < 1e-4
            bound = "1e-5/1e-4"
        else:
            ml, mg = run(f, b, tokens, head, dtype, scale, "reference", **regen())
            bl = 2 * rel(ml, ref_l) + 1e-3
            # docs/contract.md §6: the torch backend rounds a 16-bit parameter's gradient once
            # more when grad_output (scale) is not a power of two: a unit roundoff more for those
            # (not under autocast: the parameters are float32)
            bf16_params = name == "torch" and dtype in (torch.bfloat16, torch.float16) and scale != 2.0 ** round(math.log2(scale))
            unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
            extra = [unit if bf16_params and q >= 2 else 0.0 for q in range(len(g1))]  # f, b: none
            ok_g = all(rel(x, y) <= 2 * rel(z, y) + 1e-3 + e for x, y, z, e in zip(g1, ref_g, mg, extra))
            # a materialised run that overflows makes no bound: the case is not a test then
            ok = el <= bl and ok_g and all(math.isfinite(rel(z, y)) for z, y in zip(mg, ref_g))
            bound = (f"2x torch {str(dtype).replace('torch.', '')} ({max(rel(z, y) for z, y in zip(mg, ref_g)):.2e}) + 1e-3"
                     + (f" + 2**{round(math.log2(unit))} on the head's" if bf16_params else ""))
        ok = ok and same
        failures += not ok
        print(f"{backend:13} {type(head).__name__:18} {label} {str(dtype):15} loss err {el:.2e} grad err {eg:.2e} "
              f"(bound {bound}) bitwise-reproducible={same} {'ok' if ok else 'FAIL'}", flush=True)
    return failures


if __name__ == "__main__":
    sys.exit(main())
