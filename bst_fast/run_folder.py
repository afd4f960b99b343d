"""bst_fast.run_folder: a run's folder, owned by the run, and its metrics log.

A folder becomes a run folder at the run's first start, when a marker file (.bst_fast_run.json:
the run id and the format version) is written. Only a marked folder is ever deleted from, and then
only the files a run writes (RUN_FILES, checkpoints named step-N, TensorBoard event files); a
folder with anything else in it and no marker is refused. While a run trains, it holds an
exclusive lock on the folder (flock on .bst_fast.lock, released by the kernel if the process
dies), so a second process on the same folder stops at once, naming the holder.
"""
from __future__ import annotations

import csv
import datetime
import fcntl
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from ._checks import short
from .checkpoint import BEST, checkpoint_step, latest_checkpoint, remove_stale
from .files import atomic_write

MARKER, LOCK = ".bst_fast_run.json", ".bst_fast.lock"
FORMAT = 1
METRICS = "metrics.csv"
# What a run writes at the top of its folder; checkpoints/ and tensorboard/ are emptied of their
# own kind of files only (step-N folders, `latest`; event files).
RUN_FILES = ("checkpoints", METRICS, "tensorboard", "tokenizer.json", "data.json")
STARTED = ("checkpoints", METRICS)  # a folder holding either has a run that trained


def _listing(path: Path, limit: int = 10) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _protected(path: Path) -> Optional[str]:
    """Why nothing may be deleted from `path`, or None: the working folder, the home folder and the
    root are never a run's own."""
    real = path.resolve()
    for name, place in (("the current folder", Path.cwd()), ("the home folder", Path.home()), ("the root folder", Path("/"))):
        try:
            if real == place.resolve():
                return name
        except OSError:
            continue
    return None


class RunFolder:
    """The out_dir of one run: `check` before anything is written, then `claim` (lock, clean, mark)."""

    def __init__(self, path):
        self.path = Path(path)
        self.lock_fd: Optional[int] = None

    @property
    def marked(self) -> bool:
        return (self.path / MARKER).is_file()

    def check(self, resume: bool, overwrite: bool) -> Optional[Path]:
        """The checkpoint a resumed run continues from (None for a new run). Changes nothing; raises
        a ValueError when the folder cannot take the run: a file on the way, a folder holding
        something other than a bst_fast run, a run there without --resume or --overwrite, --resume
        with nothing to resume, an overwrite of a folder that is never deleted from."""
        out = self.path
        try:
            # The nearest existing folder on the way must be a folder: a file there is an error by name.
            existing = next((p for p in (out, *out.parents) if p.exists()), None)
            if existing is not None and not existing.is_dir():
                raise ValueError(f"out_dir {out}: {existing} is a file, not a folder")
            if not out.exists():
                if resume:
                    raise ValueError(f"--resume: no checkpoint to resume: out_dir {out} does not exist")
                return None
            if not self.marked:
                foreign = [p for p in out.iterdir() if p.name != LOCK]
                if foreign:
                    raise ValueError(f"out_dir {out} is not a bst_fast run folder (no {MARKER}) and is not empty: it "
                                     f"holds {_listing(out)}; nothing there is deleted or written over: choose an "
                                     f"empty or new out_dir")
                if resume:
                    raise ValueError(f"--resume: no checkpoint to resume: out_dir {out} is empty")
                return None
            if resume:
                ckpt = latest_checkpoint(out)
                if ckpt is None:
                    raise ValueError(f"--resume: no checkpoint under {out / 'checkpoints'}")
                return ckpt
            held = [n for n in STARTED if (out / n).exists()]
            if held and not overwrite:
                raise ValueError(f"out_dir {out} already holds a run ({', '.join(held)}): resume it (--resume), "
                                 f"start over in it (--overwrite) or choose another out_dir")
            if held and _protected(out):
                raise ValueError(f"--overwrite: out_dir {out} is {_protected(out)}, which is never deleted from; "
                                 f"choose another out_dir")
            return None
        except OSError as e:  # a symlink loop, a folder without permission
            raise ValueError(f"out_dir {out} cannot be used: {e.strerror or e} ({short(str(e))})") from None

    def claim(self):
        """Takes the folder for this run: creates it and locks it (a second process stops here). Call
        `check` first and again after (another process may have changed the folder before the lock
        was taken), then `start`."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock()

    def start(self, new_run: bool):
        """After `claim` and a second `check`: a new run deletes an earlier run's files (only a marked
        folder's, and only its own kind of files) and writes a fresh marker; every run removes the
        temporary files of a killed save."""
        if new_run and self.marked:
            self.clear()
        remove_stale(self.path / "checkpoints")
        for path in self.path.glob(".*.tmp"):
            path.unlink(missing_ok=True) if not path.is_dir() else shutil.rmtree(path, ignore_errors=True)
        if new_run or not self.marked:
            marker = {"format": FORMAT, "run_id": uuid.uuid4().hex,
                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            atomic_write(self.path / MARKER, lambda p: p.write_text(json.dumps(marker, indent=1)))

    def clear(self):
        """Deletes the files a run writes, and nothing else (see the module docstring)."""
        out = self.path
        ckpts = out / "checkpoints"
        if ckpts.is_dir() and not ckpts.is_symlink():
            for path in ckpts.iterdir():
                ours = ((checkpoint_step(path) is not None or path.name == BEST) and path.is_dir()
                        and not path.is_symlink()) or \
                    path.name == "latest" or (path.name.startswith(".") and path.name.endswith(".tmp"))
                if ours:
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            _remove_if_empty(ckpts)
        tb = out / "tensorboard"
        if tb.is_dir() and not tb.is_symlink():
            for path in tb.glob("events.out.tfevents.*"):
                if path.is_file():
                    path.unlink()
            _remove_if_empty(tb)
        for name in (METRICS, "tokenizer.json", "data.json"):
            if (out / name).is_file() or (out / name).is_symlink():
                (out / name).unlink()

    def lock(self):
        """An exclusive lock on the folder for this process; a ValueError naming the holder's pid when
        another process holds it."""
        path = self.path / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ValueError(f"out_dir {self.path} is in use by another process (pid {holder}), which holds "
                             f"{path}: one run per folder at a time") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.lock_fd = fd

    def unlock(self):
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # closing releases the flock
            self.lock_fd = None


def _remove_if_empty(path: Path):
    try:
        path.rmdir()
    except OSError:
        pass  # something else is in there: it is not ours, so it stays


def read_metrics(path: Path) -> List[List[str]]:
    """The (step, key, value) rows of a metrics.csv; blank lines and damaged rows (a torn last line
    after a kill, a hand edit) are skipped with a warning rather than failing the run."""
    rows, damaged = [], 0
    with path.open(newline="") as fh:
        for k, row in enumerate(csv.reader(fh)):
            if k == 0 and row[:1] == ["step"]:
                continue
            if not row:
                continue
            try:
                int(row[0])
                float(row[2])
                ok = len(row) == 3
            except (ValueError, IndexError):
                ok = False
            if ok:
                rows.append(row)
            else:
                damaged += 1
    if damaged:
        print(f"warning: {path}: {damaged} damaged row(s) skipped", file=sys.stderr)
    return rows


def logged_at(out_dir: Path, step: int) -> Dict[str, float]:
    """The figures metrics.csv logged at `step` ({} when there are none)."""
    path = Path(out_dir) / METRICS
    if not path.is_file():
        return {}
    return {k: float(v) for s, k, v in read_metrics(path) if int(s) == step}


class MetricsLog:
    """metrics.csv (step, key, value rows) and, when installed, TensorBoard; rank 0 only."""

    def __init__(self, out_dir, enabled):
        self.enabled = enabled
        self.path = Path(out_dir) / METRICS
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def truncate(self, step):
        """Drop the rows after `step` (a resumed run logs them again) and any damaged row."""
        if self.enabled and self.path.exists():
            keep = [r for r in read_metrics(self.path) if int(r[0]) <= step]
            text = "step,key,value\n" + "".join(",".join(r) + "\n" for r in keep)
            atomic_write(self.path, lambda p: p.write_text(text))

    def log(self, step, row):
        if not self.enabled:
            return
        new = not self.path.exists()
        with self.path.open("a", newline="") as fh:
            w = csv.writer(fh)
            if new:
                w.writerow(["step", "key", "value"])
            for k, v in row.items():
                w.writerow([step, k, v])
        if self.tb is not None:
            for k, v in row.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        """Writes TensorBoard's buffered events (its writer thread would otherwise be left to the
        interpreter's exit)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
