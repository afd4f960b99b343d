"""Run folders, checkpoints and the CLI under faults and hostile input (issue 20's cases, one test each):
nothing a user owns is deleted, a second process is refused, every resume continues exactly or says
why it cannot, and no damaged checkpoint is used."""
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bst_fast import TrainConfig, load_model, train
from bst_fast import checkpoint as ckpt_mod
from bst_fast.checkpoint import CHECKSUMS, latest_checkpoint, prune
from bst_fast.config import resolve_config
from bst_fast.files import sha256, sha256_written, start_writeback
from bst_fast.run_folder import LOCK, MARKER, RunFolder
from _helpers import star_fields_for

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"


def tiny(out_dir, **changes):
    return resolve_config(TINY, out_dir=str(out_dir), **{**star_fields_for(changes.get("data", "star")), **changes})


def cli(*args, cwd=None, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "bst_fast", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, timeout=300, **kw)


def one_error_line(proc):
    """A CLI failure: a non-zero exit and exactly one line on stderr, starting 'error:'."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stdout
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    return lines[0]


def snapshot(folder: Path):
    """Every path and file content under `folder`; the lock file's content is the pid of the last
    process that locked the folder (a refused one too), so only its presence counts."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() and p.name != LOCK else None)
            for p in sorted(folder.rglob("*"))}


def rehash(ckpt: Path):
    sums = {p.name: sha256(p) for p in ckpt.iterdir() if p.name != CHECKSUMS}
    (ckpt / CHECKSUMS).write_text(json.dumps(sums))


# ---- 1. --overwrite deletes only what a run wrote, only in a marked folder

def test_overwrite_of_an_unmarked_folder_is_refused_and_deletes_nothing(tmp_path):
    d = tmp_path / "d"
    (d / "checkpoints" / "other").mkdir(parents=True)
    (d / "checkpoints" / "other" / "w.pt").write_text("w")
    (d / "tokenizer.json").write_text("{}")
    before = snapshot(d)
    with pytest.raises(ValueError, match=r"not a bst_fast run folder.*checkpoints/.*tokenizer\.json"):
        train(tiny(d), overwrite=True)
    assert snapshot(d) == before


def test_overwrite_of_a_run_keeps_foreign_files(tmp_path):
    d = tmp_path / "d"
    train(tiny(d))
    assert (d / MARKER).is_file()
    (d / "checkpoints" / "other").mkdir()
    (d / "checkpoints" / "other" / "w.pt").write_text("w")
    (d / "notes.txt").write_text("mine")
    (d / "tensorboard").mkdir(exist_ok=True)
    (d / "tensorboard" / "mine.txt").write_text("mine")
    run_id = json.loads((d / MARKER).read_text())["run_id"]
    train(tiny(d, seed=1), overwrite=True)
    assert (d / "checkpoints" / "other" / "w.pt").read_text() == "w"
    assert (d / "notes.txt").read_text() == "mine" and (d / "tensorboard" / "mine.txt").read_text() == "mine"
    assert json.loads((d / MARKER).read_text())["run_id"] != run_id  # a new run
    assert json.loads((latest_checkpoint(d) / "config.json").read_text())["seed"] == 1


def test_current_folder_is_never_deleted_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train(tiny("."))
    with pytest.raises(ValueError, match="current folder"):
        train(tiny("."), overwrite=True)
    assert latest_checkpoint(".") is not None


def test_star_refuses_a_foreign_method_folder(tmp_path):
    (tmp_path / "proj" / "bst" / "checkpoints").mkdir(parents=True)
    (tmp_path / "proj" / "bst" / "checkpoints" / "keep.pt").write_text("k")
    proc = cli("star", "--config", TINY, "--set", f"out_dir={tmp_path / 'proj'}")
    assert "not a bst_fast run folder" in one_error_line(proc)
    assert (tmp_path / "proj" / "bst" / "checkpoints" / "keep.pt").read_text() == "k"


# ---- 2. every check before any deletion

@pytest.mark.parametrize("sets", [["backend=triton"], ["backend=cpp", "model.head_type=swiglu"]])
def test_a_failing_overwrite_leaves_the_old_run(tmp_path, sets):
    """The backend's refusal (triton off a GPU, cpp with the SwiGLU head) comes before the deletion."""
    if "backend=triton" in sets and torch.cuda.is_available():
        pytest.skip("triton runs here")
    d = tmp_path / "k"
    train(tiny(d))
    before = snapshot(d)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set", f"out_dir={d}",
                           "--overwrite", *[a for s in sets for a in ("--set", s)]],
                          capture_output=True, text=True, env={**env, "OMP_NUM_THREADS": "1"}, timeout=300)
    one_error_line(proc)
    assert snapshot(d) == before


def test_a_failed_first_text_start_leaves_nothing(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"story {i} of a cat and a dog who ran far away" for i in range(40)))
    d = tmp_path / "t"
    with pytest.raises(ValueError):
        train(tiny(d, data=str(corpus), text_vocab=300, max_len=32), backend="cpp", **{"model.head_type": "swiglu"})
    assert not d.exists() or not any(d.iterdir())


# ---- 3. pruning

def test_pruning_orders_by_step_and_keeps_what_latest_names(tmp_path):
    root = tmp_path / "checkpoints"
    for n in (99_999_999, 100_000_000, 5):
        (root / f"step-{n:08d}").mkdir(parents=True)
    prune(root, root / "step-100000000", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-100000000", "step-99999999"]


def test_resume_after_a_kill_between_rename_and_latest(tmp_path):
    """keep 1, a checkpoint renamed into place but `latest` still naming the one before; the resumed
    run checkpoints more often: every later resume still finds what `latest` names."""
    d = tmp_path / "r"
    cfg = dict(steps=30, ckpt_every=10, keep_checkpoints=1, eval_every=0, log_every=5)
    train(tiny(d, **cfg), stop_at=10)
    kept = tmp_path / "step10"
    shutil.copytree(d / "checkpoints" / "step-00000010", kept)
    train(tiny(d, **cfg), resume=True, stop_at=20)
    # the kill: step-20 is in place, `latest` was not moved yet (and step-10 not pruned yet)
    shutil.copytree(kept, d / "checkpoints" / "step-00000010")
    (d / "checkpoints" / "latest").write_text("step-00000010")
    train(tiny(d, **{**cfg, "ckpt_every": 5}), resume=True, stop_at=25)
    assert latest_checkpoint(d).name == "step-00000025"
    train(tiny(d, **{**cfg, "ckpt_every": 5}), resume=True)
    assert latest_checkpoint(d).name == "step-00000030"
    full = tmp_path / "full"
    train(tiny(full, **cfg))
    a, _ = load_model(d)
    b, _ = load_model(full)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---- 4. one process per folder

def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    d = tmp_path / "l"
    d.mkdir()
    holder = RunFolder(d)
    holder.lock()
    try:
        with pytest.raises(ValueError, match=rf"in use by another process \(pid {os.getpid()}\)"):
            train(tiny(d))
        assert sorted(p.name for p in d.iterdir()) == [LOCK]  # nothing written
    finally:
        holder.unlock()
    train(tiny(d))  # released: the folder takes a run


def test_two_concurrent_runs_one_wins_and_its_folder_is_its_own(tmp_path):
    d = tmp_path / "c"
    slow = ["--set", "steps=60", "--set", "ckpt_every=5", "--set", "eval_every=0"]
    procs = [subprocess.Popen([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set",
                               f"out_dir={d}", "--set", f"seed={s}", *slow], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for s in (1, 2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], outs
    loser = outs[codes.index(2)][1]
    # the loser finds the lock held, or (a loaded machine slowing its start past the winner's end)
    # the finished run, before or after taking the lock
    assert any(m in loser for m in ("in use by another process", "already holds a run", "changed while this run started"))
    winner_seed = 1 + codes.index(0)
    for ck in (d / "checkpoints").glob("step-*"):
        assert json.loads((ck / "config.json").read_text())["seed"] == winner_seed
    rows = (d / "metrics.csv").read_text().splitlines()[1:]
    keys = [tuple(r.split(",")[:2]) for r in rows]
    assert len(keys) == len(set(keys))  # no interleaved duplicate rows


# ---- 5. a full disk, and a stale temporary folder

def test_a_file_size_limit_is_named_as_such_and_a_failed_metrics_write_names_its_file(tmp_path, monkeypatch):
    """ulimit -f was reported as a full disk, and a failed metrics.csv write as a bare "[Errno 27]
    File too large" (review helper-100)."""
    import csv

    from bst_fast import run_folder

    d = tmp_path / "f"
    train(tiny(d), stop_at=3)
    real = torch.save

    def too_large(obj, f, *a, **k):
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(ckpt_mod.torch, "save", too_large)
    with pytest.raises(OSError, match=r"file-size limit \(ulimit -f\).*step-00000003 is intact"):
        train(tiny(d), resume=True)
    monkeypatch.setattr(ckpt_mod.torch, "save", real)

    class Full:
        def __init__(self, *a, **k):
            pass

        def writerow(self, row):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_folder.csv, "writer", Full)
    with pytest.raises(OSError, match=r"could not write the metrics of step \d+ to .*metrics\.csv \(the disk is "
                                      r"full.*a resume from the latest checkpoint cuts the file back"):
        train(tiny(d), resume=True)
    Full.writerow = lambda self, row: (_ for _ in ()).throw(OSError("disk gone"))  # no errno (helper-101)
    with pytest.raises(OSError, match=r"^could not write the metrics of step \d+ to .*metrics\.csv \(disk gone\)"):
        train(tiny(d), resume=True)
    monkeypatch.setattr(run_folder.csv, "writer", csv.writer)
    # safetensors' writer gives the errno in its text only (helper-101: a ulimit -f on model.safetensors)
    from bst_fast.files import out_of_room

    class SafetensorError(Exception):
        pass
    assert out_of_room(SafetensorError("Error while serializing: I/O error: File too large (os error 27)")) == \
        "a file reached the process's file-size limit (ulimit -f)"
    assert out_of_room(SafetensorError("I/O error: No space left on device (os error 28)")).startswith("the disk is full")
    assert out_of_room(SafetensorError("I/O error: Permission denied (os error 13)")) is None


def test_a_full_disk_is_reported_and_the_previous_checkpoint_kept(tmp_path, monkeypatch):
    d = tmp_path / "f"
    train(tiny(d), stop_at=3)
    good = latest_checkpoint(d)
    real = torch.save

    def full(obj, f, *a, **k):  # as torch.save reports it: a RuntimeError raised from the OSError
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc] . unexpected pos 43840 vs 43792") from e

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    with pytest.raises(OSError, match=r"disk is full.*step-00000003 is intact"):
        train(tiny(d), resume=True)
    monkeypatch.setattr(ckpt_mod.torch, "save", real)
    assert latest_checkpoint(d) == good
    assert not [p for p in (d / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    train(tiny(d), resume=True)
    assert latest_checkpoint(d).name == "step-00000006"


def test_a_stale_temporary_checkpoint_is_cleaned_up(tmp_path):
    d = tmp_path / "s"
    train(tiny(d), stop_at=3)
    stale = d / "checkpoints" / ".step-00000006.424242.tmp"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"half")
    train(tiny(d), resume=True)
    assert not stale.exists() and latest_checkpoint(d).name == "step-00000006"


# ---- 6. damaged checkpoints are refused

def test_damaged_or_non_finite_checkpoints_are_refused(tmp_path):
    d = tmp_path / "n"
    train(tiny(d), stop_at=3)
    ck = latest_checkpoint(d)
    weights = ck / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = b"\xff" * 8  # garbage in the tensor bytes, header intact
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt.*model.safetensors"):
        train(tiny(d), resume=True)
    with pytest.raises(ValueError, match="corrupt"):
        load_model(d)
    rehash(ck)  # checksums that match: the NaN weights are still refused
    with pytest.raises(ValueError, match="non-finite"):
        load_model(d)
    proc = cli("generate", "--checkpoint", d, "--prefix", "3 7 / 3 7 =")
    assert "non-finite" in one_error_line(proc)
    (ck / CHECKSUMS).unlink()
    with pytest.raises(ValueError, match="no checksums.json"):
        train(tiny(d), resume=True)


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    from bst_fast.trainer import TrainingStopped

    d = tmp_path / "w"
    train(tiny(d), stop_at=3)
    real = torch.optim.AdamW.step

    def poison(self, *a, **k):
        out = real(self, *a, **k)
        with torch.no_grad():
            self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poison)
    with pytest.raises(TrainingStopped, match="step-00000003"):
        train(tiny(d, log_every=100, eval_every=0), resume=True)
    assert latest_checkpoint(d).name == "step-00000003"


def test_the_fused_finiteness_check_misses_nothing_and_accuses_nothing():
    # one fused norm over all tensors, then a value-by-value check only when a norm is not finite
    fine = {"a": torch.ones(3), "big": torch.full((100,), 1e30), "i": torch.arange(3), "h": torch.ones(5).half()}
    assert ckpt_mod.non_finite(fine) == [] and ckpt_mod.non_finite({}) == []  # 1e30: its float32 norm overflows
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for bad in (float("nan"), float("inf"), float("-inf")):
            for n, at in ((1, 0), (17, 16), (1000, 503)):
                t = torch.zeros(n, dtype=dtype)
                t[at] = bad
                assert ckpt_mod.non_finite({**fine, "x": t, "y": torch.ones(2)}) == ["x"], (dtype, bad, n)


def test_a_written_file_hashes_as_read(tmp_path):
    for size in (0, 1, 5 << 20):
        f = tmp_path / f"f{size}"
        f.write_bytes(os.urandom(size))
        start_writeback(f)  # the save's order: the disk starts writing, then the hash
        assert sha256_written(f) == sha256(f)


def test_optimizer_state_of_another_shape_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(tiny(a), stop_at=3)
    train(tiny(b, **{"model.head_hidden": 24}), stop_at=3)
    ck = latest_checkpoint(a)
    shutil.copy(latest_checkpoint(b) / "state.pt", ck / "state.pt")
    rehash(ck)
    with pytest.raises(ValueError, match="mismatched state.pt"):
        train(tiny(a), resume=True)


@pytest.mark.parametrize("name", ["../..", "/etc", "step-1", "."])
def test_latest_must_name_a_checkpoint_folder(tmp_path, name):
    d = tmp_path / "x"
    train(tiny(d), stop_at=3)
    (d / "checkpoints" / "latest").write_text(name)
    with pytest.raises(ValueError, match="must name a checkpoint folder"):
        train(tiny(d), resume=True)


def test_latest_as_a_directory_is_one_error_line(tmp_path):
    d = tmp_path / "x"
    train(tiny(d), stop_at=3)
    (d / "checkpoints" / "latest").unlink()
    (d / "checkpoints" / "latest").mkdir()
    one_error_line(cli("train", "--config", TINY, "--set", f"out_dir={d}", "--resume"))


# ---- 7. a checkpoint carries its tokenizer

def test_generate_uses_the_checkpoints_own_tokenizer(tmp_path):
    from bst_fast.__main__ import _TextCodec
    from bst_fast.data import load_tokenizer

    corpus = tmp_path / "a.txt"
    corpus.write_text("\n\n".join(f"the quick brown fox number {i} jumps" for i in range(60)))
    d = tmp_path / "run"
    train(tiny(d, data=str(corpus), text_vocab=300, max_len=32))
    copy = tmp_path / "copy"
    shutil.copytree(latest_checkpoint(d), copy)
    other = tmp_path / "b.txt"
    other.write_text("\n\n".join(f"zebra quagga okapi {i} xylophone" for i in range(60)))
    train(tiny(d, data=str(other), text_vocab=300, max_len=32), overwrite=True)  # the run folder moves on
    codec = _TextCodec(copy)
    assert codec.tok.to_str() == load_tokenizer(copy / "tokenizer.json").to_str()
    assert codec.tok.to_str() != load_tokenizer(d / "tokenizer.json").to_str()
    proc = cli("generate", "--checkpoint", copy, "--prefix", "the quick")
    assert proc.returncode == 0, proc.stderr
    assert "zebra" not in proc.stdout and "quagga" not in proc.stdout


# ---- 8. a YAML bomb

def test_a_yaml_bomb_is_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for k in range(1, 30):
        lines.append(f"a{k}: &a{k} [*a{k-1}, *a{k-1}, *a{k-1}, *a{k-1}, *a{k-1}, *a{k-1}, *a{k-1}, *a{k-1}]")
    lines.append("steps: *a29")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="aliases"):
        TrainConfig.load(bomb)
    assert time.perf_counter() - t0 < 5
    nested = tmp_path / "nested.yaml"  # few aliases, but a huge value: the message stays short
    nested.write_text('a: &a ["' + "x" * 10000 + '"]\nsteps: [*a, *a]')
    with pytest.raises(ValueError) as e:
        TrainConfig.load(nested)
    assert len(str(e.value)) < 600


# ---- 10. one clear line for every CLI failure

def test_cli_faults_are_one_line(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    one_error_line(cli("train", "--config", listed))
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    one_error_line(cli("train", "--config", TINY, "--set", f"out_dir={loop / 'x'}"))
    line = one_error_line(cli("train", "--config", TINY, "--set", f"out_dir={tmp_path / 'big'}",
                              "--set", "model.d_model=1000000000", "--set", "model.n_head=1"))
    assert len(line) < 2100
    bad_tok = tmp_path / "badtok"
    train(tiny(bad_tok), stop_at=3)
    (bad_tok / "checkpoints" / "latest").write_text("step-00000099")
    one_error_line(cli("generate", "--checkpoint", bad_tok, "--prefix", "1 2"))


def test_a_file_size_limit_is_one_line_and_resumable(tmp_path):
    d = tmp_path / "u"
    train(tiny(d), stop_at=3)
    code = (f"import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
            f"from bst_fast.__main__ import main; sys.exit(main(['train', '--config', {str(TINY)!r}, "
            f"'--set', 'out_dir={d}', '--resume']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = one_error_line(proc)
    assert "step-00000003 is intact" in line
    train(tiny(d), resume=True)
    assert latest_checkpoint(d).name == "step-00000006"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        one_error_line(cli("train", "--config", TINY, "--set", f"out_dir={ro / 'run'}"))
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("damage", ["\n\n", "7\n", "garbage,row\n"])
def test_a_damaged_metrics_file_does_not_stop_resume(tmp_path, damage):
    d = tmp_path / "m"
    train(tiny(d), stop_at=3)
    with (d / "metrics.csv").open("a") as fh:
        fh.write(damage)
    train(tiny(d), resume=True)
    rows = (d / "metrics.csv").read_text().splitlines()
    assert all(len(r.split(",")) == 3 for r in rows) and rows[-1].startswith("6,")


def test_a_finished_run_resumed_is_reported_and_exits_0(tmp_path):
    d = tmp_path / "done"
    first = train(tiny(d))
    again = train(tiny(d), resume=True)
    assert again["step"] == 6 and again["path_accuracy"] == pytest.approx(first["path_accuracy"])
    proc = cli("train", "--config", TINY, "--set", f"out_dir={d}", "--resume")
    assert proc.returncode == 0 and "nothing to train" in proc.stderr
    more = train(tiny(d, steps=8), resume=True)  # extending a run still works
    assert latest_checkpoint(d).name == "step-00000008" and "loss" in more


def test_sigkill_mid_run_resumes_bitwise_and_frees_the_lock(tmp_path, one_thread):
    """A run killed with SIGKILL at a random moment after its first checkpoint: the kernel frees the
    lock, no temporary folder survives the next start, and resume ends on the uninterrupted run's
    exact weights (every part on one thread, as the killed process ran)."""
    import random
    import signal

    opts = dict(steps=40, ckpt_every=3, keep_checkpoints=2, eval_every=0, log_every=2, pairs=0.5,
                **{"model.dropout": 0.1})
    full, cut = tmp_path / "full", tmp_path / "cut"
    train(tiny(full, **opts))
    sets = [a for k, v in opts.items() for a in ("--set", f"{k}={v}")]
    proc = subprocess.Popen([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set",
                             f"out_dir={cut}", *sets], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and not (cut / "checkpoints" / "latest").exists():
        time.sleep(0.02)
    time.sleep(random.uniform(0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = latest_checkpoint(cut)
    assert done is not None
    train(tiny(cut, **opts), resume=True)  # the dead process's lock does not block this
    assert not [p for p in (cut / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    a, _ = load_model(full)
    b, _ = load_model(cut)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---- 11. the adversarial review of issue 20: links, markers, protected folders, order of checks

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One finished tiny run; each test works on its own copy (`run_copy`)."""
    d = tmp_path_factory.mktemp("trained") / "run"
    train(tiny(d))
    return d


@pytest.fixture
def run_copy(trained, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(trained, d, symlinks=True)
    return d


def marked(d: Path, *files):
    """A folder with a valid marker (as a run's first start writes it) and user files `files`."""
    d.mkdir(parents=True, exist_ok=True)
    (d / MARKER).write_text(json.dumps({"format": 1, "run_id": "a"}))
    for name in files:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text("user")
    return d


@pytest.mark.parametrize("name", ["checkpoints", "tensorboard"])
@pytest.mark.parametrize("resume", [False, True])
def test_a_linked_run_folder_is_refused_and_its_target_kept(tmp_path, name, resume):
    foreign = tmp_path / "foreign"
    (foreign / "step-00000001").mkdir(parents=True)
    (foreign / "step-00000001" / "w.pt").write_text("precious")
    (foreign / ".mine.tmp").write_text("keep")
    (foreign / "events.out.tfevents.1.h").write_text("ev")
    d = marked(tmp_path / "r")
    (d / name).symlink_to(foreign)
    before = snapshot(foreign)
    with pytest.raises(ValueError, match="symbolic link"):
        train(tiny(d), overwrite=not resume, resume=resume)
    assert snapshot(foreign) == before


@pytest.mark.parametrize("where", ["out_dir", "parent"])
def test_a_link_to_nothing_on_the_way_is_refused_before_the_setup(tmp_path, where):
    """A dangling link as out_dir (or above it) was only found by claim's mkdir, after the model and
    the first batch were built: a bare FileExistsError then."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    out = link if where == "out_dir" else link / "run"
    with pytest.raises(ValueError, match=r"link is a symbolic link to nothing"):
        RunFolder(out).check(resume=False, overwrite=False)
    proc = cli("train", "--config", TINY, "--set", f"out_dir={out}")
    assert "symbolic link to nothing" in one_error_line(proc)
    assert not (tmp_path / "gone").exists()


def test_only_this_packages_temporary_files_are_cleaned_up(run_copy):
    d = run_copy
    user = [d / ".notes.tmp", d / ".cache.tmp" / "f", d / "checkpoints" / ".mine.tmp", d / ".metrics.csv.tmp"]
    for path in user:
        path.parent.mkdir(exist_ok=True)
        path.write_text("user")
    own = [d / ".metrics.csv.4242.tmp", d / f".{MARKER}.4242.tmp", d / "checkpoints" / ".latest.4242.tmp",
           d / "checkpoints" / ".step-00000009.4242.tmp"]
    for path in own:
        path.write_text("stale")
    train(tiny(d, steps=8), resume=True)
    assert all(p.read_text() == "user" for p in user)
    assert not any(p.exists() for p in own)


@pytest.mark.parametrize("marker", ["", "{{{", '{"format": 99, "run_id": "x"}', "[1]", '{"format": 1}',
                                    '{"format": true, "run_id": "x"}', '{"format": 1, "run_id": ""}'])
def test_a_bad_marker_makes_the_folder_foreign(tmp_path, marker):
    d = tmp_path / "f"
    d.mkdir()
    for name in ("tokenizer.json", "data.json"):
        (d / name).write_text("user")
    (d / MARKER).write_text(marker)
    before = snapshot(d)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=r"not a bst_fast run folder.*data\.json.*tokenizer\.json"):
            train(tiny(d), overwrite=overwrite)
    assert snapshot(d) == before


def test_a_run_stopped_before_its_first_checkpoint_is_started_over(tmp_path):
    """Both refusals pointed nowhere: a plain start said "resume it (--resume)", which then said only
    "no checkpoint" (review helper-105)."""
    d = tmp_path / "run"
    train(tiny(d, steps=1, eval_every=0, ckpt_every=0))
    shutil.rmtree(d / "checkpoints")  # as a run interrupted before its first checkpoint leaves it
    with pytest.raises(ValueError, match=r"already holds a run \(.*\): it has no checkpoint to resume \(it stopped "
                                         r"before its first\): start over in it \(--overwrite\)"):
        train(tiny(d, steps=1))
    with pytest.raises(ValueError, match=r"--resume: no checkpoint under .*stopped before its first checkpoint: "
                                         r"start it over with --overwrite"):
        train(tiny(d, steps=1), resume=True)
    train(tiny(d, steps=1, eval_every=0, ckpt_every=0), overwrite=True)


def test_a_new_run_over_any_run_file_needs_overwrite(tmp_path):
    d = marked(tmp_path / "m", "tokenizer.json", "data.json")
    with pytest.raises(ValueError, match=r"already holds a run \(tokenizer\.json, data\.json\)"):
        train(tiny(d))
    assert (d / "tokenizer.json").read_text() == "user" and (d / "data.json").read_text() == "user"
    train(tiny(d), overwrite=True)
    assert not (d / "tokenizer.json").exists()  # a star-graph run writes none


@pytest.mark.parametrize("where", ["home", "cwd"])
def test_home_and_current_folder_are_never_deleted_from(tmp_path, monkeypatch, where):
    d = marked(tmp_path / "H", "tokenizer.json", "data.json", "tensorboard/events.out.tfevents.1.h")
    (d / ".metrics.csv.4242.tmp").write_text("stale")  # even this package's own temporary file stays
    work = tmp_path / "wd"
    work.mkdir()
    monkeypatch.chdir(d if where == "cwd" else work)
    monkeypatch.setenv("HOME", str(d))
    out = "." if where == "cwd" else d
    before = snapshot(d)
    for overwrite in (False, True):
        with pytest.raises(ValueError, match=("current" if where == "cwd" else "home") + " folder, which is never"):
            train(tiny(out), overwrite=overwrite)
    assert snapshot(d) == before
    for name in ("tokenizer.json", "data.json", "tensorboard"):
        shutil.rmtree(d / name) if name == "tensorboard" else (d / name).unlink()
    train(tiny(out))  # nothing of a run there: a run may start, and deletes nothing of the folder's
    assert (d / ".metrics.csv.4242.tmp").read_text() == "stale"


def test_a_linked_lock_file_is_never_written_through(tmp_path):
    victim = tmp_path / "v.txt"
    victim.write_text("precious")
    d = tmp_path / "r"
    d.mkdir()
    (d / LOCK).symlink_to(victim)
    with pytest.raises(ValueError, match="symbolic link"):
        train(tiny(d))
    with pytest.raises(ValueError, match="symbolic link"):
        RunFolder(d).lock()
    assert victim.read_text() == "precious"


def test_a_hard_linked_lock_file_is_never_written_through(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    victim = tmp_path / "v.txt"
    victim.write_text("precious")
    os.link(victim, d / LOCK)  # someone's file linked in: replaced by the run's own, never written
    train(tiny(d))
    assert victim.read_text() == "precious" and victim.stat().st_nlink == 1
    assert (d / LOCK).stat().st_nlink == 1
    backup = tmp_path / "backup"
    subprocess.run(["cp", "-al", str(d), str(backup)], check=True)  # a hard-link snapshot of the run
    train(tiny(d, steps=8), resume=True)  # the original still resumes (a review found it refused)
    holder = RunFolder(d)
    holder.lock()
    with pytest.raises(ValueError, match=f"in use by another process \\(pid {os.getpid()}\\)"):
        RunFolder(d).lock()
    copy = RunFolder(backup)
    copy.lock()  # the copy locks apart from the original (a review found it refused, naming a dead pid)
    assert (backup / LOCK).read_text() == str(os.getpid()) and victim.read_text() == "precious"
    copy.unlock()
    holder.unlock()


def unprivileged(*args):
    """A command run as a user that file permissions apply to: as it is for a user other than root;
    for root, without the capabilities that bypass them (setpriv), or the test is skipped."""
    args = list(map(str, args))
    if os.geteuid() != 0:
        return args
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner,-linux_immutable"]
    try:
        dropped = subprocess.run([*drop, "true"], capture_output=True).returncode == 0
    except OSError:  # no setpriv
        dropped = False
    if not dropped:
        pytest.skip("root, and setpriv cannot drop the capabilities that bypass file permissions")
    return drop + args


def ex_holder(path: Path) -> int:
    """An exclusive flock on `path` through a read-only fd (this test may not write the file)."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_read_only_lock_file_is_replaced_unless_held(run_copy):
    """A lock file the run may not write (0444 from an archive, another user's 0644 in a shared
    folder), in a folder it can write: replaced by the folder's own, as a hard-linked one is (review:
    the run stopped on a PermissionError), but never while another process holds it."""
    d = run_copy
    (d / LOCK).write_text(str(os.getpid()))
    (d / LOCK).chmod(0o444)
    holder = ex_holder(d / LOCK)
    try:
        code = "import sys; from bst_fast.run_folder import RunFolder; RunFolder(sys.argv[1]).lock()"
        proc = subprocess.run(unprivileged(sys.executable, "-c", code, d), capture_output=True, text=True, timeout=300)
        assert f"in use by another process (pid {os.getpid()})" in proc.stderr, proc.stderr
    finally:
        os.close(holder)
    proc = subprocess.run(unprivileged(sys.executable, "-m", "bst_fast", "train", "--config", TINY, "--set",
                                       f"out_dir={d}", "--set", "steps=8", "--resume"),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert latest_checkpoint(d).name == "step-00000008"
    lock = d / LOCK
    assert lock.stat().st_mode & 0o200 and lock.stat().st_nlink == 1 and lock.read_text().isdigit()


def test_a_lock_file_nobody_may_open_is_a_clear_error_and_kept(run_copy):
    """A lock file of mode 000 (or 0200) in a writable folder: not replaced (a run that opened it before its
    mode changed may hold its lock still), but one error line naming the file and the fix (it was a
    bare PermissionError)."""
    d = run_copy
    (d / LOCK).write_text("123")
    (d / LOCK).chmod(0o000)
    proc = subprocess.run(unprivileged(sys.executable, "-m", "bst_fast", "train", "--config", TINY, "--set",
                                       f"out_dir={d}", "--set", "steps=8", "--resume"),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "the run's lock file) cannot be opened by this process" in proc.stderr \
        and "chmod 644" in proc.stderr, proc.stderr
    assert (d / LOCK).stat().st_mode & 0o777 == 0 and latest_checkpoint(d).name != "step-00000008"


def test_a_finished_run_in_a_read_only_folder_is_reported_and_exits_0(run_copy):
    """An archived run, read-only (review: its lock file was opened for writing: PermissionError, exit
    1): a finished run is reported under a shared lock, which still stops at, and stops, a run
    training there; training in it is one line saying the folder is not writable."""
    d = run_copy
    (d / LOCK).write_text(str(os.getpid()))
    before = snapshot(d)
    paths = [d, *d.rglob("*")]
    for p in paths:
        p.chmod(p.stat().st_mode & ~0o222)
    train_cmd = [sys.executable, "-m", "bst_fast", "train", "--config", TINY, "--set", f"out_dir={d}", "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(unprivileged(*train_cmd), capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0 and "nothing to train" in proc.stderr, proc.stderr
        proc = subprocess.run(unprivileged(*train_cmd, "--set", "steps=8"), capture_output=True, text=True,
                              timeout=300, env=env)
        assert f"out_dir {d} is not writable (cannot take its lock {LOCK})" in one_error_line(proc)
        holder = ex_holder(d / LOCK)  # a run training there: the report waits for it, naming it
        try:
            proc = subprocess.run(unprivileged(*train_cmd), capture_output=True, text=True, timeout=300, env=env)
            assert f"in use by another process (pid {os.getpid()})" in one_error_line(proc)
        finally:
            os.close(holder)
        code = ("import sys; from bst_fast.run_folder import RunFolder; f = RunFolder(sys.argv[1]); f.hold(); "
                "print(f.shared, flush=True); sys.stdin.read()")
        reader = subprocess.Popen(unprivileged(sys.executable, "-c", code, d), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert reader.stdout.readline().strip() == "True"
            with pytest.raises(ValueError, match="is being read by another process"):  # the reader stops a writer
                RunFolder(d).lock()
        finally:
            reader.communicate(timeout=60)
    finally:
        for p in paths:
            p.chmod(p.stat().st_mode | 0o200)
    assert snapshot(d) == before and (d / LOCK).read_text() == str(os.getpid())  # nothing written


def test_a_hard_linked_metrics_file_is_not_appended_to_on_resume(run_copy, tmp_path):
    d = run_copy
    twin = tmp_path / "twin.csv"
    os.link(d / "metrics.csv", twin)  # a `cp -al` backup of the run's metrics
    before = twin.read_text()
    train(tiny(d), resume=True, steps=8)
    assert twin.read_text() == before and (d / "metrics.csv").read_text() != before


@pytest.mark.parametrize("cut", ["rows", "file"])
def test_a_resume_over_lost_metrics_rows_says_so(run_copy, capsys, cut):
    d = run_copy  # logged at steps 2, 3, 4, 6 (log_every 2, eval and checkpoints every 3)
    train(tiny(d), resume=True, stop_at=8, steps=10)
    assert "warning" not in capsys.readouterr().err  # a resume over a whole log is quiet
    rows = (d / "metrics.csv").read_text().splitlines()
    if cut == "rows":  # the rows of step 4 deleted by hand
        (d / "metrics.csv").write_text("\n".join(r for r in rows if not r.startswith("4,")) + "\n")
    else:
        (d / "metrics.csv").unlink()
    train(tiny(d), resume=True, steps=10)
    err = capsys.readouterr().err
    assert f"holds rows for {4 if cut == 'rows' else 0} of the 5 steps the run logged up to step 8" in err
    steps = {int(r.split(",")[0]) for r in (d / "metrics.csv").read_text().splitlines()[1:]}
    assert steps == ({2, 3, 6, 8, 9, 10} if cut == "rows" else {9, 10})


@pytest.mark.parametrize("name,kind", [("metrics.csv", "dir"), ("tokenizer.json", "dir"), ("data.json", "dir"),
                                       ("checkpoints/latest", "dir"), ("tensorboard", "file"),
                                       ("checkpoints/step-00000006", "link"),
                                       ("metrics.csv", "link"), ("tokenizer.json", "link")])
def test_a_run_path_of_the_wrong_kind_is_refused_before_anything_is_deleted(run_copy, tmp_path, name, kind):
    d = run_copy
    target = d / name
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    if kind == "dir":
        target.mkdir()
    elif kind == "file":
        target.write_text("user")
    else:  # dangling: the run would create the file outside its folder
        target.symlink_to(tmp_path / "outside")
    before = snapshot(d)
    for resume in (False, True):
        with pytest.raises(ValueError, match="symbolic link" if kind == "link" else "where the run"):
            train(tiny(d), overwrite=not resume, resume=resume)
    assert snapshot(d) == before and not (tmp_path / "outside").exists()


def test_a_checkpoints_file_is_refused_before_anything_is_deleted(tmp_path):
    d = marked(tmp_path / "c", "checkpoints")
    (d / "metrics.csv").write_text("step,key,value\n3,loss,1.0\n")
    before = snapshot(d)
    with pytest.raises(ValueError, match="checkpoints is not a folder"):
        train(tiny(d), overwrite=True)
    assert snapshot(d) == before


def test_a_compile_that_fails_on_the_first_call_leaves_the_old_run(run_copy, monkeypatch):
    """torch.compile compiles at the first call (a missing C++ compiler shows there): the first batch,
    run before the folder is claimed, makes that call."""
    def compile_broken(module, *a, **k):
        def fail(*a, **k):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        module._compiled_call_impl = fail

    monkeypatch.setattr(torch.nn.Module, "compile", compile_broken)
    before = snapshot(run_copy)
    with pytest.raises(RuntimeError, match="InvalidCxxCompiler"):
        train(tiny(run_copy, compile=True, seed=3), overwrite=True)
    assert snapshot(run_copy) == before


def test_an_undeletable_old_run_is_refused_before_deleting(run_copy, monkeypatch):
    step = run_copy / "checkpoints" / "step-00000003"
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != step and real(p, mode, **k))
    before = snapshot(run_copy)
    with pytest.raises(ValueError, match=r"step-00000003 is not writable.*nothing was deleted"):
        train(tiny(run_copy, seed=3), overwrite=True)
    assert snapshot(run_copy) == before


def test_a_deletion_failing_halfway_names_the_full_path(run_copy, monkeypatch):
    """What the check cannot see (an immutable file in a writable folder) fails with its full path."""
    real = os.unlink

    def unlink(path, *a, **k):
        if os.fspath(path) == "model.safetensors":
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(OSError, match=r"could not delete \S*/checkpoints/step-0000000\d/model\.safetensors"):
        train(tiny(run_copy, seed=3), overwrite=True)


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_in_use_is_refused_before_a_checkpoint_is_read(run_copy, resume):
    """The holder may be pruning the checkpoint a second process would read: the second one stops on
    the lock, naming the holder, before it reads anything."""
    (latest_checkpoint(run_copy) / CHECKSUMS).unlink()  # as the holder's pruning leaves it, midway
    holder = RunFolder(run_copy)
    holder.lock()
    try:
        with pytest.raises(ValueError, match=rf"in use by another process \(pid {os.getpid()}\)"):
            train(tiny(run_copy), resume=resume)
    finally:
        holder.unlock()


def test_deep_nesting_in_set_is_bad_input(tmp_path, capsys):
    from bst_fast.__main__ import main

    deep = "[" * 50000 + "]" * 50000
    assert main(["train", "--config", str(TINY), "--set", f"out_dir={tmp_path / 'n'}", "--set", f"steps={deep}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --set 'steps'") and "\n" not in err and len(err) < 300


def test_table_out_is_checked_before_any_run_trains(tmp_path, capsys):
    from bst_fast.__main__ import main

    (tmp_path / "afile").write_text("f")
    out = tmp_path / "t"
    assert main(["table", "--config", str(TINY), "--set", f"out_dir={out}", "--out", str(tmp_path / "afile" / "x.md")]) == 2
    assert "afile" in capsys.readouterr().err and not out.exists()
    assert main(["table", "--config", str(TINY), "--set", f"out_dir={out}", "--out", str(tmp_path)]) == 2
    assert not out.exists()


def test_a_huge_prefix_is_quoted_cut(trained, capsys):
    from bst_fast.__main__ import main

    assert main(["generate", "--checkpoint", str(trained), "--prefix", "x" * 50000]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err) < 500


def test_a_star_run_of_an_older_version_that_set_text_fields_resumes(run_copy):
    """Older versions let a star config set max_len and text_vocab (never read): its checkpoints
    resume, although a config setting them is now refused."""
    d = run_copy
    ckpt = latest_checkpoint(d)
    saved = json.loads((ckpt / "config.json").read_text())
    saved.update(max_len=64, text_vocab=300)
    (ckpt / "config.json").write_text(json.dumps(saved))
    rehash(ckpt)
    train(tiny(d, steps=8), resume=True)
    assert latest_checkpoint(d).name == "step-00000008"
    with pytest.raises(ValueError, match="'max_len' must be its default 256 for star-graph data"):
        train(tiny(d, steps=10, max_len=64), resume=True)


def test_a_failed_lock_swap_leaves_nothing_behind(tmp_path, monkeypatch):
    """The swap of a hard-linked lock file for the folder's own: a failure there closes and deletes
    the replacement (review helper-41: it stayed, and an unmarked folder was then refused for it)."""
    d = tmp_path / "c"
    d.mkdir()
    os.link(tmp_path.joinpath("v.txt").write_text("x") and tmp_path / "v.txt", d / LOCK)

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(PermissionError):
        RunFolder(d).lock()
    assert sorted(p.name for p in d.iterdir()) == [LOCK]
    monkeypatch.undo()
    (d / f"{LOCK}.4242.tmp").write_text("")  # a killed process's replacement: not someone's file
    train(tiny(d))
    assert not (d / f"{LOCK}.4242.tmp").exists() and (tmp_path / "v.txt").read_text() == "x"


def _reader(folder: Path):
    """A process (without root's permission bypass) that holds `folder` as a finished run's report does
    (RunFolder.hold) and says whether its lock is the shared one; stop it with .kill()."""
    code = ("import sys, time; from bst_fast.run_folder import RunFolder; f = RunFolder(sys.argv[1]); f.hold(); "
            "print(f.lock_fd is not None, f.shared, flush=True); time.sleep(60)")
    proc = subprocess.Popen(unprivileged(sys.executable, "-c", code, folder), stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()


def test_a_read_only_hard_linked_copy_never_locks_its_original(tmp_path):
    """`cp -al run archive; chmod 555 archive`: both folders' lock files are one file. A report of the
    archive held a shared lock on it, so the original could not be locked (and a run training in the
    original kept the archive from being reported). The archive's report now takes no lock on a file
    with other names; one with one name still is locked shared, and a run starting meanwhile is told
    the folder is being read, not a stale pid."""
    base = tmp_path / "b"
    base.mkdir()
    base.chmod(0o755)
    run = base / "run"
    run.mkdir()
    (run / LOCK).write_text("12345")
    subprocess.run(["cp", "-al", str(run), str(base / "archive")], check=True)
    (base / "archive").chmod(0o555)
    reader, said = _reader(base / "archive")
    try:
        assert said == ["False", "False"], said  # no lock held on the shared file
        folder = RunFolder(run)
        folder.lock()  # the original locks while the archive is read
        folder.unlock()
    finally:
        reader.kill()
        reader.wait()
    alone = base / "alone"
    alone.mkdir()
    (alone / LOCK).write_text("12345")
    alone.chmod(0o555)
    reader, said = _reader(alone)
    try:
        assert said == ["True", "True"], said
        with pytest.raises(ValueError, match=r"is being read by another process \(a finished run reported"):
            RunFolder(alone).lock()  # root may write it: an exclusive attempt, refused without pid 12345
    finally:
        reader.kill()
        reader.wait()


@pytest.mark.parametrize("world, says", [("0", "got '0'"), ("abc", "got 'abc'"), (" 2", "got ' 2'"), ("٢", "got '٢'"),
                                         ("-1", "got '-1'")])
def test_a_bad_world_size_names_the_variable(tmp_path, monkeypatch, world, says):
    """WORLD_SIZE=0 was a ZeroDivisionError, 'abc' int()'s message naming no variable, '٢' (int()
    reads 2) a rendezvous that waited for a second process."""
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=f"environment variable WORLD_SIZE must be an int >= 1 .*{says}"):
        train(tiny(tmp_path, steps=1))
    assert not (tmp_path / "checkpoints").exists()


def test_ranks_are_checked_before_torch_distributed_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="WORLD_SIZE is 2, but RANK is not set"):
        train(tiny(tmp_path, steps=1))
    for rank in ("2", "x"):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match=f"environment variable RANK must be an int from 0 to 1 .*got '{rank}'"):
            train(tiny(tmp_path, steps=1))


def test_an_out_dir_no_folder_can_be_made_at_names_out_dir(tmp_path):
    """A NUL in out_dir was os's "embedded null byte"; /proc/x (a place mkdir refuses) its bare
    "[Errno 2]": both named no field."""
    with pytest.raises(ValueError, match="out_dir .* holds a NUL character"):
        train(tiny(str(tmp_path / "a") + "\0b", steps=1))
    if os.path.isdir("/proc/self"):
        for where in ("/proc/bst-fast-x", "/proc/self/bst-fast-x/y"):
            with pytest.raises(ValueError, match=f"out_dir {where} cannot be created"):
                train(tiny(where, steps=1))
    assert list(tmp_path.iterdir()) == []


def test_data_that_is_a_device_or_a_pipe_is_named_so(tmp_path, capsys):
    """data=/dev/null said "no such file or folder"; a named pipe would have blocked reading."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    for path, kind in (("/dev/null", "a character device"), (fifo, "a named pipe")):
        with pytest.raises(ValueError, match=f"data path {path} is {kind}, not a .txt file or a folder of them"):
            train(tiny(tmp_path / "run", steps=1, data=str(path), max_len=16))
    from bst_fast.__main__ import main

    assert main(["tokenize", "/dev/null", "--out", str(tmp_path / "p")]) == 2
    assert "data path /dev/null is a character device" in capsys.readouterr().err
