"""bst_fast.files: writing files so that a crash, a kill or a full disk never leaves half a file.

The bottom floor of the run-folder code (checkpoints, metrics, the run folder's marker): a file is
written under a name unique to this process, synced, then renamed over its final name.
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Callable


def fsync(path: Path):
    """Flush a file (or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """`path`'s temporary sibling, unique to this process: two processes never share one."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def atomic_write(path: Path, write: Callable[[Path], None]):
    """`write(tmp)` then rename tmp over `path`: readers see the old file or the new one, never part
    of one. A failed write removes its temporary file and leaves `path` as it was."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def disk_full(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is a full disk or an exceeded file-size or
    quota limit. torch.save reports a short write as a RuntimeError ("unexpected pos ..."), so the
    chain is searched, not only the error itself."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return True
        error = error.__cause__ or error.__context__
    return False
