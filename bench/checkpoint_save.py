"""Checkpoint save time: the verified checkpoint (sha256 of every file, a finiteness check of every
weight) against the same save with only the verification removed, on one model and optimizer,
interleaved in one run.

    python bench/checkpoint_save.py                      # configs/star_cpu.yaml's model
    python bench/checkpoint_save.py --config star_g25_gpu --reps 5

The bound (issue 20): the verified save takes at most 10% longer. `unverified` is save_checkpoint
line by line without the verification (no checksums, no finiteness check, and none of what serves
them: no writeback started early, no hashing thread): the same files, writes, fsyncs, renames,
`latest` and pruning (keep=1: each save deletes the one before, as in a run). The two run back to
back, each first in every other round, and the ratio is the median of each round's ratio: that
cancels drift in the machine's load. On a shared machine the rounds are also split by how many cores
the other processes used during the round (from /proc/stat): the verification overlaps the disk's
writing and takes a second core when one is free, so the ratio depends on the machine's load.
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

from bst_fast.checkpoint import _unshared, prune, save_checkpoint  # noqa: E402
from bst_fast.config import resolve_config  # noqa: E402
from bst_fast.files import atomic_write, fsync, temporary_name  # noqa: E402
from bst_fast.trainer import build_run, train_step  # noqa: E402


def save_unverified(out_dir, step, model, optimizer, scheduler, cfg, keep):
    """save_checkpoint without its verification, as bst_fast saved before checksums."""
    from safetensors.torch import save_file

    weights = _unshared(model.state_dict())
    root = Path(out_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = temporary_name(final)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(weights, str(tmp / "model.safetensors"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "log": None}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    for path in (*tmp.iterdir(), tmp):
        fsync(path)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(root / "latest", lambda p: p.write_text(final.name))
    fsync(root)
    prune(root, final, keep)


def others_busy():
    """(wall seconds, CPU seconds of the whole machine, of this process): over a round, the difference
    of the last two is the CPU the other processes used (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return None
    t = os.times()
    return time.perf_counter(), (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), t.user + t.system


def stats(xs):
    q = statistics.quantiles(xs, n=4)
    return {"median": statistics.median(xs), "min": min(xs), "iqr": q[2] - q[0], "n": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="star_cpu")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--dir", help="where to write (default: a temporary folder)")
    ap.add_argument("--json", help="write the times and the ratios here")
    args = ap.parse_args(argv)
    cfg = resolve_config(args.config, progress=False)
    run = build_run(cfg, "cpu")
    train_step(run, 0)  # AdamW's moments exist: the state is full size
    n_bytes = sum(v.numel() * v.element_size() for v in run.model.state_dict().values())
    times = {"unverified": [], "verified": []}
    others = []  # cores the other processes used in each round
    load = [os.getloadavg()]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for rep in range(args.reps + 1):
            before = others_busy()
            for name in (("unverified", "verified") if rep % 2 else ("verified", "unverified")):
                save = save_checkpoint if name == "verified" else save_unverified
                t0 = time.perf_counter()
                save(Path(tmp) / name, rep + 1, run.model, run.optimizer, run.scheduler, run.cfg, keep=1)
                if rep:  # the first round is a warm-up
                    times[name].append((time.perf_counter() - t0) * 1e3)
            after = others_busy()
            if rep and before:
                others.append(((after[1] - before[1]) - (after[2] - before[2])) / (after[0] - before[0]))
    load.append(os.getloadavg())
    ratios = [v / u for v, u in zip(times["verified"], times["unverified"])]
    result = {k: stats(v) for k, v in times.items()}
    result["ratio"] = stats(ratios)
    if others:  # /proc/stat counts in clock ticks (10 ms): a round's figure is rough, good to split by
        for label, keep in (("ratio, others < 0.5 core", lambda c: c < 0.5),
                            ("ratio, others >= 0.5 core", lambda c: c >= 0.5)):
            picked = [r for r, c in zip(ratios, others) if keep(c)]
            if len(picked) >= 2:
                result[label] = stats(picked)
    print(f"model {n_bytes / 2**20:.1f} MiB of weights (x3 with AdamW's moments), {args.reps} saves each, "
          f"interleaved; load average (1 min) {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end; "
          f"{os.cpu_count()} cores" + (f", the other processes used {statistics.median(others):.2f} of them "
                                       f"(median over rounds)" if others else ""))
    for k, v in result.items():
        unit = "" if k.startswith("ratio") else " ms"
        print(f"  {k:>25}: median {v['median']:.3f}{unit} (min {v['min']:.3f}, IQR {v['iqr']:.3f}, n {v['n']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": args.config, "cores": os.cpu_count(), "load_average": load,
                                               **result, "times_ms": times, "others_cores": others}, indent=1))
    return result


if __name__ == "__main__":
    main()
