"""The benchmark scripts run first time: their one GPU run is short and costly, so what can be
checked on the CPU is checked here (in subprocesses: bench/ stays off this process's path)."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bst_fast.backends import runtime

ROOT = Path(__file__).resolve().parents[1]
GPU_SH = ROOT / "bench" / "gpu.sh"


def test_gpu_sh_knows_its_steps_and_refuses_others():
    text = GPU_SH.read_text()
    defined = re.findall(r"^\s*step \d+ (\S+)", text, flags=re.M)
    listed = re.search(r'^ALL_STEPS="([^"]+)"', text, flags=re.M).group(1).split()
    assert sorted(defined) == sorted(listed) and len(set(defined)) == len(defined)
    recipe = re.search(r'STEPS="([^"]+)" timeout', text).group(1).split()
    assert set(recipe) <= set(listed)
    # the paper's Table 3 first (issue 23), in the recipe too, with its levers beside it in one process
    assert defined[0] == recipe[0] == listed[0] == "paper"
    assert "--variant" in re.search(r"^step \d+ paper (.+?)\n(?!\s)", text, flags=re.M | re.S).group(1)
    run = subprocess.run(["bash", str(GPU_SH)], env={"STEPS": "heads hedas", "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown step 'hedas'" in run.stderr


def test_gpu_sh_archive_says_how_each_step_ended(tmp_path):
    """A dry run with a stand-in python3: the archive holds <card>-steps.tsv (each step's exit status,
    seconds and timeout, a skipped one named) and each log's last line, a failing step does not stop
    the next, and the exit status is 1. Before, "failed or timed out" and the skipped steps were on
    stdout only: an archive could not tell a finished step from a cut one."""
    import tarfile

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/bash\n"
                    "case \"$1\" in -c) echo NVIDIA-H200; exit 0;; setup.py) exit 0;; esac\n"
                    "[[ \"$1\" == *logits_ce.py ]] && { echo broken; exit 3; }\n"
                    "[[ \"$1\" == *levers.py ]] && sleep 12\n"
                    "echo ran $1; exit 0\n")
    fake.chmod(0o755)
    archive = tmp_path / "out" / "results.tgz"
    archive.parent.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RESULTS_DIR": str(tmp_path / "r"), "ARCHIVE": str(archive),
           "STEPS": "paper lce check-fused levers-paper", "BUDGET": "40"}
    run = subprocess.run(["bash", str(GPU_SH)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    with tarfile.open(archive) as tar:
        steps = tar.extractfile("./NVIDIA-H200-steps.tsv").read().decode().splitlines()
        lce_log = tar.extractfile("./NVIDIA-H200-lce.txt").read().decode()
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in steps[1:]}
    assert list(rows) == ["build", "paper", "lce", "levers-paper", "check-fused", "total"]
    assert rows["paper"][0] == "0" and rows["lce"][0] == "3" and rows["levers-paper"][0] == "0"
    assert rows["check-fused"][0] == "skipped"  # under 30 s of the budget left after levers-paper's 12 s
    assert rows["total"][0] == "1"
    assert lce_log.splitlines()[-1].startswith("## lce: exit 3 after ")


def test_gpu_sh_times_its_build_alone_runs_named_quick_steps_and_keeps_profiles_apart(tmp_path):
    """Review helper-96: the build's row counted the CUDA probe's time; QUICK=1 with STEPS="tests"
    ran nothing and said nothing; the profile steps' report and gpu.sh's log of them were one file,
    written by both (spliced)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/bash\n"
                    "case \"$1\" in -c) sleep 3; echo NVIDIA-H200; exit 0;; setup.py) exit 0;; esac\n"
                    "echo ran \"$@\"; exit 0\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RESULTS_DIR": str(tmp_path / "r"), "STEPS": "tests", "QUICK": "1"}
    run = subprocess.run(["bash", str(GPU_SH)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {r.split("\t")[0]: r.split("\t")[1:] for r in (tmp_path / "r" / "NVIDIA-H200-steps.tsv").read_text().splitlines()}
    assert int(rows["build"][1]) < 3 <= int(rows["build"][3])  # seconds, then the time it started
    assert rows["tests"][0] == "0" and "-m cuda -q tests" in (tmp_path / "r" / "NVIDIA-H200-tests.txt").read_text()
    text = GPU_SH.read_text()
    for step in ("profile", "profile-swiglu"):
        command = re.search(rf"^step \d+ {step} (.+?)\n(?!\s)", text, flags=re.M | re.S).group(1)
        assert '--out "$out/profiles"' in command, command


def test_pairs_bench_memory_counts_what_the_warm_up_left(monkeypatch):
    """timed()'s growth counts the measured run's gradients although the warm-up's were alike: the
    reset frees them before the baseline (before stop 37 the growth left them out)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_pairs_mem", ROOT / "bench" / "pairs.py")
    pairs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, pairs)
    spec.loader.exec_module(pairs)
    held = {}

    def step():  # a loss's backward: frees the last gradient, makes a new one of 200 MB
        held["grad"] = None
        held["grad"] = torch.ones(50 * 2**20)

    _, kept = pairs.timed(step, "cpu", 1)
    _, counted = pairs.timed(step, "cpu", 1, reset=lambda: held.clear())
    assert counted > 150 * 2**20 > 50 * 2**20 > kept


def test_pairs_bench_counts_a_deeper_heads_hidden_gemms(monkeypatch):
    """GFLOP/s counted h x 2V a pair whatever the depth: a 3-layer head's rate read 1.26x low (helper-97)."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("_bench_pairs_flops", ROOT / "bench" / "pairs.py")
    pairs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, pairs)
    spec.loader.exec_module(pairs)
    args = SimpleNamespace(d_model=8, hidden=16, dtype="float32", swiglu_hidden=None)
    assert [pairs.make_head("mlp", args, layers, 11)[2] for layers in (2, 3, 4)] == [16 * 22, 16 * 16 + 16 * 22,
                                                                                     2 * 16 * 16 + 16 * 22]


def test_pairs_bench_fails_a_peer_whose_gradients_are_not_the_objectives(tmp_path, monkeypatch):
    """A wrong baseline passed the loss-only check (helper-97: at initialisation every pair's loss is
    about log V). Every contender's gradients are now checked against the torch backend's in
    float32, and the run fails naming it; the real contenders pass."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_pairs_check", ROOT / "bench" / "pairs.py")
    pairs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, pairs)
    spec.loader.exec_module(pairs)
    argv = ["--T", "12", "--batch", "2", "--d-model", "8", "--hidden", "8", "--vocab", "11", "--reps", "1",
            "--no-compile", "--subsample-T", "0", "--backends", "cpp", "torch"]
    pairs.main(argv + ["--out", str(tmp_path / "good.json")])
    rows = [r for r in json.loads((tmp_path / "good.json").read_text())["rows"] if "grad_rel_err" in r]
    assert {r["method"] for r in rows} == {"cpp", "torch", "materialised", "lean naive"}
    assert all(r["check"] == "ok" and r["grad_checked_against"] == "torch backend, float32" for r in rows)
    real = pairs.lean

    def half(*args):  # the loss, but half its gradient: no loss check can see it
        loss = real(*args)
        return 0.5 * loss + 0.5 * loss.detach()
    monkeypatch.setattr(pairs, "lean", half)
    with pytest.raises(SystemExit, match=r"gradients off the torch backend, float32 yardstick's: lean naive \(T=12, mlp\)"):
        pairs.main(argv + ["--out", str(tmp_path / "bad.json")])
    bad = {r["method"]: r for r in json.loads((tmp_path / "bad.json").read_text())["rows"]}
    assert bad["lean naive"]["check"] == "FAIL" and bad["materialised"]["check"] == "ok"


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
        assert {(head, "torch"), (head, "materialised"), (head, "lean naive"), (head, "torch pairs=0.02")} <= timed, timed
    assert ("mlp", "cpp") in timed and ("swiglu", "cpp") not in timed  # cpp takes only TextHead
    assert all(r["reps"] == 2 and r["seconds"] > 0 and r["peak_mem_mb"] >= 0 for r in rows)
    # GFLOP/s counts the per-pair GEMMs: for swiglu its Down projection and lm_head
    sw = next(r for r in rows if r["head"] == "swiglu" and r["method"] == "torch")
    hidden = 128  # ResidualSwiGLUHead's width for m = 8 (its minimum)
    assert sw["gflops"] == pytest.approx(6 * sw["pairs"] * (hidden * 2 * 8 + 8 * 2 * 11) / sw["seconds"] / 1e9)


def test_pairs_bench_names_every_peer_it_skips_for_memory(tmp_path):
    """Over --mem-limit-gb the materialised objective and the lean naive are skipped with a row
    saying why (the lean naive vanished silently before), and the rest still runs."""
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "pairs.py"), "--T", "6", "--batch", "2",
                          "--d-model", "8", "--hidden", "8", "--vocab", "11", "--reps", "1", "--no-compile",
                          "--head", "mlp", "--backends", "torch", "--subsample-T", "0",
                          "--mem-limit-gb", "1e-9", "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    notes = {r["method"]: r["note"] for r in rows if "note" in r}
    assert notes["materialised"].startswith("skipped: needs about") and notes["lean naive"] == notes["materialised"]
    assert {r["method"] for r in rows if "seconds" in r} == {"torch"}


def test_gpu_check_levers_turn_on_every_lever_and_a_case_reaches_relu_in_gemm(monkeypatch):
    """--levers holds every lever of docs/backends.md's table to float64 (it turned on five of nine),
    and one case is a relu head with a hidden layer after the split one, the only kind relu_in_gemm
    and hidden_sums' relu branch act on (no case was)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_gpu_check", ROOT / "bench" / "gpu_check.py")
    check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, check)
    spec.loader.exec_module(check)
    table = (ROOT / "docs" / "backends.md").read_text().split("### Levers", 1)[1]
    assert set(re.findall(r"^\| `(\w+)(?:=\d+)?` \|", table, flags=re.M)) == set(check.ALL_LEVERS)
    assert any(c["act"] == "relu" and c["n_layers"] >= 3 for c in check.BASE_CASES)
    seen = []
    monkeypatch.setattr(check, "_check_all", lambda args: seen.append(dataclasses.asdict(runtime.SWITCHES)) or 0)
    assert check.main(["cpu", "--levers"]) == 0  # no backend named: every one (Python 3.11 refused that)
    assert len(seen) == 2 and all(seen[1][k] == v for k, v in check.ALL_LEVERS.items()), seen
    # the first run without fused_ce, under which ce_bias_sums has nothing to do
    assert all(seen[0][k] == v for k, v in check.ALL_LEVERS.items() if k != "fused_ce") and not seen[0]["fused_ce"]


def test_gpu_check_refuses_an_unknown_backend():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "cpu", "tirton"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'tirton'" in run.stderr


def test_segment_sums_bench_agrees_across_launch_shapes(tmp_path):
    """bench/segment_sums.py times the segment kernels under several launch shapes and checks each
    against the first: every shape must give the same sums (up to float32 reassociation)."""
    def segment_sums(*args):
        out = tmp_path / "seg.json"
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "segment_sums.py"), "--batch", "2", "--T", "9",
                              "--d-model", "8", "--vocab", "5", "--reps", "1", "--configs", "2x8x1", "--out", str(out),
                              *args], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                             env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(out.read_text())["rows"]

    rows = segment_sums("--parts", "swiglu", "text-sum")
    assert {r["part"] for r in rows} == {"swiglu", "text-sum"}
    # swiglu: the old shape, the default, the one asked for; text-sum (8 wide): the old shape's
    # block clipped to the rows is the default's, timed once
    for part, n in (("swiglu", 3), ("text-sum", 2)):
        mine = [r for r in rows if r["part"] == part]
        assert len(mine) == n and (mine[-1]["BS"], mine[-1]["BK"], mine[-1]["warps"]) == (2, 8, 1)
        assert all(r["prefix_ms"] > 0 and r["suffix_ms"] > 0 and r["rel_err_vs_first"] < 1e-5 for r in mine), mine
    # --structured: structured_grad_kernel under its block shapes, each against the first
    rows = segment_sums("--parts", "text-gelu", "--structured")
    assert len(rows) >= 2 and all(r["walk"] == "structured" and r["rel_err_vs_first"] < 1e-5 for r in rows), rows


def test_cross_entropy_bench_agrees_across_launch_shapes(tmp_path):
    """bench/cross_entropy.py times the cross-entropy kernel under its launch shapes (the two-pass
    half, one read, blocks of rows, the column sums) and checks each against the first, the sums
    against a column sum of the gradient written."""
    out = tmp_path / "ce.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "cross_entropy.py"), "--device", "cpu", "--rows", "9",
                          "--vocab", "19", "--reps", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["shape"] for r in rows] == ["1x4-2pass", "2x4", "2x4+sums", "column sum (torch, float32)"], rows
    assert all(r["ms"] > 0 and r["err"] < 1e-5 for r in rows), rows


def test_logits_ce_bench_agrees_across_variants(tmp_path):
    """bench/logits_ce.py times the unfused last layer (addmm, cross-entropy, column sum; and with the
    cross-entropy's sums) and the fused kernel on one chunk, and checks each against the first: the
    loss rows, the logits' gradient and the bias sums."""
    out = tmp_path / "lce.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "logits_ce.py"), "--device", "cpu", "--rows", "37",
                          "--vocab", "19", "--K", "24", "--reps", "1", "--out", str(out)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in rows] == ["unfused (addmm, cross-entropy, column sum)", "unfused, ce_bias_sums",
                                            "fused 16x32/16 w4 s1 (default)", "addmm alone (cuBLAS logits)"], rows
    assert all(r["ms"] > 0 and r["rel_err_vs_first"] < 1e-5 for r in rows), rows
    assert json.loads(out.read_text())["complete"]
    # A fused kernel whose gradient is wrong: its row is timed but named, and the exit status is 1
    # (the error was computed and never compared: gpu.sh took a wrong kernel's time as a result).
    wrong = tmp_path / "wrong.py"
    wrong.write_text(f"""import runpy, sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import bst_fast.kernels.logits_cross_entropy as m
real = m.pair_logits_cross_entropy_
def wrong(*a, **k):
    out = real(*a, **k)
    a[3].mul_(3.0)  # Z: the logits' gradient, tripled
    return out
m.pair_logits_cross_entropy_ = wrong
sys.argv = ["logits_ce.py", "--device", "cpu", "--rows", "37", "--vocab", "19", "--K", "24", "--reps", "1",
            "--out", {str(out)!r}]
runpy.run_path({str(ROOT / "bench" / "logits_ce.py")!r}, run_name="__main__")
""")
    run = subprocess.run([sys.executable, str(wrong)], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 1 and "fused 16x32/16 w4 s1 (default) differs from the first variant by" in run.stderr
    result = json.loads(out.read_text())
    assert list(result["failed"]) == ["fused 16x32/16 w4 s1 (default)"] and result["complete"]
    assert [r["variant"] for r in result["results"]][2] == "fused 16x32/16 w4 s1 (default) FAIL"


def test_gemm_shapes_bench_checks_its_triton_gemm(tmp_path):
    """bench/gemm_shapes.py: its Triton GEMM agrees with the float64 product at every config and
    layout (the interpreter, float16), and compiles for sm_90 to wgmma with no spills."""
    out = tmp_path / "g.json"
    env = {**__import__("os").environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_shapes.py"), "--device", "cpu", "--tiny",
                          "--reps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 6 and not result["failed"]
    assert all(r["triton_ms"] > 0 and r["triton_err"] < 1e-2 for r in result["rows"]), result["rows"]
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        return
    env.pop("TRITON_INTERPRET")
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "gemm_shapes.py"), "--compile-only", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads(out.read_text())["compile"]
    assert len(rows) == 10 and all(r["wgmma"] and r["spills"] == 0 for r in rows), rows


def test_segment_configs_refuses_an_unknown_name_and_passes_the_rest_to_pairs_py():
    script = str(ROOT / "bench" / "segment_configs.py")
    run = subprocess.run([sys.executable, script, "olde"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "usage: segment_configs.py {default,old,sweep}" in run.stderr
    run = subprocess.run([sys.executable, script, "old", "--help"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "--subsample-T" in run.stdout  # pairs.py's own help


def test_paper_speed_runs_every_column_of_table_3_through_the_trainer(tmp_path):
    """bench/paper_speed.py --shape tiny on the CPU: every column ran through train_step, with its
    rates, memory, phases (the model's record_function ranges marked) and the paper's config."""
    out, trace = tmp_path / "new" / "out", tmp_path / "trace"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "paper_speed.py"), "--device", "cpu", "--shape", "tiny",
                          "--threads", "1", "--out", str(out), "--trace", str(trace), "--profile-steps", "1"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    result = json.loads((out / "paper_speed.json").read_text())
    assert result["device"].startswith("cpu-") and result["shape_name"] == "tiny" and result["steps"] == 3
    assert result["switches"]["structured_sums"] is False  # the levers in force are recorded
    cols = {c["name"]: c for c in result["columns"]}
    assert list(cols) == ["GPT", "BST original", "BST improved", "BST improved, SwiGLU head"]
    L, B = 34, 4  # T = 32 with BOS and EOS
    for name, c in cols.items():
        assert c["error"] is None, (name, c["error"])
        assert c["it_per_s"] > 0 and c["it_per_s_wall"] > 0 and len(c["step_ms"]) == 3
        assert c["tokens_per_s"] == pytest.approx(c["it_per_s"] * B * L)
        assert isinstance(c["peak_mem_mb"], float) and c["peak_mem_kind"].startswith("cpu RSS growth")
        assert c["tflops"] > 0 and c["params"] > 0 and c["loss"] > 0
        p = c["phases_ms"]
        assert all(p[k] is not None and p[k] > 0 for k in ("forward", "backward", "optimizer", "step")), p
        bst = name != "GPT"
        assert (p["encoders"] is not None and p["pair_loss"] is not None) == bst, p
        assert (c["pairs_per_step"] > 0) == bst
        assert (trace / f"{c['slug']}.trace.json").stat().st_size > 0 and (trace / f"{c['slug']}.txt").exists()
    # the paper's columns as config fields (Table 3's caption: gamma = 0.9, lambda = 0, 2% of pairs, shared)
    gpt, orig, imp, sw = (cols[n]["config"] for n in cols)
    assert gpt["method"] == "forward" and orig["method"] == imp["method"] == sw["method"] == "bst"
    assert not orig["model"]["shared_encoders"] and orig["pairs"] is None and orig["gamma"] == 0
    assert imp["model"]["shared_encoders"] and imp["pairs"] == 0.02 and imp["gamma"] == 0.9
    assert imp["next_weight"] == 0.0 and imp["model"]["gpt_head"] and imp["model"]["head_type"] == "mlp"
    assert sw["model"]["head_type"] == "swiglu" and sw["pairs"] == 0.02
    # the pairs the loss draws: round(0.02 |P_r|) a row (11 of 528), not 0.02 of every pair (42.24)
    assert cols["BST original"]["pairs_per_step"] == B * (L - 1) * (L - 2) // 2
    assert cols["BST improved"]["pairs_per_step"] == B * round(0.02 * (L - 1) * (L - 2) / 2) == 44
    md = (out / "paper_speed.md").read_text()
    assert "3.09" in md and "0.205" in md and "0.801" in md and "BST improved, SwiGLU head" in md


def test_paper_speed_compiles_the_encoders_as_train_does(monkeypatch):
    """--set compile=true: each column's encoders go through trainer.compile_encoders, as
    bst_fast.train compiles them (the forward one and a BST's own backward one), and not without it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_paper_speed_compile", ROOT / "bench" / "paper_speed.py")
    ps = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ps)  # its dataclasses look their module up
    spec.loader.exec_module(ps)
    compiled = []
    monkeypatch.setattr(ps, "compile_encoders", lambda model: compiled.append(model))
    base = ps.base_config(ps.SHAPES["tiny"], "cpu", 4)
    task = ps.SyntheticText(1000, 32)
    for column in ps.COLUMNS[:2]:
        for sets in ([], ["compile=true"]):
            run = ps.build_column_run(ps.column_config(column, base, sets), task, "cpu")
            assert (compiled[-1] is run.model) if sets else (run.model not in compiled)
    assert len(compiled) == 2 and compiled[1].backward_encoder is not None


def _paper_speed(monkeypatch, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "paper_speed.py")
    ps = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, ps)  # its dataclasses look their module up
    spec.loader.exec_module(ps)
    return ps


def test_paper_speed_columns_reach_the_loss_as_the_paper_sets_them(monkeypatch):
    """The objective each column's step hands belief_state_loss (not the trainer's pair counter):
    2% of the pairs and lambda = 0 for the improved BST, all pairs and 0.5 for the original."""
    import bst_fast.model as model_mod

    ps = _paper_speed(monkeypatch, "_paper_speed_loss")
    seen, real = [], model_mod.belief_state_loss
    monkeypatch.setattr(model_mod, "belief_state_loss", lambda *a, **k: seen.append(k) or real(*a, **k))
    base = ps.base_config(ps.SHAPES["tiny"], "cpu", 4)
    task = ps.SyntheticText(1000, 32)
    want = {"bst-original": (None, 0.5, False), "bst-improved": (0.02, 0.0, True)}
    for column in ps.COLUMNS:
        seen.clear()
        run = ps.build_column_run(ps.column_config(column, base, []), task, "cpu")
        ps.train_step(run, 0)
        if column.slug == "gpt":
            assert seen == [] and type(run.model).__name__ == "ForwardOnly"
        elif column.slug in want:
            pairs, next_weight, gpt = want[column.slug]
            assert [(k["pairs"], k["next_weight"]) for k in seen] == [(pairs, next_weight)]
            assert (run.model.gpt is not None) == gpt


def test_paper_speed_variants_run_beside_their_column(tmp_path, monkeypatch):
    ps = _paper_speed(monkeypatch, "_paper_speed_variants")
    assert ps.parse_variant("f=fused_ce=1,triton_chunk_bytes=1000,window_rows=none") == \
        ("f", {"fused_ce": True, "triton_chunk_bytes": 1000, "window_rows": None}, [])
    assert ps.parse_variant("t=triton_ops=1,chunk_pairs=none") == ("t", {"triton_ops": True, "chunk_pairs": None}, [])
    assert ps.parse_variant("t=triton_ops=none")[1] == {"triton_ops": None}
    assert ps.parse_variant("c=model.dropout=0.1,fused_ce=0,grad_clip=2") == \
        ("c", {"fused_ce": False}, ["model.dropout=0.1", "grad_clip=2"])
    for bad, match in (("f", "expected NAME"), ("default=fused_ce=1", "not 'default'"), ("f=fusedce=1", "a switch, one of"),
                       ("f=fused_ce=2", "takes 1 or 0"), ("f=triton_chunk_bytes=big", "takes an int"),
                       ("f=vocab_pad=-4", "switch vocab_pad must be an int >= 0, got -4"),
                       ("f=chunk_pairs=0", "switch chunk_pairs must be None or an int >= 1, got 0"),
                       ("f=triton_ops=2", r"triton_ops takes 1 or 0 \(or none\)")):
        with pytest.raises(ValueError, match=match):
            ps.parse_variant(bad)
    out = tmp_path / "v"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "paper_speed.py"), "--device", "cpu", "--shape", "tiny",
                          "--threads", "1", "--columns", "gpt", "bst-original", "bst-improved", "--variant", "dp=host_pairs=0",
                          "--variant", "ac=model.activation_checkpointing=true", "--variant", "p=pairs=0.5",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    cols = json.loads((out / "paper_speed.json").read_text())["columns"]
    # the subsample's switch alone: not run again on all pairs; a config field: every column that takes
    # it again (the BST's pairs: not the GPT column, which says so)
    assert [(c["name"], c["variant"]) for c in cols] == [
        ("GPT", None), ("GPT [ac]", "ac"), ("BST original", None), ("BST original [ac]", "ac"),
        ("BST original [p]", "p"), ("BST improved", None), ("BST improved [dp]", "dp"), ("BST improved [ac]", "ac"),
        ("BST improved [p]", "p")]
    assert cols[5]["switches"]["host_pairs"] and not cols[6]["switches"]["host_pairs"]
    assert [c["config"]["model"]["activation_checkpointing"] for c in cols] == [False, True, False, True, False, False,
                                                                                  False, True, False]
    assert [c["config"]["pairs"] for c in cols if c["variant"] == "p"] == [0.5, 0.5]
    assert "--variant p skips the GPT column: config field 'pairs'" in run.stdout
    assert all(c["error"] is None and c["it_per_s"] > 0 for c in cols)
    assert isinstance(cols[3]["triton_compiles_timed"], (int, type(None)))
    assert "BST improved [dp] " in (out / "paper_speed.md").read_text().split("over its column's")[1]
    for variant, named in (("x=nope=1", "nope"), ("x=model.dropuot=0.1", "dropuot"), ("x=steps=abc", "steps")):
        bad = subprocess.run([sys.executable, str(ROOT / "bench" / "paper_speed.py"), "--device", "cpu", "--shape", "tiny",
                              "--variant", variant], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and named in bad.stderr and "==" not in bad.stdout, bad.stderr


def test_paper_speed_refuses_a_bad_set_before_running():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "paper_speed.py"), "--device", "cpu", "--shape",
                          "tiny", "--set", "model.n_layr=3"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "n_layr" in run.stderr and "==" not in run.stdout


def test_profile_bench_profiles_the_trainers_step(tmp_path):
    """bench/profile.py profiles bst_fast.trainer.train_step: the phase table and the trace."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "profile.py"), "--device", "cpu", "--T", "8",
                          "--steps", "2", "--head", "swiglu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    text = next(tmp_path.glob("cpu*-profile-swiglu.txt")).read_text()
    for phase in ("encoders", "pair_loss", "backward", "optimizer", "step"):
        assert f"| {phase} |" in text, text[:2000]
    assert "train_step" in text and next(tmp_path.glob("cpu*-profile-swiglu.trace.json")).stat().st_size > 0


def test_text_data_bench_runs_every_step_on_a_tiny_corpus(tmp_path):
    """bench/text_data.py on a corpus of a few hundred short stories: tokenize with and without BPE
    training, both encoders, the start-up and batches, unpacked and packed."""
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "text_data.py"), "--size-mb", "0.05", "--sentences", "1", "4",
                          "--hf-mb", "0.01", "--steps", "5", "--workers", "0", "--dir", str(tmp_path / "d"),
                          "--json", str(out), "--out", str(tmp_path / "r.md")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["with_bpe"]["seconds"] > 0 and r["encode_only"]["vocab_size"] == 1000 and r["encode_only"]["tokens"] > 0
    assert r["compare"]["encode_batch"] > 0 and r["compare"]["pieces"] > 0
    plain, packed = r["train_start"], r["packed"]
    assert plain["documents"] == packed["documents"] == r["encode_only"]["documents"]
    assert packed["train_rows"] < plain["train_rows"] / 2  # stories of 1 to 3 sentences: several a row
    assert plain["padding_unpacked"] == packed["padding_unpacked"] > packed["padding_packed"]
    assert "Packed (`pack: true`" in (tmp_path / "r.md").read_text()


def test_packed_bench_checks_the_two_layouts_agree_and_times_both(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "packed.py"), "--docs", "6", "--T", "16", "--min-len", "2", "--d-model", "8",
                          "--hidden", "8", "--vocab", "11", "--reps", "2", "--enc-layers", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "packed.json").read_text())
    unpacked, packed = report["results"]
    assert unpacked["pairs"] == packed["pairs"] > 0 and report["loss_rel_diff"] < 1e-4
    assert unpacked["real_tokens"] == packed["real_tokens"] and packed["rows"] < unpacked["rows"]
    assert packed["padding"] < unpacked["padding"]
    assert all(r["seconds"] > 0 for r in report["results"])


def test_levers_bench_checks_each_setting_then_times_them_side_by_side(tmp_path):
    """bench/levers.py on the CPU (Triton interpreted): each lever checked against the defaults, then
    timed interleaved; the JSON names every setting it ran, the baselines first."""
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "levers.py"), "--device", "cpu", "--dtype", "float32",
                          "--batch", "2", "--T", "6", "--d-model", "8", "--hidden", "8", "--vocab", "19", "--reps", "1",
                          "--levers", "bias_in_gemm", "vocab_pad=128", "fused_ce", "pairs=0.02 device_sampler",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "levers.json").read_text())
    assert result["failed"] == {}  # a setting that raised or differed would be named here, untimed
    names = [r["name"] for r in result["rows"]]
    # the baselines come first, pairs=0.02 added for the subsampled setting
    assert names == ["default", "pairs=0.02", "bias_in_gemm", "vocab_pad=128", "fused_ce", "pairs=0.02 device_sampler"]
    for r in result["rows"]:
        assert r["ms"] > 0 and len(r["times_ms"]) == 1
        assert r["max_rel_err_vs_default"] < 1e-5  # checked before it was timed (the sampler at pairs=1.0)
    assert "| bias_in_gemm |" in (tmp_path / "levers.md").read_text()
    assert result["complete"] and result["reps"] == result["reps_asked"] == 1


def test_levers_bench_cut_short_leaves_the_reps_it_timed(tmp_path, monkeypatch):
    """gpu.sh cuts a step's time to what its budget leaves: levers.py wrote nothing before its last
    rep, so a cut run came back empty. It writes after the checks and after every round of reps."""
    import importlib.util
    import time as time_mod

    spec = importlib.util.spec_from_file_location("_bench_levers", ROOT / "bench" / "levers.py")
    levers = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, levers)
    spec.loader.exec_module(levers)
    clock, calls = time_mod.perf_counter, []

    def cut(*a):  # the timed reps read the clock twice a setting: killed as round 2 starts
        calls.append(1)
        if len(calls) > 4:
            raise KeyboardInterrupt
        return clock()

    monkeypatch.setattr(levers.time, "perf_counter", cut)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(KeyboardInterrupt):
        levers.main(["--device", "cpu", "--dtype", "float32", "--batch", "2", "--T", "6", "--d-model", "8",
                     "--hidden", "8", "--vocab", "19", "--reps", "3", "--levers", "bias_in_gemm", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "levers.json").read_text())
    assert result["reps"] == 1 and result["reps_asked"] == 3 and not result["complete"]
    assert [len(r["times_ms"]) for r in result["rows"]] == [1, 1] and all(r["ms"] > 0 for r in result["rows"])
    assert "**Incomplete: 1 of 3 reps**" in (tmp_path / "levers.md").read_text()


def _modelled_growth(tmp_path, backend, *args):
    """(bytes the modelled peak grows by from B = 8 to 24, the bytes that growth may hold besides
    tables, the larger batch's ratio to the materialised objective's, the smaller's): T = 10, m = 8,
    V = 2000, chunks of 1 MB (about 120 pairs here: both batches take several, of the same size) and
    windows of one chunk's rows."""
    def peak(B):
        out = tmp_path / f"{backend}-{B}.json"
        run = subprocess.run([sys.executable, str(ROOT / "bench" / "memory_model.py"), "--backend", backend, *args,
                              "--batch", str(B), "--T", "10", "--d-model", "8", "--vocab", "2000", "--chunk-mb", "1",
                              "--window-rows", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(out.read_text())

    small, large = peak(8), peak(24)
    L, m = 12, 8
    pairs = large["pairs"] - small["pairs"]
    expected = 16 * 2 * L * m * 2 + pairs * 3 * 4 + 16 * 2 * L * 8  # bf16 df, db; int32 ia, ib, perm; int64 offsets
    ratio = f"{backend}_vs_materialised"
    return (large[f"{backend}_mb"] - small[f"{backend}_mb"]) * 2**20, expected, large[ratio], small[ratio]


def test_memory_model_sees_no_table_of_the_whole_batch(tmp_path):
    """bench/memory_model.py predicts the triton backend's GPU peak from its allocations on the CPU.
    With a first-layer window of one chunk's rows, 16 more rows add the gradients of f and b and
    the pair list, not the four float32 (rows, L, h1) tables of the split first layer."""
    grew, expected, large, small = _modelled_growth(tmp_path, "triton", "--hidden", "64")
    tables = 16 * 4 * 12 * 64 * 4  # what whole-batch A, B, dA, dB would add (L = 12, h1 = 64)
    assert grew < expected + tables / 4, (grew, expected, tables)
    assert large < small < 1


def test_memory_model_of_the_torch_backend_sees_no_table_of_the_whole_batch(tmp_path):
    """The same for the torch backend and the SwiGLU head, whose parts are made a window of rows at
    a time: 16 more rows add the gradients of f and b and the pair list, not the float32 [gate | up]
    tables, their sums and the [f ; 0], [0 ; b] parts of 16 rows (and the backward's copies)."""
    grew, expected, large, small = _modelled_growth(tmp_path, "torch", "--head", "swiglu", "--swiglu-hidden", "64")
    L, m, H = 12, 8, 64
    tables = 16 * L * 2 * (2 * H * 4 * 2 + 2 * m * (2 + 4))  # [gate | up] and [f ; 0] tables and their sums, both sides
    assert grew < expected + tables / 4, (grew, expected, tables)
    assert large < small < 1


def test_host_pairs_times_the_host_work_of_a_subsample(tmp_path):
    """bench/host_pairs.py: each row draws k_r = round(0.02 * 32385) = 648 pairs of a full T = 256 row."""
    pytest.importorskip("bst_fast._C")
    out = tmp_path / "host.json"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "host_pairs.py"), str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(out.read_text())
    assert set(got) == {f"B={B} threads={t}" for B in (32, 256) for t in (1, 2)}
    for key, row in got.items():
        assert row["pairs"] == 648 * int(key.split()[0][2:])
        assert all(row[k] > 0 for k in ("sampler_ms", "prepare_ms", "pair_list_ms"))
