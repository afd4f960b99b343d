"""bst_fast.files: writing files so that a crash, a kill or a full disk never leaves half a file.

The bottom floor of the run-folder code (checkpoints, metrics, the run folder's marker): a file is
written under a name unique to this process, synced, then renamed over its final name.
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import mmap
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional


# A text run's files, in its folder and in each checkpoint (named here, below both users: tasks
# writes them, checkpoint verifies them, and checkpoint.load_model imports tasks).
TOKENIZER, CORPUS = "tokenizer.json", "data.json"


def fsync(path: Path):
    """Flush a file (or a folder's entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_file_range():
    """libc's sync_file_range (Linux), which the os module lacks; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes, call.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
    return call


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writing the dirty pages, wait for nothing


def start_writeback(path: Path):
    """Asks the kernel to start writing a file's dirty pages to the disk and returns at once, so that
    work needing the CPU, not the disk, can run meanwhile; the fsync that must follow then waits only
    for the rest. A hint (on Linux; nothing elsewhere): no metadata, no promise, errors left to fsync."""
    if _SYNC_FILE_RANGE is not None:
        fd = os.open(path, os.O_RDONLY)
        try:
            _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
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


def sha256_written(path: Path) -> str:
    """sha256(path) of a file this process just wrote, hashed where it lies in the page cache through a
    memory map: no copy (reading 7 MB into buffers costs ~1 ms more of CPU). Not for files that may be
    damaged or shrink (verify's): there a read error is a SIGBUS, not an OSError."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:  # mmap refuses an empty file
            return hashlib.sha256().hexdigest()
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return hashlib.sha256(mapped).hexdigest()


# what ran out, by errno
OUT_OF_ROOM = {errno.ENOSPC: "the disk is full (no space left on device)",
               errno.EDQUOT: "the disk quota is exceeded",
               errno.EFBIG: "a file reached the process's file-size limit (ulimit -f)"}


def out_of_room(error: BaseException) -> Optional[str]:
    """What ran out, where `error` (or an error it was raised from) is a full disk, an exceeded quota
    or file-size limit (OUT_OF_ROOM's text), else None. torch.save reports a short write as a
    RuntimeError ("unexpected pos ..."), so the chain is searched, not only the error itself."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in OUT_OF_ROOM:
            return OUT_OF_ROOM[error.errno]
        # safetensors' writer gives only the text ("I/O error: File too large (os error 27)")
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code and int(code.group(1)) in OUT_OF_ROOM:
            return OUT_OF_ROOM[int(code.group(1))]
        error = error.__cause__ or error.__context__
    return None
