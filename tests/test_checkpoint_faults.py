"""Checkpoint faults an adversarial review found beyond issue 20's first cases: non-finite optimizer
state is never saved, a state.pt of another step is refused, a `best` swap killed halfway is put
back, and a user's own `.x.tmp` beside the checkpoints is not ours to delete; a second review:
non-finite weights at a best save stop the run as at any save, a failed best swap puts the old
best back, and a checkpoint in place whose folder fails to sync is not called the previous one."""
import errno
import os
import re
import json
import shutil
from pathlib import Path

import pytest
import torch

from bst_fast import TrainConfig, train
from bst_fast import checkpoint
from bst_fast.checkpoint import (BEST, BEST_JSON, CHECKSUMS, CheckpointWriteError, latest_checkpoint, remove_stale,
                                 save_checkpoint)
from bst_fast.config import resolve_config
from bst_fast.files import sha256
from bst_fast.trainer import TrainingStopped, build_run
from _helpers import star_fields_for

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(out_dir, **changes):
    return resolve_config(TINY, out_dir=str(out_dir), **{**star_fields_for(changes.get("data", "star")), **changes})


def rehash(ckpt: Path):
    sums = {p.name: sha256(p) for p in ckpt.iterdir() if p.name != CHECKSUMS}
    (ckpt / CHECKSUMS).write_text(json.dumps(sums))


def test_non_finite_optimizer_state_is_never_saved(tmp_path, monkeypatch):
    """Weights stay finite, one AdamW moment turns infinite: the save refuses it, so the last
    checkpoint, the only one kept (keep_checkpoints=1), is the good one and still loads."""
    d = tmp_path / "o"
    train(tiny(d, keep_checkpoints=1), stop_at=3)
    real = torch.optim.AdamW.step

    def poison(self, *a, **k):
        out = real(self, *a, **k)
        next(iter(self.state.values()))["exp_avg_sq"].fill_(float("inf"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poison)
    with pytest.raises(TrainingStopped, match="non-finite optimizer state.*step-00000003"):
        train(tiny(d, keep_checkpoints=1, log_every=100, eval_every=0), resume=True, stop_at=6)
    monkeypatch.setattr(torch.optim.AdamW, "step", real)
    assert latest_checkpoint(d).name == "step-00000003"
    train(tiny(d, keep_checkpoints=1), resume=True, stop_at=6)  # the good one resumes
    assert latest_checkpoint(d).name == "step-00000006"


def test_a_state_of_another_step_is_refused(tmp_path):
    """state.pt copied from step 3 into step 6 with its checksums redone: the step it records is
    not the folder's, and the resume says so instead of training from a mix."""
    d = tmp_path / "s"
    train(tiny(d, keep_checkpoints=0), stop_at=6)
    ck3, ck6 = d / "checkpoints" / "step-00000003", d / "checkpoints" / "step-00000006"
    shutil.copy(ck3 / "state.pt", ck6 / "state.pt")
    rehash(ck6)
    with pytest.raises(ValueError, match="records step 3 in state.pt but is named for step 6"):
        train(tiny(d, keep_checkpoints=0), resume=True)


def test_a_best_swap_killed_halfway_is_put_back(tmp_path):
    """Killed between `best` -> .best-old.<pid>.tmp and the new best's rename: the next start puts
    the old best back (the resumed run evaluates the newer step again) and drops the half-swapped new one."""
    root = tmp_path / "checkpoints"
    old, new = root / ".best-old.4242.tmp", root / ".best.4242.tmp"
    for folder, step in ((old, 3), (new, 6)):
        folder.mkdir(parents=True)
        (folder / BEST_JSON).write_text(json.dumps({"metric": "path_accuracy", "value": 0.5, "step": step}))
    remove_stale(root)
    assert json.loads((root / BEST / BEST_JSON).read_text())["step"] == 3
    assert sorted(p.name for p in root.iterdir()) == [BEST]


def test_only_save_checkpoints_own_temporary_names_are_removed(tmp_path):
    root = tmp_path / "checkpoints"
    ours = [root / ".step-00000009.77.tmp", root / ".latest.77.tmp", root / ".best.77.tmp"]
    theirs = [root / ".mywork.tmp", root / ".step-9.77.tmp", root / ".latest.tmp", root / "notes.tmp"]
    root.mkdir()
    for p in ours + theirs:
        p.mkdir() if p.name.startswith(".step") or p.name == ".mywork.tmp" else p.write_text("x")
    remove_stale(root)
    assert not any(p.exists() for p in ours) and all(p.exists() for p in theirs)


def test_non_finite_weights_at_a_best_save_stop_the_run(tmp_path, monkeypatch):
    """A weight turned infinite by the step whose evaluation is the best so far: the best save
    refuses it as the regular save does, TrainingStopped naming the last good checkpoint (a bare
    NonFiniteWeights escaped before, which the CLI reports as bad input)."""
    import bst_fast.trainer as trainer

    d = tmp_path / "b"
    opts = dict(keep_best="path_accuracy", eval_every=3, ckpt_every=3)
    train(tiny(d, **opts), stop_at=3)
    real = trainer.train_step

    def poisoned(run, step):
        loss = real(run, step)
        if step == 5:  # after the update: the step's own loss is finite
            with torch.no_grad():
                next(run.model.parameters()).view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(trainer, "train_step", poisoned)
    monkeypatch.setattr(trainer, "best_so_far", lambda *a: None)  # whatever it scores, it is the best
    with pytest.raises(TrainingStopped, match="non-finite values.*last good checkpoint is .*step-00000003"):
        train(tiny(d, **opts), resume=True, stop_at=6)
    assert json.loads((d / "checkpoints" / BEST / BEST_JSON).read_text())["step"] == 3


def _failing(monkeypatch, module_attr, when):
    """module_attr (checkpoint.os.replace or checkpoint.fsync) raising EIO/ENOSPC where when(args)."""
    obj, name = module_attr
    real = getattr(obj, name)

    def fake(*args):
        if when(*args):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)
    monkeypatch.setattr(obj, name, fake)


def test_a_failed_best_swap_puts_the_old_best_back(tmp_path, monkeypatch):
    run = build_run(tiny(tmp_path).check(), "cpu")
    args = (run.model, run.optimizer, run.scheduler, run.cfg, 0)
    save_checkpoint(tmp_path, 1, *args, best={"metric": "path_accuracy", "value": 0.1, "step": 1})
    _failing(monkeypatch, (checkpoint.os, "replace"),
             lambda a, b: Path(a).name.startswith(".best.") and Path(b).name == BEST)
    with pytest.raises(CheckpointWriteError, match=r"best checkpoint of step 2 .*the previous best checkpoint "
                                                   r".*checkpoints/best is intact"):
        save_checkpoint(tmp_path, 2, *args, best={"metric": "path_accuracy", "value": 0.2, "step": 2})
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [BEST]
    assert json.loads((root / BEST / BEST_JSON).read_text())["step"] == 1
    # the swap and its undoing both failing: the message names where the old best is kept (not "no
    # earlier best"), with the first failure as the cause; the next start puts it back
    _failing(monkeypatch, (checkpoint.os, "replace"), lambda a, b: Path(b).name == BEST)
    with pytest.raises(CheckpointWriteError, match=r"of step 3 .*the disk is full.*the previous best checkpoint is kept "
                                                   r"as .*\.best-old\.[0-9]+\.tmp, and the run's next start puts it back"):
        save_checkpoint(tmp_path, 3, *args, best={"metric": "path_accuracy", "value": 0.3, "step": 3})
    monkeypatch.undo()
    remove_stale(root)
    assert json.loads((root / BEST / BEST_JSON).read_text())["step"] == 1


def test_a_checkpoint_in_place_whose_folder_fails_to_sync_is_named_as_such(tmp_path, monkeypatch):
    """`latest` already names step 6 when checkpoints/'s fsync fails: the error says that step is in
    place, not that it failed and that it is "the previous checkpoint"."""
    d = tmp_path / "f"
    train(tiny(d), stop_at=3)
    calls = []
    _failing(monkeypatch, (checkpoint, "fsync"),
             lambda p: Path(p).name == "checkpoints" and calls.append(p) is None and len(calls) == 1)
    with pytest.raises(CheckpointWriteError, match=r"step 6, .*step-00000006, is written and in place, but its "
                                                   r"folder .* could not be synced"):
        train(tiny(d), resume=True, stop_at=6)
    assert latest_checkpoint(d).name == "step-00000006"


@pytest.mark.parametrize("name, damage", [("tokenizer.json", lambda t: t[:-50]),
                                          ("data.json", lambda t: t.replace('"documents": 40', '"documents": 30'))])
def test_a_damaged_task_file_in_a_checkpoint_is_named_corrupt(tmp_path, name, damage):
    """A text run's resume read the checkpoint's tokenizer.json and data.json before the checksums:
    a damaged one was reported as a bad tokenizer file, or as another corpus ("the corpus ... is not
    the one this run was trained on"), not as a corrupt checkpoint."""
    (tmp_path / "c.txt").write_text("\n\n".join(f"the cat {k} sat on the mat and ran" for k in range(40)))
    d = tmp_path / "t"
    cfg = tiny(d, data=str(tmp_path / "c.txt"), text_vocab=270, max_len=16)
    train(cfg, stop_at=2)
    file = latest_checkpoint(d) / name
    damaged = damage(file.read_text())
    assert damaged != file.read_text()
    file.write_text(damaged)
    with pytest.raises(ValueError, match=rf"step-00000002 is corrupt: {name} does not match its sha256"):
        train(cfg, resume=True)


class _Killed(BaseException):
    pass


def _scripted_accuracy(monkeypatch, figures, crash_at=None):
    """Evaluations score figures[step] (0 elsewhere); with crash_at, the run dies right after that
    step, before its row, evaluation or checkpoint (a kill)."""
    from bst_fast import tasks, trainer

    now = {"step": 0}
    close = getattr(trainer._close_interval, "__wrapped__", trainer._close_interval)  # not an earlier script

    def closing(run, done, end, lr):
        now["step"] = done
        if done == crash_at:
            raise _Killed
        return close(run, done, end, lr)

    closing.__wrapped__ = close
    monkeypatch.setattr(trainer, "_close_interval", closing)
    monkeypatch.setattr(tasks.StarTask, "evaluate", lambda self, *a, **k: {"path_accuracy": figures.get(now["step"], 0.0)})


@pytest.mark.parametrize("change, kept", [({"eval_every": 3}, True), ({"model.activation_checkpointing": True}, True),
                                          ({"steps": 14}, False)])
def test_a_best_saved_after_the_resumed_step_is_kept_on_the_same_trajectory(tmp_path, monkeypatch, change, kept):
    """A run evaluated 0.9 at step 8 (its best), was killed at step 9 and resumed from step 6. A
    best saved after the resumed step was always dropped, so the first evaluation after the resume
    (0.2 at step 9) replaced the 0.9 of this very trajectory. It is kept now when the resumed run
    retraces it (a changed eval_every, activation checkpointing switched on: the same numbers), and
    still dropped when a change (steps) makes another."""
    d = tmp_path / "run"
    opts = dict(steps=12, ckpt_every=6, eval_every=2, keep_best="path_accuracy")
    figures = {2: 0.5, 8: 0.9, 9: 0.2, 12: 0.3, 14: 0.3}
    _scripted_accuracy(monkeypatch, figures, crash_at=9)
    with pytest.raises(_Killed):
        train(tiny(d, **opts))
    best = d / "checkpoints" / BEST / BEST_JSON
    assert json.loads(best.read_text())["step"] == 8 and latest_checkpoint(d).name == "step-00000006"
    # made by one rank: a resume under another number of ranks sums its batches in another order
    assert json.loads(best.read_text())["world"] == 1
    saved = json.loads((d / "checkpoints" / "step-00000006" / "config.json").read_text())
    for key, value in change.items():  # a model field into the saved model's mapping
        parent, _, leaf = key.partition(".")
        saved.update({parent: {**saved[parent], leaf: value}} if leaf else {key: value})
    resumed = TrainConfig.from_dict(saved)  # as the trainer has it: the data's model fields set
    assert checkpoint.best_so_far(d, "path_accuracy", 6, resumed, world=2) is None
    assert checkpoint.best_so_far(d, "path_accuracy", 6, resumed, world=1) == (0.9 if kept else None)
    # step 8 scores 0.1 if evaluated again: only a dropped best lets it (and then 0.3) replace the 0.9
    _scripted_accuracy(monkeypatch, {**figures, 8: 0.1, 10: 0.1})
    train(tiny(d, **{**opts, **change}), resume=True)
    assert json.loads(best.read_text())["value"] == (0.9 if kept else 0.3)


def test_a_damaged_best_json_is_named_and_replaced(tmp_path, monkeypatch, capfd):
    """best.json was read without its checksum: a one-bit flip ("value": 0.0 -> 8.0) became a best
    no evaluation could beat, silently. It is named on stderr and the next evaluation replaces it."""
    d = tmp_path / "run"
    opts = dict(steps=8, ckpt_every=2, eval_every=2, keep_best="path_accuracy")
    _scripted_accuracy(monkeypatch, {2: 0.25, 4: 0.125, 6: 0.0625, 8: 0.03125})
    train(tiny(d, **opts), stop_at=4)
    best = d / "checkpoints" / BEST / BEST_JSON
    assert json.loads(best.read_text())["value"] == 0.25
    best.write_text(best.read_text().replace('"value": 0.25', '"value": 8.25'))
    capfd.readouterr()
    train(tiny(d, **opts), resume=True)
    assert re.search(r"best checkpoint .* damaged best\.json .*checksums\.json", capfd.readouterr().err)
    saved = json.loads(best.read_text())
    assert (saved["step"], saved["value"]) == (6, 0.0625)


def test_a_first_checkpoint_without_latest_is_resumed(tmp_path):
    """A kill between the first checkpoint's rename into place and the first write of `latest` left
    a complete step-N folder that --resume called "no checkpoint" while a plain start called the
    folder a run to resume. The newest complete step-N folder is the latest one now."""
    d = tmp_path / "run"
    train(tiny(d), stop_at=3)
    (d / "checkpoints" / "latest").unlink()
    (d / "checkpoints" / "step-00000009").mkdir()  # no checksums.json: never a complete checkpoint
    assert latest_checkpoint(d) == d / "checkpoints" / "step-00000003"
    shutil.rmtree(d / "checkpoints" / "step-00000009")
    train(tiny(d), resume=True)
    whole = tmp_path / "whole"
    train(tiny(whole))
    got, want = (latest_checkpoint(p) for p in (d, whole))
    assert got.name == want.name == "step-00000006"
    assert sha256(got / "model.safetensors") == sha256(want / "model.safetensors")  # resumed bitwise


@pytest.mark.parametrize("damage, why", [("fp16", r"dtype mismatch \[\('forward_encoder.tok.weight', 'torch.float16', 'torch.float32'\)"),
                                         ("log", r"corrupt state.pt: its open logging interval must be None or")])
def test_a_rehashed_checkpoint_of_another_dtype_or_a_bad_log_is_refused(tmp_path, damage, why):
    """Checksums catch damage, not a file rewritten with its checksums: float16 weights were cast to
    the model's float32 silently, and a malformed open logging interval was a raw TypeError deep in
    the trainer. Both are refused, naming the checkpoint."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "run"
    train(tiny(d), stop_at=4)
    ckpt = latest_checkpoint(d)
    if damage == "fp16":
        weights = load_file(str(ckpt / "model.safetensors"))
        save_file({k: v.half() for k, v in weights.items()}, str(ckpt / "model.safetensors"))
    else:
        state = torch.load(ckpt / "state.pt", weights_only=True)
        state["log"] = {"loss_sum": "x", "n": -5}
        torch.save(state, ckpt / "state.pt")
    rehash(ckpt)
    with pytest.raises(ValueError, match=rf"checkpoint .*step-00000004 .*{why}"):
        train(tiny(d), resume=True)


def test_a_first_checkpoint_whose_latest_cannot_be_written_is_named_as_in_place(tmp_path, monkeypatch):
    """The first checkpoint in place, its `latest` not written (disk full): since latest_checkpoint
    finds such a checkpoint, the error called it "the previous checkpoint ... intact", the very one
    it could not write. It says the checkpoint is in place and a resume takes it, which one does."""
    d = tmp_path / "run"
    real = checkpoint.atomic_write

    def failing(path, write):
        if Path(path).name == "latest":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(checkpoint, "atomic_write", failing)
    with pytest.raises(CheckpointWriteError, match=r"step-00000002, is complete and in place, but .*latest could "
                                                   r"not be written \(the disk is full.*a resume takes that checkpoint"):
        train(tiny(d), stop_at=2)
    monkeypatch.setattr(checkpoint, "atomic_write", real)
    train(tiny(d), resume=True, stop_at=3)
    assert latest_checkpoint(d).name == "step-00000003"


@pytest.mark.parametrize("name", ["tokenizer.json", "data.json"])
def test_a_text_file_the_checksums_do_not_list_is_refused(tmp_path, name):
    """A resume reads a checkpoint's tokenizer.json and data.json when present; one that
    checksums.json does not list was added or replaced by hand and must not be read unchecked
    (the whole-checkpoint verify a resume now runs once missed it: review of fixer-D's change)."""
    from bst_fast.files import sha256

    for f in ("model.safetensors", "state.pt", "config.json"):
        (tmp_path / f).write_text(f)
    sums = {f: sha256(tmp_path / f) for f in ("model.safetensors", "state.pt", "config.json")}
    (tmp_path / CHECKSUMS).write_text(json.dumps(sums))
    checkpoint.verify(tmp_path)  # the three listed files alone: a star run's checkpoint
    (tmp_path / name).write_text("{}")
    with pytest.raises(ValueError, match=f"holds {re.escape(name)}, which its checksums.json does not list"):
        checkpoint.verify(tmp_path)
    (tmp_path / CHECKSUMS).write_text(json.dumps({**sums, name: sha256(tmp_path / name)}))
    checkpoint.verify(tmp_path)
