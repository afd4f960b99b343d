"""bst_fast.run_folder: a run's folder, owned by the run, and its metrics log.

A folder becomes a run folder at the run's first start, when a marker file (.bst_fast_run.json:
a JSON object with the run id and the format version) is written. Only a folder with a valid marker
is ever deleted from, and then only the files a run writes (RUN_FILES, checkpoints named step-N,
TensorBoard event files, this package's own temporary files); a folder with anything else in it and
no valid marker is refused. A run's own files and folders must be what the run makes of them
(regular files, real folders: never symbolic links, which would make the run write or delete where
they point). While a run trains, it holds an exclusive lock on the folder (flock on .bst_fast.lock,
released by the kernel if the process dies), so a second process on the same folder stops at once,
naming the holder.
"""
from __future__ import annotations

import contextlib
import csv
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from ._checks import short
from .checkpoint import BEST, OWN_TEMPORARY, checkpoint_step, latest_checkpoint, remove_stale
from .files import atomic_write, out_of_room

MARKER, LOCK = ".bst_fast_run.json", ".bst_fast.lock"
FORMAT = 1
METRICS = "metrics.csv"
FOLDERS = ("checkpoints", "tensorboard")  # the run's folders, emptied of their own kind of files only
FILES = (METRICS, "tokenizer.json", "data.json")  # the run's files at the top of its folder
# What a run writes at the top of its folder; a new run in a folder holding any of them needs --overwrite.
RUN_FILES = FOLDERS + FILES
# files.temporary_name's names, `.<name>.<pid>.tmp` (the rule lives in files.py; this is the same rule
# as a pattern, as checkpoint.OWN_TEMPORARY is in checkpoints/): only those of the names this
# package writes are ever cleaned up, never a user's own `.something.tmp`.
TOP_TEMPORARY = re.compile(r"\.(" + "|".join(map(re.escape, (MARKER, *FILES))) + r")\.[0-9]+\.tmp")
LOCK_TEMPORARY = re.compile(re.escape(LOCK) + r"\.[0-9]+\.tmp")  # lock(): a hard-linked lock's replacement


def _cut(value, limit: int = 200) -> str:
    """A path or a name quoted in a message, cut to `limit` characters (its head and its tail)."""
    text = str(value)
    return text if len(text) <= limit else text[:limit // 2] + "..." + text[-(limit // 2):]


def _listing(path: Path, limit: int = 10) -> str:
    names = sorted(_cut(p.name, 60) + ("/" if p.is_dir() else "") for p in path.iterdir())
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
        except (OSError, RuntimeError):  # no home folder, a loop
            continue
    return None


def _kind_fault(path: Path, folder: bool) -> Optional[str]:
    """What is wrong with a run's own file or folder `path`, or None when it is absent or of its
    kind: a symbolic link (even a dangling one) would make the run write or delete where it points."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return (f"{_cut(path)} is a symbolic link; a run's own files and folders are never links (the run would "
                f"write or delete where it points): remove the link or choose another out_dir")
    if folder and not stat.S_ISDIR(mode):
        return (f"{_cut(path)} is not a folder, where the run keeps its {path.name}: move it away or choose "
                f"another out_dir")
    if not folder and not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        return f"{_cut(path)} is {what}, where the run writes a file: move it away or choose another out_dir"
    return None


def marker_fault(folder: Path) -> Optional[str]:
    """Why `folder`'s marker does not make it a run folder ("no marker" included), or None when it
    does: a regular file holding a JSON object of a known format with a run id."""
    path = Path(folder) / MARKER
    fault = _kind_fault(path, folder=False)
    if fault:
        return fault
    if not path.exists():
        return f"no {MARKER}"
    try:
        with path.open("rb") as fh:
            data = json.loads(fh.read(65536))
    except (OSError, ValueError) as e:  # unreadable, not JSON, not UTF-8
        return f"its {MARKER} is not a bst_fast marker ({type(e).__name__})"
    if not isinstance(data, dict) or data.get("format") != FORMAT or isinstance(data.get("format"), bool) \
            or not isinstance(data.get("run_id"), str) or not data["run_id"]:
        return f"its {MARKER} is not a bst_fast marker of format {FORMAT} with a run id"
    return None


class RunFolder:
    """The out_dir of one run: `hold` (lock a folder that exists), `check` before anything is
    written, then `claim` (create, lock) and `start` (clean, mark)."""

    def __init__(self, path):
        self.path = Path(path)
        self.lock_fd: Optional[int] = None
        self.shared = False  # lock_fd's lock is hold()'s shared one, in a folder this process cannot write

    @property
    def marked(self) -> bool:
        return marker_fault(self.path) is None

    def check(self, resume: bool, overwrite: bool) -> Optional[Path]:
        """The checkpoint a resumed run continues from (None for a new run). Changes nothing; raises
        a ValueError when the folder cannot take the run: a file on the way, a folder holding
        something other than a bst_fast run, a run file of the wrong kind (a link, a folder for a
        file), a run there without --resume or --overwrite, --resume with nothing to resume, an
        overwrite of a folder that is never deleted from or of files that cannot be deleted."""
        out = self.path
        if "\0" in str(out):  # os calls refuse it with "embedded null byte", naming nothing
            raise ValueError(f"out_dir {short(str(out))} holds a NUL character, which no path can hold")
        try:
            # The nearest existing folder on the way must be a folder: a file there is an error by name,
            # and so is a link that leads nowhere (claim's mkdir would fail on it after the setup).
            existing = next((p for p in (out, *out.parents) if os.path.lexists(p)), None)
            if existing is not None and not existing.exists():
                raise ValueError(f"out_dir {_cut(out)}: {_cut(existing)} is a symbolic link to nothing (its target "
                                 f"is missing, or the links loop)")
            if existing is not None and not existing.is_dir():
                raise ValueError(f"out_dir {_cut(out)}: {_cut(existing)} is a file, not a folder")
            if not out.exists():
                if resume:
                    raise ValueError(f"--resume: no checkpoint to resume: out_dir {_cut(out)} does not exist")
                if existing is not None and not os.access(existing, os.W_OK | os.X_OK):  # claim's mkdir would fail
                    raise ValueError(f"out_dir {_cut(out)} cannot be created: {_cut(existing)} is not writable")
                return None
            fault = _kind_fault(out / LOCK, folder=False)
            if fault:
                raise ValueError(fault)
            fault = marker_fault(out)
            if fault:
                foreign = [p for p in out.iterdir() if p.name != LOCK and not LOCK_TEMPORARY.fullmatch(p.name)]
                if foreign:
                    raise ValueError(f"out_dir {_cut(out)} is not a bst_fast run folder ({fault}) and is not empty: "
                                     f"it holds {_listing(out)}; nothing there is deleted or written over: choose "
                                     f"an empty or new out_dir")
                if resume:
                    raise ValueError(f"--resume: no checkpoint to resume: out_dir {_cut(out)} is empty")
                return None
            for name in RUN_FILES:
                fault = _kind_fault(out / name, folder=name in FOLDERS)
                if fault:
                    raise ValueError(fault)
            ckpts = out / "checkpoints"
            # checkpoints/' own names: `latest` a file, step-N and best real folders (a link there
            # would be resumed from, saved over or pruned through)
            for path in (ckpts.iterdir() if ckpts.is_dir() else ()):
                if path.name == "latest" or checkpoint_step(path) is not None or path.name == BEST:
                    fault = _kind_fault(path, folder=path.name != "latest")
                    if fault:
                        raise ValueError(fault)
            held = [n for n in RUN_FILES if os.path.lexists(out / n)]
            if resume:
                ckpt = latest_checkpoint(out)
                if ckpt is None:
                    why = (f" (the run there, {', '.join(held)}, stopped before its first checkpoint: start it over with "
                           f"--overwrite)") if held else ""
                    raise ValueError(f"--resume: no checkpoint under {_cut(out / 'checkpoints')}{why}")
                return ckpt
            if held and _protected(out):
                raise ValueError(f"out_dir {_cut(out)} is {_protected(out)}, which is never deleted from, and holds a "
                                 f"run ({', '.join(held)}): resume it (--resume) or choose another out_dir")
            if held and not overwrite:
                try:
                    resumable = latest_checkpoint(out) is not None
                except (OSError, ValueError):  # a damaged one: --resume says what is wrong with it
                    resumable = True
                first = ("resume it (--resume), " if resumable else
                         "it has no checkpoint to resume (it stopped before its first): ")
                raise ValueError(f"out_dir {_cut(out)} already holds a run ({', '.join(held)}): {first}"
                                 f"start over in it (--overwrite) or choose another out_dir")
            # Every folder something is deleted in (a step folder's subfolders too) must let it go:
            # a permission found halfway would leave the old run half deleted.
            doomed = self._doomed()
            places = {p.parent for p in doomed}
            for p in doomed:
                if p.is_dir() and not p.is_symlink():
                    places.update(Path(root) for root, _, _ in os.walk(p))
            for place in sorted(places):
                if not os.access(place, os.W_OK | os.X_OK):
                    raise ValueError(f"--overwrite: {_cut(place)} is not writable, so the old run's files there "
                                     f"cannot be deleted; nothing was deleted: fix its permissions or choose another "
                                     f"out_dir")
            return None
        except OSError as e:  # a symlink loop, a folder without permission
            raise ValueError(f"out_dir {_cut(out)} cannot be used: {e.strerror or type(e).__name__} "
                             f"({short(str(e))})") from None

    def hold(self):
        """Locks a folder that already has a lock file, before anything in it is read: a second process
        on a folder a run trains in stops here, naming the holder, rather than reading checkpoints the
        holder is writing and pruning. (A folder without a lock file has no run holding it; `claim`
        creates and locks it.) In a folder this process cannot write (an archived run), a lock file it
        cannot write is locked shared: a reader that still stops at a run training there, and stops
        one, so that a finished run is reported; `claim` then needs the exclusive lock."""
        if self.lock_fd is None and self.path.is_dir() and os.path.lexists(self.path / LOCK):
            self.lock(shared_ok=True)

    def claim(self):
        """Takes the folder for this run: creates it and locks it (a second process stops here). Call
        `check` first and again after (another process may have changed the folder before the lock
        was taken), then `start`."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a place no folder can be made in (/proc, a read-only mount) that check cannot see
            raise ValueError(f"out_dir {_cut(self.path)} cannot be created: {e.strerror or type(e).__name__} "
                             f"({short(str(e))})") from None
        if self.lock_fd is None or self.shared:
            self.unlock()  # hold's shared lock lets others read, not this process write
            self.lock()

    def start(self, new_run: bool):
        """After `claim` and a second `check`: a new run deletes an earlier run's files (only a marked
        folder's, and only its own kind of files) and writes a fresh marker; every run removes the
        temporary files of a killed save."""
        if new_run and self.marked:
            self.clear()
        self._remove_temporaries()
        if new_run or not self.marked:
            marker = {"format": FORMAT, "run_id": uuid.uuid4().hex,
                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
            atomic_write(self.path / MARKER, lambda p: p.write_text(json.dumps(marker, indent=1)))

    def _remove_temporaries(self):
        """The temporary files of a killed save (their process is gone: this one holds the lock), by
        their exact names. Never at the top of a folder that is never deleted from."""
        remove_stale(self.path / "checkpoints")  # puts back a best whose swap was killed halfway
        if not _protected(self.path):
            for path in self.path.iterdir():
                if TOP_TEMPORARY.fullmatch(path.name) or LOCK_TEMPORARY.fullmatch(path.name):
                    _delete(path)

    def _doomed(self) -> List[Path]:
        """What `clear` deletes: the files a run writes, and nothing else (see the module docstring)."""
        out, doomed = self.path, []
        ckpts = out / "checkpoints"
        if ckpts.is_dir() and not ckpts.is_symlink():
            for path in ckpts.iterdir():
                real_dir = path.is_dir() and not path.is_symlink()
                if ((checkpoint_step(path) is not None or path.name == BEST) and real_dir) or \
                        (path.name == "latest" and not real_dir) or OWN_TEMPORARY.fullmatch(path.name):
                    doomed.append(path)
        tb = out / "tensorboard"
        if tb.is_dir() and not tb.is_symlink():
            doomed += [p for p in tb.glob("events.out.tfevents.*") if p.is_file() and not p.is_symlink()]
        doomed += [out / name for name in FILES if (out / name).is_file() and not (out / name).is_symlink()]
        return doomed

    def clear(self):
        """Deletes the files a run writes, and nothing else (see the module docstring); then the run's
        folders if that left them empty."""
        for path in self._doomed():
            _delete(path)
        for name in FOLDERS:
            if not (self.path / name).is_symlink():
                _remove_if_empty(self.path / name)

    def lock(self, shared_ok: bool = False):
        """An exclusive lock on the folder for this process (`shared_ok`: hold's shared one in a folder
        this process cannot write); a ValueError naming the holder's pid when another process holds
        it. The lock file is opened without following a link and must be a regular file. One with
        other names (a hard link: `cp -al` of a run folder, or someone's file linked in) or one this
        process may not write (read-only from an archive, another user's) is replaced, under its
        lock, by a file of this folder's own, so that the pid is never written into another name and
        a copied folder locks apart from this one; a lock taken on a file that was replaced meanwhile
        is let go and taken again on the one now in place. In a folder this process cannot write, a
        lock that cannot be taken is a ValueError saying so (not a bare PermissionError)."""
        try:
            self._lock(shared_ok)
        except OSError as e:
            if os.access(self.path, os.W_OK | os.X_OK):
                raise  # not a permission of the folder's: the error as it is
            raise ValueError(f"out_dir {_cut(self.path)} is not writable (cannot take its lock {LOCK}): "
                             f"{e.strerror or type(e).__name__}") from None

    def _lock(self, shared_ok: bool):
        path = self.path / LOCK
        for _ in range(5):
            fd, writable, shared = self._open_locked(path, shared_ok)
            if fd is None:  # a read-only folder's lock file shared with another folder: read unlocked
                return
            try:
                info = os.fstat(fd)
                try:
                    now = os.lstat(path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                    os.close(fd)  # another process replaced it after we opened it: lock the new one
                    continue
                if not shared and (info.st_nlink != 1 or not writable):
                    tmp = path.with_name(f"{LOCK}.{os.getpid()}.tmp")
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)  # this pid's own leftover: no live process shares it
                    own = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                    try:
                        fcntl.flock(own, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody can hold it yet
                        os.replace(tmp, path)
                    except BaseException:
                        os.close(own)
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp)
                        raise
                    os.close(fd)
                    fd = own
                if not shared:  # a shared holder cannot write: the file keeps the last writer's pid
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, str(os.getpid()).encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            self.lock_fd, self.shared = fd, shared
            return
        raise ValueError(f"{_cut(path)} was replaced five times while this run tried to lock it: another "
                         f"process is taking the folder; start again")

    def _open_locked(self, path: Path, shared_ok: bool):
        """(fd, writable, shared): the lock file opened (without following a link) and flock'ed, or a
        ValueError. Shared (read-only) when `shared_ok` and this process cannot write the folder;
        otherwise exclusive, through a read-only fd (writable False: lock() replaces the file) when
        the file may not be written. fd None: shared, but the file has other names (no lock taken)."""
        fault = _kind_fault(path, folder=False)
        if fault:
            raise ValueError(fault)
        shared = shared_ok and not os.access(self.path, os.W_OK | os.X_OK)
        writable = not shared
        try:
            fd = os.open(path, (os.O_RDONLY if shared else os.O_RDWR | os.O_CREAT) | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:  # made a link since the check above
                raise ValueError(_kind_fault(path, folder=False) or f"{_cut(path)} is a symbolic link") from None
            if shared or e.errno not in (errno.EACCES, errno.EPERM) or not os.path.lexists(path):
                raise
            # a lock file this process may not write: flock works on a read-only fd, and lock()
            # replaces the file under that lock (or, in a folder it cannot write, says so)
            try:
                fd, writable = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), False
            except PermissionError:
                # not replaced: a run that opened it before its mode changed may hold its lock still
                raise ValueError(f"{_cut(path)} (the run's lock file) cannot be opened by this process (its "
                                 f"permissions refuse reading it): give it back its permissions (chmod 644), or "
                                 f"delete it when no run uses out_dir {_cut(self.path)}") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{_cut(path)} is not a regular file, where the run keeps its lock: move it away "
                                 f"or choose another out_dir")
            if shared and info.st_nlink != 1:
                # another folder's file too (`cp -al` of a run, made read-only): a lock on it would lock
                # that folder as well, and this process cannot write here, nor can a run train here
                os.close(fd)
                return None, False, True
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                if not shared and _only_readers(fd):  # a shared holder writes no pid: the file's is stale
                    raise ValueError(f"out_dir {_cut(self.path)} is being read by another process (a finished run "
                                     f"reported in a folder it cannot write): start again when it is done") from None
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                raise ValueError(f"out_dir {_cut(self.path)} is in use by another process "
                                 f"(pid {holder if holder.isdigit() else 'unknown'}), which holds {_cut(path)}: "
                                 f"one run per folder at a time") from None
        except BaseException:
            os.close(fd)
            raise
        return fd, writable, shared

    def unlock(self):
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # closing releases the flock
            self.lock_fd, self.shared = None, False


def _only_readers(fd: int) -> bool:
    """Whether the flock another process holds on fd's file is shared (the caller's own exclusive
    attempt failed): a shared one is taken then let go."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _delete(path: Path):
    """Deletes a file, a link (never what it points to) or a folder; a failure names the full path
    (shutil.rmtree's own error names only the file within its folder)."""
    def failed(where, error: OSError):
        raise OSError(error.errno, f"could not delete {_cut(where)} ({error.strerror or error}): fix its "
                                   f"permissions (or immutable flag) and start again") from None

    if path.is_dir() and not path.is_symlink():
        if sys.version_info >= (3, 12):  # onerror is deprecated there
            shutil.rmtree(path, onexc=lambda _f, where, error: failed(where, error))
        else:
            shutil.rmtree(path, onerror=lambda _f, where, info: failed(where, info[1]))
    else:
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            failed(path, e)


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

    def truncate(self, step, logged: Optional[int] = None) -> int:
        """Drop the rows after `step` (a resumed run logs them again) and any damaged row; returns
        how many steps keep rows. `logged`: how many the checkpoint at `step` counted (None: not
        recorded); fewer is reported as a gap in the log (a cut, edited or deleted file)."""
        if not self.enabled:
            return 0
        keep = [r for r in read_metrics(self.path) if int(r[0]) <= step] if self.path.exists() else []
        if self.path.exists():
            text = "step,key,value\n" + "".join(",".join(r) + "\n" for r in keep)
            atomic_write(self.path, lambda p: p.write_text(text))
        kept = len({int(r[0]) for r in keep})
        if logged is not None and kept < logged:
            print(f"warning: {_cut(self.path)} holds rows for {kept} of the {logged} steps the run logged up to "
                  f"step {step}, its checkpoint: the other rows are lost (the file was cut, edited or deleted); "
                  f"the log goes on from step {step + 1}", file=sys.stderr, flush=True)
        return kept

    def log(self, step, row):
        if not self.enabled:
            return
        new = not self.path.exists()
        try:
            with self.path.open("a", newline="") as fh:
                w = csv.writer(fh, lineterminator="\n")  # as truncate writes the rows a resume keeps
                if new:
                    w.writerow(["step", "key", "value"])
                for k, v in row.items():
                    w.writerow([step, k, v])
        except OSError as e:  # named: a bare "[Errno 27] File too large" said neither file nor what to do
            text = (f"could not write the metrics of step {step} to {self.path} ({out_of_room(e) or e.strerror or e}); "
                    f"a resume from the latest checkpoint cuts the file back to it and logs the later steps again")
            raise (type(e)(e.errno, text) if e.errno is not None else OSError(text)) from e
        if self.tb is not None:
            for k, v in row.items():
                self.tb.add_scalar(k, v, step)

    def close(self):
        """Writes TensorBoard's buffered events (its writer thread would otherwise be left to the
        interpreter's exit)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
