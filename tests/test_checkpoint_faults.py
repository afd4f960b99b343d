"""Checkpoint faults an adversarial review found beyond issue 20's first cases: non-finite optimizer
state is never saved, a state.pt of another step is refused, a `best` swap killed halfway is put
back, and a user's own `.x.tmp` beside the checkpoints is not ours to delete."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from bst_fast import train
from bst_fast.checkpoint import BEST, BEST_JSON, CHECKSUMS, latest_checkpoint, remove_stale
from bst_fast.config import resolve_config
from bst_fast.files import sha256
from bst_fast.trainer import TrainingStopped

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(out_dir, **changes):
    return resolve_config(TINY, out_dir=str(out_dir), **changes)


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
