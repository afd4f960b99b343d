"""torch.profiler trace of BST training steps as users train them: `bst_fast.trainer.train_step`
(forward and loss under the trainer's autocast, backward, clipping, AdamW) on a
BeliefStateTransformer with two encoders, all pairs, and a TextHead (or with --head swiglu the
official ResidualSwiGLUHead), through bench/paper_speed.py's machinery (its Run, synthetic rows
and phase marks).

Writes <out>/<device name>-profile[-swiglu].trace.json (chrome trace, open in chrome://tracing or
Perfetto) and <out>/<device name>-profile[-swiglu].txt (the phase table and the top-op table). The
phases are the record_function ranges of train_step ("forward", "backward", "optimizer") and of
BeliefStateTransformer.forward ("encoders", "pair_loss"), timed with CUDA events on a GPU (median
over --steps steps, outside the profiler); --nvtx emits them (and every op) as NVTX ranges during
those steps, for an nsys capture.

    python bench/profile.py --device cuda            # two 8 x 768 encoders, T=256, B=32, a 3 x 512 head (bf16 autocast)
    python bench/profile.py --device cpu --T 16      # smoke test
    python bench/profile.py --head swiglu --batch 32 --d-model 512   # the torch backend's SwiGLU path
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# This file is named profile.py: drop its own folder from the path so that `import profile`
# (cProfile, pulled in by torch) finds the standard library, and put the repository root there.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import importlib.util  # noqa: E402

import torch  # noqa: E402

from bst_fast.config import apply_overrides, apply_sets  # noqa: E402
from bst_fast.trainer import train_step  # noqa: E402


def paper_speed():
    """bench/paper_speed.py, loaded by its path (bench/ is off sys.path)."""
    key = "_bench_paper_speed"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, _HERE / "paper_speed.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None,
                    help="kept for old command lines: the trainer's precision (bfloat16 autocast on cuda, float32 "
                         "on cpu) is what runs; another value is refused")
    ap.add_argument("--batch", type=int, default=None, help="32 on cuda, 2 on cpu")
    ap.add_argument("--T", type=int, default=None, help="sequence length without BOS/EOS: 256 on cuda, 16 on cpu")
    ap.add_argument("--d-model", type=int, default=None, help="768 on cuda, 32 on cpu")
    ap.add_argument("--enc-layers", type=int, default=None, help="8 on cuda, 1 on cpu")
    ap.add_argument("--hidden", type=int, default=None, help="head width: 512 on cuda, 32 on cpu")
    ap.add_argument("--head-layers", type=int, default=3)
    ap.add_argument("--head", choices=["mlp", "swiglu"], default="mlp",
                    help="mlp: TextHead (--hidden, --head-layers, gelu); swiglu: ResidualSwiGLUHead (default width)")
    ap.add_argument("--vocab", type=int, default=None, help="1000 on cuda, 50 on cpu")
    ap.add_argument("--backend", default=None, help="belief_state_loss backend (default: auto on cuda, torch on cpu)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps, then as many timed, after 2 warm-up steps")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="any other config field, as `bst_fast train --set` takes it")
    ap.add_argument("--nvtx", action="store_true", help="NVTX ranges during the timed steps (cuda; for nsys)")
    ap.add_argument("--out", default=str(_HERE / "results"))
    a = ap.parse_args(argv)
    gpu = a.device == "cuda"
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda, but this torch sees no CUDA device")
    precision = "bfloat16" if gpu else "float32"
    if a.dtype is not None and a.dtype.replace("torch.", "") != precision:
        ap.error(f"--dtype {a.dtype}: the trainer runs {'bf16 autocast' if gpu else 'float32'} on {a.device}")
    if a.nvtx and not gpu:
        ap.error("--nvtx needs --device cuda")
    if a.steps < 1:
        ap.error("--steps must be >= 1")
    pick = lambda v, big, small: v if v is not None else (big if gpu else small)
    B, T, m = pick(a.batch, 32, 2), pick(a.T, 256, 16), pick(a.d_model, 768, 32)
    n_enc, h, V = pick(a.enc_layers, 8, 1), pick(a.hidden, 512, 32), pick(a.vocab, 1000, 50)
    backend = pick(a.backend, "auto", "torch")
    name = torch.cuda.get_device_name().replace(" ", "-") if gpu else "cpu"

    ps = paper_speed()
    shape = dict(vocab=V, T=T, batch=B, n_layer=n_enc, d_model=m, n_head=max(1, m // 64), head_hidden=h,
                 head_layers=a.head_layers)
    warmup = 2
    base = ps.base_config(shape, a.device, warmup + 2 * a.steps + 1)
    try:
        cfg = apply_sets(apply_overrides(base, {"method": "bst", "model.head_type": a.head, "backend": backend,
                                                "model.head_activation": "gelu"}), a.sets).check()
    except ValueError as e:
        ap.error(str(e))
    task = ps.SyntheticText(V, T)
    run = ps.build_column_run(cfg, task, a.device)
    for step in range(warmup):  # Triton compilation, cuBLAS heuristics, the allocator, AdamW's state
        train_step(run, step)
    ps.synchronize(a.device)

    os.makedirs(a.out, exist_ok=True)
    base_path = Path(a.out) / (f"{name}-profile" + ("-swiglu" if a.head == "swiglu" else ""))
    # the trace (large: kept out of git and of gpu.sh's ARCHIVE), then the phases outside the profiler
    table = ps.profile_steps(run, warmup, a.steps, base_path, record_shapes=True)
    with torch.autograd.profiler.emit_nvtx(enabled=a.nvtx):
        clock = ps.timed_steps(run, warmup + a.steps, a.steps)
    loss = float(train_step(run, warmup + 2 * a.steps))
    phases = ps.phase_table(clock.ranges())
    rows = [(k, phases[k]) for k in ("encoders", "pair_loss", "forward_rest", "backward", "optimizer", "other")]
    phase_table = "| phase | ms |\n| --- | --- |\n"
    phase_table += "".join(f"| {k} | {v:.1f} |\n" for k, v in rows if v is not None)
    phase_table += f"| step | {phases['step']:.1f} ({1e3 / phases['step']:.2f} it/s) |\n"
    mc = run.cfg.model
    if mc.head_type == "swiglu":
        head = f"swiglu {run.model.head.hidden}"
    else:
        head = f"{mc.head_layers}x{mc.head_hidden} {mc.head_activation}"
    extra = (" shared_encoders" if mc.shared_encoders else "") + (f" pairs={run.cfg.pairs}" if run.cfg.pairs else "")
    head_line = (f"# {name}: bst_fast.trainer.train_step, B={B} T={T} m={mc.d_model} enc_layers={mc.n_layer} "
                 f"head={head} V={mc.vocab_size} {'bf16 autocast' if gpu else 'float32'} "
                 f"backend={run.cfg.backend}{extra}, {a.steps} steps profiled, median of {a.steps} timed, "
                 f"loss {loss:.4f}\n")
    with open(str(base_path) + ".txt", "w") as fh:
        fh.write(head_line + phase_table + "\n" + table + "\n")
    print(head_line + table)
    print(phase_table)
    print(f"wrote {base_path}.trace.json and {base_path}.txt")


if __name__ == "__main__":
    main()
