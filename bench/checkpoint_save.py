"""Checkpoint save time: the verified checkpoint (sha256 of every file, hashed while written; a
finiteness check of every weight) against the save without them, as bst_fast wrote checkpoints
before, on one model and optimizer, interleaved in one run.

    python bench/checkpoint_save.py                      # configs/star_cpu.yaml's model
    python bench/checkpoint_save.py --config star_g25_gpu --reps 5

The bound (issue 20): the verified save takes at most 10% longer. Both write to the same disk with
the same fsyncs; the difference is the hashing and the checks.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# The repository instead of bench/ (whose profile.py would shadow the standard library's profile).
sys.path[0] = str(Path(__file__).resolve().parents[1])

from bst_fast.checkpoint import _unshared, save_checkpoint  # noqa: E402
from bst_fast.config import resolve_config  # noqa: E402
from bst_fast.files import atomic_write, fsync  # noqa: E402
from bst_fast.trainer import build_run, train_step  # noqa: E402


def save_unverified(out_dir, step, model, optimizer, scheduler, cfg):
    """The save before checksums: safetensors and torch.save to files, fsync, rename, `latest`."""
    from safetensors.torch import save_file

    root = Path(out_dir) / "checkpoints"
    final, tmp = root / f"step-{step:08d}", root / f".step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_unshared(model.state_dict()), str(tmp / "model.safetensors"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "log": None}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    for path in (*tmp.iterdir(), tmp):
        fsync(path)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(root / "latest", lambda p: p.write_text(final.name))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="star_cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = ap.parse_args(argv)
    cfg = resolve_config(args.config, progress=False)
    run = build_run(cfg, "cpu")
    train_step(run, 0)  # AdamW's moments exist: the state is full size
    n_bytes = sum(v.numel() * v.element_size() for v in run.model.state_dict().values())
    times = {"unverified": [], "verified": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.reps + 1):
            for name in (("unverified", "verified") if rep % 2 else ("verified", "unverified")):
                out = Path(tmp) / name
                t0 = time.perf_counter()
                if name == "verified":
                    save_checkpoint(out, rep + 1, run.model, run.optimizer, run.scheduler, run.cfg, keep=1)
                else:
                    save_unverified(out, rep + 1, run.model, run.optimizer, run.scheduler, run.cfg)
                if rep:  # the first of each is a warm-up
                    times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"model {n_bytes / 2**20:.1f} MiB of weights (x3 with AdamW's moments), {args.reps} saves each, interleaved")
    for k, v in med.items():
        print(f"  {k:>10}: median {v:.1f} ms (min {min(times[k]) * 1e3:.1f}, max {max(times[k]) * 1e3:.1f})")
    print(f"  verified / unverified: {med['verified'] / med['unverified']:.3f}")
    return med


if __name__ == "__main__":
    main()
