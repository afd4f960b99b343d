"""The benchmark scripts run first time: their one GPU run is short and costly, so what can be
checked on the CPU is checked here (in subprocesses: bench/ stays off this process's path)."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "bench" / "gpu.sh"


def test_gpu_sh_knows_its_steps_and_refuses_others():
    text = GPU_SH.read_text()
    defined = re.findall(r"^\s*step \d+ (\S+)", text, flags=re.M)
    listed = re.search(r'^ALL_STEPS="([^"]+)"', text, flags=re.M).group(1).split()
    assert sorted(defined) == sorted(listed) and len(set(defined)) == len(defined)
    recipe = re.search(r'STEPS="([^"]+)" timeout', text).group(1).split()
    assert set(recipe) <= set(listed)
    run = subprocess.run(["bash", str(GPU_SH)], env={"STEPS": "heads hedas", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown step 'hedas'" in run.stderr


def test_pairs_bench_runs_every_cpu_backend_for_both_heads(tmp_path):
    out = tmp_path / "new" / "folder" / "r.json"  # a folder that does not exist yet
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "pairs.py"), "--T", "6", "--batch", "2",
                          "--d-model", "8", "--hidden", "8", "--vocab", "11", "--reps", "2", "--no-compile",
                          "--head", "mlp", "swiglu", "--backends", "all", "--subsample-T", "6", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [r for r in json.loads(out.read_text())["rows"] if "seconds" in r]
    timed = {(r["head"], r["method"]) for r in rows}
    for head in ("mlp", "swiglu"):
        assert {(head, "torch"), (head, "materialised"), (head, "torch pairs=0.02")} <= timed, timed
    assert ("mlp", "cpp") in timed and ("swiglu", "cpp") not in timed  # cpp takes only TextHead
    assert all(r["reps"] == 2 and r["seconds"] > 0 and r["peak_mem_mb"] >= 0 for r in rows)
    # GFLOP/s counts the per-pair GEMMs: for swiglu its Down projection and lm_head
    sw = next(r for r in rows if r["head"] == "swiglu" and r["method"] == "torch")
    hidden = 128  # ResidualSwiGLUHead's width for m = 8 (its minimum)
    assert sw["gflops"] == pytest.approx(6 * sw["pairs"] * (hidden * 2 * 8 + 8 * 2 * 11) / sw["seconds"] / 1e9)


def test_gpu_check_refuses_an_unknown_backend():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "cpu", "tirton"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'tirton'" in run.stderr


def test_segment_sums_bench_agrees_across_launch_shapes(tmp_path):
    """bench/segment_sums.py times the segment kernels under several launch shapes and checks each
    against the first: every shape must give the same sums (up to float32 reassociation)."""
    out = tmp_path / "seg.json"
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "segment_sums.py"), "--batch", "2", "--T", "9",
                          "--d-model", "8", "--vocab", "5", "--reps", "1", "--parts", "swiglu", "text-sum",
                          "--configs", "2x8x1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["part"] for r in rows} == {"swiglu", "text-sum"}
    # swiglu: the old shape, the default, the one asked for; text-sum (8 wide): the old shape's
    # block clipped to the rows is the default's, timed once
    for part, n in (("swiglu", 3), ("text-sum", 2)):
        mine = [r for r in rows if r["part"] == part]
        assert len(mine) == n and (mine[-1]["BS"], mine[-1]["BK"], mine[-1]["warps"]) == (2, 8, 1)
        assert all(r["prefix_ms"] > 0 and r["suffix_ms"] > 0 and r["rel_err_vs_first"] < 1e-5 for r in mine), mine


def test_segment_configs_refuses_an_unknown_name_and_passes_the_rest_to_pairs_py():
    script = str(ROOT / "bench" / "segment_configs.py")
    run = subprocess.run([sys.executable, script, "olde"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "usage: segment_configs.py {default,old,sweep}" in run.stderr
    run = subprocess.run([sys.executable, script, "old", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--subsample-T" in run.stdout  # pairs.py's own help
