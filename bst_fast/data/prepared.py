"""Pre-tokenised corpora: tokenise a text corpus once (`bst-fast tokenize DATA --out DIR`), then
train from the folder (`data: DIR`) with no tokenizer training and no tokenising.

A prepared corpus is a folder of four files:

    manifest.json   what the folder holds (below), checked when it is opened
    tokens.bin      every document's ids back to back: little-endian uint16 when the vocabulary has
                    at most 65536 ids, else uint32
    offsets.bin     documents + 1 little-endian int64: document d is tokens[offsets[d]:offsets[d + 1]]
    tokenizer.json  the tokenizer that wrote the ids (HF tokenizers JSON, with <pad>, <bos>, <eos>)

The manifest (JSON): format ("bst_fast.prepared") and version, vocab_size, dtype, documents,
tokens, the SHA-256 of each file, the SHA-256 of each BLOCK_BYTES block of tokens.bin, the special
ids, the source (paths, files, bytes), the tokenizer's origin, max_doc_tokens and the documents it
dropped, and a fingerprint: the SHA-256 of the manifest's content fields (format, version,
vocab_size, dtype, documents, tokens, the file and block hashes), so it names the data exactly.

Opening (PreparedCorpus.open) checks, before anything is trained: the manifest's fields and its
fingerprint; each file's size against the manifest; tokenizer.json and offsets.bin in full (their
hashes; offsets start at 0, never decrease and end at the token count); tokens.bin's blocks (all of
them up to VERIFY_ALL_BYTES, else the first, the last and VERIFY_BLOCKS others) against their
hashes, and their ids against the vocabulary. The rest of tokens.bin is memory-mapped, not read:
every id a batch gathers is checked against the vocabulary as it is read. Opening takes well under
a second whatever the corpus's size (it reads offsets.bin, 8 bytes a document).

Writing (tokenize_corpus) streams: documents are read a file chunk at a time, encoded about
_ENCODE_CHARS characters at a time (PieceEncoder: the tokenizer's own ids) by one process per CPU
(at most two batches each in flight) and appended to the files in order, hashed as they are
written; memory holds a few batches, the tokenizer and each process's piece cache (bounded),
whatever the corpus's size. The folder is written under a temporary name next to DIR and renamed
into place; an existing DIR is replaced only if it is empty or a prepared corpus.

Mixtures (MixtureData): prepared corpora that share one tokenizer, each with a weight; every row of
a batch draws its corpus by weight, a pure function of (seed, step).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .._checks import check_int
from ..files import fsync, sha256
from .packing import padding_saved
from .star import _Batches
from .text import (_ENCODE_CHARS, SPECIAL_TOKENS, TextData, _check_split, _doc_batches, _documents, _progress_bar,
                   _shown, _text_files, _text_only, bpe_shortfall, check_no_special_ids, load_tokenizer, path_list,
                   save_tokenizer, train_bpe, vocabulary_size)

# the folder's names and is_prepared live below data/text.py, which reads folders of raw text
from .corpus_layout import FORMAT, MANIFEST, OFFSETS, TOKENIZER, TOKENS, VERSION, is_prepared  # noqa: F401
BLOCK_BYTES = 1 << 24  # tokens.bin is hashed in blocks of 16 MiB too, so that opening can check a few
VERIFY_ALL_BYTES = 1 << 26  # token files up to 64 MiB are checked whole when opened
VERIFY_BLOCKS = 4  # and of larger ones, the first, the last and this many others
_CONTENT = ("format", "version", "vocab_size", "dtype", "documents", "tokens", "sha256", "block_bytes",
            "block_sha256")  # the manifest fields the fingerprint covers
_TAG_MIX, _TAG_MIX_PERM = 0x6D6978, 0x6D7870  # seed tags of MixtureData's draws


def fingerprint_of(manifest: dict) -> str:
    """The SHA-256 of the manifest's content fields, in canonical JSON."""
    content = {k: manifest.get(k) for k in _CONTENT}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; little-endian."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# ---------------------------------------------------------------------------------------------
# writing


class _Hashes:
    """SHA-256 of a stream, and of each `block` bytes of it."""

    def __init__(self, block: int):
        self.block, self.whole, self.blocks = block, hashlib.sha256(), []
        self._cur, self._left = hashlib.sha256(), block

    def update(self, data: memoryview):
        self.whole.update(data)
        while len(data):
            part, data = data[:self._left], data[self._left:]
            self._cur.update(part)
            self._left -= len(part)
            if not self._left:
                self.blocks.append(self._cur.hexdigest())
                self._cur, self._left = hashlib.sha256(), self.block

    def finish(self):
        if self._left != self.block:
            self.blocks.append(self._cur.hexdigest())
        return self.whole.hexdigest(), self.blocks


def _check_out(out: Path) -> bool:
    """Whether `out` exists (an empty folder or a prepared corpus, to be replaced); a ValueError
    naming it if it is anything else."""
    if not os.path.lexists(out):
        return False
    if not os.path.isdir(out) or os.path.islink(out):
        raise ValueError(f"--out {_shown(out, True)} exists and is not a folder; give a new folder")
    names = {e.name for e in os.scandir(out)}
    if names and not is_prepared(out):
        raise ValueError(f"--out {_shown(out, True)} is a folder that is not empty and not a prepared corpus "
                         f"(no {MANIFEST} of this format): refusing to overwrite it; give a new or empty folder")
    others = sorted(names - {MANIFEST, TOKENS, OFFSETS, TOKENIZER}
                    | {n for n in names if os.path.isdir(out / n) and not os.path.islink(out / n)})
    if others:  # replacing the corpus would delete them
        raise ValueError(f"--out {_shown(out, True)} is a prepared corpus that also holds other files "
                         f"({', '.join(map(repr, others[:5]))}{', ...' if len(others) > 5 else ''}): refusing to "
                         f"replace it, which would delete them; move them, or give a new or empty folder")
    return True


def tokenize_corpus(data, out, *, vocab_size: int | None = None, tokenizer=None, max_doc_tokens: int | None = None,
                    bpe_sample_bytes: int | None = None, progress=None, workers: int | None = None) -> dict:
    """Tokenise the documents of `data` (a .txt file, a folder or a list of them, read as TextData
    reads them) into the prepared corpus `out`; returns its manifest.

    tokenizer: None trains a byte-level BPE tokenizer of `vocab_size` (None: 1000, the paper's) on the
    corpus (train_bpe, the tokenizer a text run trains; `bpe_sample_bytes` trains it on documents
    spread evenly over the corpus, about that many bytes), else the path of a tokenizer.json or a HF
    Tokenizer (its vocabulary sets the model's; vocab_size and bpe_sample_bytes are then refused). max_doc_tokens: documents longer than this many tokens are
    dropped (counted in the manifest's dropped_documents; None or 0 drops none), as the paper drops TinyStories stories
    longer than 256 tokens. progress: bars on stderr (None: only for more than 8 MB of text).
    workers: encoding processes (None: one per CPU for a corpus over 4 MiB (4 * _ENCODE_CHARS
        bytes), else this process alone; 0: this process alone); the ids do not depend
    on it."""
    paths = path_list(data)  # read once: a generator (Path.glob) gives the files and the manifest's paths
    files = _text_files(paths)  # a missing input is reported before anything else is done
    out = Path(os.path.abspath(out))  # "." has no name: the temporary folder would land inside it
    here = os.path.realpath(os.getcwd())
    if here == os.path.realpath(out) or here.startswith(os.path.realpath(out) + os.sep):
        # replacing it would leave the caller's shell in a deleted folder, seeing nothing written
        raise ValueError(f"--out {_shown(out, True)} is the current folder or holds it: give another folder")
    _check_out(out)
    if max_doc_tokens is not None:  # 0 keeps every document, as the config's max_doc_tokens 0 does
        max_doc_tokens = check_int("max_doc_tokens", max_doc_tokens, 0) or None
    if workers is not None:  # checked before the BPE is trained, which can take minutes
        workers = check_workers("workers", workers)
    if tokenizer is not None:  # they would be ignored
        for name, v in (("vocab_size", vocab_size), ("bpe_sample_bytes", bpe_sample_bytes)):
            if v is not None:
                raise ValueError(f"{name}={_shown(v)} applies to a BPE tokenizer trained here (tokenizer=None), not to "
                                 f"a given tokenizer (its own vocabulary is used): leave {name} out")
        if not isinstance(tokenizer, (str, os.PathLike)) and not callable(getattr(tokenizer, "to_str", None)):
            raise ValueError(f"tokenizer must be None (train a BPE here), the path of a tokenizer.json or a HF "
                             f"tokenizers Tokenizer, got {type(tokenizer).__name__} {_shown(tokenizer)}")
    t0 = time.perf_counter()
    if tokenizer is None:
        vocab_size = 1000 if vocab_size is None else vocab_size
        tok = train_bpe(files, vocab_size=vocab_size, progress=progress, sample_bytes=bpe_sample_bytes)
        origin = {"trained": {"vocab_size": int(vocab_size),
                              "sample_bytes": None if bpe_sample_bytes is None else int(bpe_sample_bytes)}}
    elif isinstance(tokenizer, (str, os.PathLike)):
        try:
            tok = load_tokenizer(tokenizer)
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"--tokenizer: {e}") from None
        origin = {"path": os.path.abspath(tokenizer)}
    else:
        from tokenizers import Tokenizer

        tok = _text_only(Tokenizer.from_str(tokenizer.to_str()))  # a copy: the caller's settings stay
        origin = {"object": type(tokenizer).__name__}
    bpe_seconds = time.perf_counter() - t0
    special = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    if None in special.values():
        raise ValueError(f"tokenizer: has no {', '.join(k for k, v in special.items() if v is None)} token")
    vocab = vocabulary_size(tok)
    dtype = dtype_for(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    if workers is None:  # small corpora: not worth starting processes
        workers = default_workers() if sum(f.stat().st_size for f in files) > 4 * _ENCODE_CHARS else 0
    mine = True  # tmp is this call's, or not made yet (a FileExistsError must not remove another's folder)
    try:
        # SIGTERM unwinds from before the folder is made (a SIGTERM between the two left it behind)
        # to its last fsync, not in _replace: between its two renames an unwinding would delete the
        # new corpus with the old one moved aside; a SIGTERM there leaves both folders instead
        with _terminate_unwinds():
            try:
                tmp.mkdir()
            except FileExistsError:
                mine = False
                raise
            manifest = _write(tmp, files, tok, dtype, max_doc_tokens, progress, workers)
            manifest.update(vocab_size=vocab, special_ids=special, max_doc_tokens=max_doc_tokens,
                            source={"paths": [os.path.abspath(p) for p in paths],
                                    "files": len(files), "bytes": sum(f.stat().st_size for f in files)},
                            tokenizer_origin=origin)
            manifest["fingerprint"] = fingerprint_of(manifest)
            manifest["seconds"] = {"bpe": round(bpe_seconds, 3), "encode": manifest.pop("_encode_seconds")}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            for name in (TOKENS, OFFSETS, TOKENIZER, MANIFEST):
                fsync(tmp / name)
        _replace(tmp, out)
    except BaseException:
        if mine:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


@contextlib.contextmanager
def _terminate_unwinds():
    """SIGTERM (a scheduler's stop) unwinds as an interrupt does while the temporary folder is being
    written, so that it is deleted (the default left it behind): only where SIGTERM has its default
    action and this is the main thread, and only then (not while a BPE trains before it: that writes
    nothing, and the default action stops it at once)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


MAX_WORKERS = 4096  # encoding processes: more than any machine's CPUs, short of exhausting the system's


def check_workers(name: str, value) -> int:
    """`value` as a count of encoding processes, 0 to MAX_WORKERS; a ValueError naming `name`."""
    v = check_int(name, value, 0)
    if v > MAX_WORKERS:
        raise ValueError(f"{name} must be an int from 0 to {MAX_WORKERS} (encoding processes), got {_shown(value)}")
    return v


def default_workers() -> int:
    """Encoding processes: one per CPU this process may run on; 0 (encode in this process) on one CPU."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return n if n > 1 else 0


_WORKER = None  # a worker process's PieceEncoder


def _worker_init(tokenizer_json: str, dtype: str, parent: int):
    global _WORKER
    import signal

    _die_with(parent)
    # the main process stops the workers (kills them) on an interrupt or SIGTERM: no tracebacks of theirs
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism (and no fork warning)
    from tokenizers import Tokenizer

    from .encode import PieceEncoder

    _WORKER = PieceEncoder(_text_only(Tokenizer.from_str(tokenizer_json)), np.dtype(dtype))


def _die_with(parent: int):
    """On Linux, have the kernel kill this worker when the process that started it dies: a SIGKILL
    (or the OOM killer) of `tokenize` left its workers blocked for ever on the result pipe, which
    their siblings hold open (review helper-105)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(1)


def _worker_encode(batch):
    return _WORKER.encode(batch)


def _encoded(batches, tok, dtype, workers: int):
    """(flat ids, lengths) of each batch of documents, in order: in this process (workers 0) or in
    `workers` processes, at most two batches each in flight (memory stays bounded)."""
    from .encode import PieceEncoder

    if workers <= 0:
        encoder = PieceEncoder(tok, dtype)
        for batch in batches:
            yield encoder.encode(batch)
        return
    import collections
    import multiprocessing as mp

    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # fork: the workers need no imports of their own (spawn would import torch in each).
    # concurrent.futures, not multiprocessing.Pool: a worker killed (by the OOM killer, say) breaks
    # the pool with an error where Pool waited forever for its task, and an interrupt does not hang
    # in Pool.terminate on a batch still being sent to dead workers.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init,
                               initargs=(tok.to_str(), dtype.str, os.getpid()))
    try:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.submit(_worker_encode, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException as e:
        workers_alive = list((getattr(pool, "_processes", None) or {}).values())  # the executor's own table
        for proc in workers_alive:
            proc.kill()  # no waiting on a worker's batch: the caller deletes the temporary folder
        # A worker killed while sending its result leaves a partial message in the result pipe, and
        # the executor's thread waits for the rest of it forever: the parent holds the pipe's other
        # write end. Interpreter exit joins that thread, so the process hung after "interrupted".
        # With every writer closed the read ends (EOF), the executor finds itself broken and cleans up.
        writer = getattr(getattr(pool, "_result_queue", None), "_writer", None)
        if workers_alive and writer is not None:
            for proc in workers_alive:
                proc.join()  # their ends of the pipe close as they exit
            writer.close()
        pool.shutdown(wait=False, cancel_futures=True)
        if isinstance(e, BrokenProcessPool):
            raise RuntimeError(f"an encoding process died ({e}): killed, or out of memory? Tokenize again, "
                               f"with fewer --workers") from None
        raise
    pool.shutdown(wait=True)


def _write(tmp: Path, files, tok, dtype, max_doc_tokens, progress, workers) -> dict:
    from .encode import piece_encodable

    save_tokenizer(tok, tmp / TOKENIZER)
    t0 = time.perf_counter()
    hashes, off_hash = _Hashes(BLOCK_BYTES), hashlib.sha256()
    total = docs = dropped = empty = 0
    bar = _progress_bar(files, progress, "tokenising")
    try:
        with open(tmp / TOKENS, "wb") as ft, open(tmp / OFFSETS, "wb") as fo:
            first = np.zeros(1, dtype="<i8").tobytes()
            fo.write(first)
            off_hash.update(first)
            for flat, lengths in _encoded(_doc_batches(_documents(files, bar), _ENCODE_CHARS), tok, dtype, workers):
                check_no_special_ids(flat, tok)
                keep = lengths > 0  # a document of no tokens (only from an unusual tokenizer) is no row
                empty += int((~keep).sum())
                if max_doc_tokens is not None:
                    long = lengths > max_doc_tokens
                    dropped += int(long.sum())
                    keep &= ~long
                if not keep.all():
                    flat, lengths = flat[np.repeat(keep, lengths)], lengths[keep]
                raw = memoryview(np.ascontiguousarray(flat, dtype=dtype)).cast("B")
                ft.write(raw)
                hashes.update(raw)
                ends = (total + np.cumsum(lengths)).astype("<i8").tobytes()
                fo.write(ends)
                off_hash.update(ends)
                total += int(lengths.sum())
                docs += len(lengths)
    finally:
        if bar is not None:
            bar.close()
    if not docs:
        raise ValueError(f"no documents to write ({dropped} longer than max_doc_tokens={max_doc_tokens}, "
                         f"{empty} of no tokens)" if dropped or empty else "no documents (every input was empty)")
    whole, blocks = hashes.finish()
    return {"format": FORMAT, "version": VERSION, "dtype": dtype.name, "documents": docs, "tokens": total,
            "sha256": {"tokens": whole, "offsets": off_hash.hexdigest(), "tokenizer": sha256(tmp / TOKENIZER)},
            "block_bytes": BLOCK_BYTES, "block_sha256": blocks,
            "files": {"tokens": TOKENS, "offsets": OFFSETS, "tokenizer": TOKENIZER},
            "dropped_documents": dropped, "empty_documents": empty,
            "_encode_seconds": round(time.perf_counter() - t0, 3),
            "encoder": ("pieces" if piece_encodable(tok) else "encode_batch") + f", {max(workers, 1)} process"
                       + ("es" if workers > 1 else "")}


def _replace(tmp: Path, out: Path):
    """Rename the finished folder `tmp` to `out`: an empty folder or a prepared corpus there is
    replaced (checked again now: it may have changed while tokenising)."""
    if _check_out(out):
        if not any(os.scandir(out)):
            os.rmdir(out)
        else:
            old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:  # an interrupt between the renames: the old corpus goes back
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)


# ---------------------------------------------------------------------------------------------
# reading


class PreparedCorpus:
    """An opened prepared corpus: `tokens` (memory-mapped, read-only), `offsets` ((documents + 1,)
    int64), `tokenizer`, `vocab_size`, `special_ids`, `fingerprint`, `manifest`, `path`."""

    def __init__(self, path, manifest, tokens, offsets, tokenizer):
        self.path, self.manifest, self.tokens, self.offsets, self.tokenizer = path, manifest, tokens, offsets, tokenizer
        self.vocab_size = int(manifest["vocab_size"])
        self.fingerprint = manifest["fingerprint"]
        self.tokenizer_sha256 = manifest["sha256"]["tokenizer"]
        self.special_ids = {name: tokenizer.token_to_id(name) for name in SPECIAL_TOKENS}

    @property
    def name(self) -> str:
        return str(self.path)

    @classmethod
    def open(cls, path, verify: str = "sample") -> "PreparedCorpus":
        """Open and check the prepared corpus at `path` (module docstring). verify: "sample" (the
        default: small token files whole, a few blocks of large ones) or "full" (every block).
        Any fault is a ValueError naming the folder and the file."""
        if verify not in ("sample", "full"):
            raise ValueError(f"verify must be 'sample' or 'full', got {_shown(verify)}")
        path = Path(path)
        where = _shown(path, True)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"no such prepared corpus (folder): {where}")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise ValueError(f"{where} is not a prepared corpus: it holds no {MANIFEST} "
                             f"(write one with `bst-fast tokenize DATA --out {where}`)")
        m = _read_manifest(mpath)
        _check_manifest(m, mpath)
        files = m["files"]
        dtype = np.dtype("<" + {"uint16": "u2", "uint32": "u4"}[m["dtype"]])
        sizes = {"tokens": m["tokens"] * dtype.itemsize, "offsets": (m["documents"] + 1) * 8}
        for key, want in sizes.items():
            f = path / files[key]
            have = f.stat().st_size if f.is_file() else None
            if have != want:
                raise ValueError(f"{_shown(f, True)}: {'missing' if have is None else f'{have} bytes'}, but the "
                                 f"manifest's {m['documents']} documents and {m['tokens']} {m['dtype']} tokens "
                                 f"make {want}: the prepared corpus is incomplete or corrupt; tokenize it again")
        tok_file = path / files["tokenizer"]
        if not tok_file.is_file():
            raise ValueError(f"{_shown(tok_file, True)}: missing (the corpus's tokenizer); tokenize it again")
        if sha256(tok_file) != m["sha256"]["tokenizer"]:
            raise ValueError(f"{_shown(tok_file, True)}: its SHA-256 does not match the fingerprint in {MANIFEST} "
                             f"(the tokenizer was changed after tokenising); tokenize the corpus again")
        tokenizer = load_tokenizer(tok_file)
        vocab = vocabulary_size(tokenizer)
        if vocab != m["vocab_size"]:
            raise ValueError(f"{_shown(tok_file, True)}: {vocab} ids, but {MANIFEST} says "
                             f"vocab_size {m['vocab_size']} (a tokenizer whose ids skip numbers was counted short "
                             f"before: tokenize the corpus again)")
        opath = path / files["offsets"]
        raw = opath.read_bytes()
        if hashlib.sha256(raw).hexdigest() != m["sha256"]["offsets"]:
            raise ValueError(f"{_shown(opath, True)}: its SHA-256 does not match the fingerprint in {MANIFEST} "
                             f"(the file changed or is corrupt); tokenize the corpus again")
        offsets = np.frombuffer(raw, dtype="<i8").astype(np.int64, copy=False)
        _check_offsets(offsets, m["tokens"], opath)
        tpath = path / files["tokens"]
        tokens = np.memmap(tpath, dtype=dtype, mode="r", shape=(m["tokens"],))
        _verify_blocks(tokens, m, tpath, verify, tokenizer)
        return cls(path, m, tokens, offsets, tokenizer)


def prepared_text_data(corpus, max_len: int, held_out: float = 0.05, seed: int = 0, pack: bool = False,
                       max_doc_tokens: int | None = None) -> TextData:
    """A prepared corpus (a folder `bst-fast tokenize` wrote, or a PreparedCorpus) as TextData: its
    memory-mapped ids, split and batched exactly as TextData(text, its tokenizer) would (the same
    documents give the same rows, split and batches). Nothing is tokenised; the token file is read
    only where batches read it, so RAM does not grow with the corpus (the row index takes 16 bytes
    a row). fingerprint() is the manifest's. pack, max_doc_tokens: as TextData takes them."""
    max_len, held_out, seed = _check_split(max_len, held_out, seed)  # before reading anything
    if not isinstance(corpus, PreparedCorpus):
        corpus = PreparedCorpus.open(corpus)
    data = TextData.__new__(TextData)
    data.tokenizer, data._prepared = corpus.tokenizer, corpus
    special = corpus.special_ids
    data._build(corpus.tokens, np.diff(corpus.offsets), corpus.vocab_size, special["<pad>"],
                special["<bos>"], special["<eos>"], max_len, held_out, seed, pack=pack,
                max_doc_tokens=max_doc_tokens, limit=(corpus.vocab_size, _shown(corpus.path, True)))
    return data


def _read_manifest(mpath: Path) -> dict:
    where = _shown(mpath, True)
    try:
        m = json.loads(mpath.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: corrupt manifest (not JSON: {_shown(str(e), True)}); tokenize the corpus again") from None
    if not isinstance(m, dict):
        raise ValueError(f"{where}: corrupt manifest (a JSON {type(m).__name__}, not an object)")
    return m


def _check_manifest(m: dict, mpath: Path):
    where = _shown(mpath, True)

    def bad(field, want):
        raise ValueError(f"{where}: corrupt manifest: {field} must be {want}, got {_shown(m.get(field))}")

    if m.get("format") != FORMAT:
        bad("format", repr(FORMAT))
    if not isinstance(m.get("version"), int) or isinstance(m.get("version"), bool):
        bad("version", "an int")
    if m["version"] > VERSION:
        raise ValueError(f"{where}: format version {m['version']} is newer than this bst_fast reads ({VERSION}); "
                         f"upgrade bst_fast")
    if m["version"] != VERSION:
        bad("version", str(VERSION))
    def count(v, lowest):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lowest

    for field in ("vocab_size", "documents", "tokens", "block_bytes"):
        if not count(m.get(field), 1):
            bad(field, "an int >= 1")
    for field in ("dropped_documents", "empty_documents"):  # read at every start; not in the fingerprint
        if m.get(field) is not None and not count(m[field], 0):
            bad(field, "absent, null or an int >= 0")
    if m["block_bytes"] % 4:
        bad("block_bytes", "a multiple of 4")
    if m.get("dtype") not in ("uint16", "uint32"):
        bad("dtype", "'uint16' or 'uint32'")
    if m["dtype"] == "uint16" and m["vocab_size"] > 1 << 16:
        bad("dtype", f"'uint32' for vocab_size {m['vocab_size']} (> 65536)")
    if m["vocab_size"] > 1 << 31:
        bad("vocab_size", "at most 2**31")
    files = m.get("files")
    if not isinstance(files, dict) or any(not isinstance(files.get(k), str) or not files[k]
                                          or os.path.basename(files[k]) != files[k]
                                          for k in ("tokens", "offsets", "tokenizer")):
        bad("files", "an object naming the tokens, offsets and tokenizer files of the folder")
    hashes = m.get("sha256")
    if not isinstance(hashes, dict) or any(not _is_hex(hashes.get(k)) for k in ("tokens", "offsets", "tokenizer")):
        bad("sha256", "an object of the SHA-256 (hex) of tokens, offsets and tokenizer")
    blocks = m.get("block_sha256")
    n_blocks = -(-m["tokens"] * (2 if m["dtype"] == "uint16" else 4) // m["block_bytes"])
    if not isinstance(blocks, list) or len(blocks) != n_blocks or not all(map(_is_hex, blocks)):
        bad("block_sha256", f"a list of {n_blocks} SHA-256 (hex) of tokens.bin's blocks")
    if m.get("fingerprint") != fingerprint_of(m):
        raise ValueError(f"{where}: the manifest's fingerprint does not match its content (it was edited or is "
                         f"corrupt): fingerprint {_shown(m.get('fingerprint'))}, content {fingerprint_of(m)}; "
                         f"tokenize the corpus again")
    special = m.get("special_ids")
    if not isinstance(special, dict):
        bad("special_ids", "an object")


def _is_hex(v) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _check_offsets(offsets: np.ndarray, n_tokens: int, opath: Path):
    where = _shown(opath, True)
    if offsets[0] != 0:
        raise ValueError(f"{where}: the first document starts at {int(offsets[0])}, not 0 (corrupt offsets)")
    step = np.diff(offsets)
    if len(step) and step.min() < 0:
        d = int(np.argmax(step < 0))
        raise ValueError(f"{where}: offsets are not sorted: document {d} ends at {int(offsets[d + 1])}, before it "
                         f"starts at {int(offsets[d])} (documents would overlap; corrupt offsets)")
    if offsets[-1] != n_tokens:
        raise ValueError(f"{where}: the last document ends at {int(offsets[-1])}, but the corpus holds {n_tokens} "
                         f"tokens (corrupt offsets)")


def _verify_blocks(tokens: np.memmap, m: dict, tpath: Path, verify: str, tokenizer):
    """Blocks of tokens.bin against their hashes, the vocabulary and the special ids (tokenize
    refuses them since stop 41; a corpus written before by a tokenizer that encodes '<eos>' as a
    word would hold them), read with read() (not through the memory map, whose pages would stay in
    this process's resident set)."""
    size, block = len(tokens) * tokens.dtype.itemsize, m["block_bytes"]
    n = len(m["block_sha256"])
    if verify == "full" or size <= VERIFY_ALL_BYTES:
        which = range(n)
    else:  # the first, the last, and a few others that change with the corpus (its fingerprint)
        rng = np.random.default_rng(int(m["fingerprint"][:16], 16))
        which = sorted({0, n - 1, *rng.choice(n, size=min(VERIFY_BLOCKS, n), replace=False).tolist()})
    V = m["vocab_size"]
    with open(tpath, "rb") as fh:
        for b in which:
            fh.seek(b * block)
            ids = _verify_block(fh.read(block), b, block, m, tpath, V, tokens.dtype)
            check_no_special_ids(ids, tokenizer, where=f"{_shown(tpath, True)} (block {b})")


def _verify_block(part: bytes, b: int, block: int, m: dict, tpath: Path, V: int, dtype) -> np.ndarray:
    """The ids of block b, checked against its hash and the vocabulary."""
    if hashlib.sha256(part).hexdigest() != m["block_sha256"][b]:
        raise ValueError(f"{_shown(tpath, True)}: block {b} (bytes {b * block}..{b * block + len(part) - 1}) does "
                         f"not match its SHA-256 in {MANIFEST} (the file changed or is corrupt); tokenize the "
                         f"corpus again")
    ids = np.frombuffer(part, dtype=dtype)
    if len(ids) and int(ids.max()) >= V:
        raise ValueError(f"{_shown(tpath, True)}: token id {int(ids.max())} is outside the vocabulary "
                         f"0..{V - 1}")
    return ids


# ---------------------------------------------------------------------------------------------
# mixtures


def corpus_entries(data) -> list[tuple[str, float]]:
    """TrainConfig.data as a list of (corpus, weight): a path is one corpus of weight 1."""
    if isinstance(data, (str, os.PathLike)):
        return [(str(data), 1.0)]
    return [(str(e[0]), float(e[1])) if isinstance(e, (list, tuple)) else (str(e), 1.0) for e in data]


class MixtureData(_Batches):
    """Weighted prepared corpora sharing one tokenizer, batched as one corpus.

    Row r of training batch `step` draws its corpus from the weights (a generator seeded with
    (seed, step)); corpus c then serves the row at slot t = step * batch_size + r of its own
    order: one seeded permutation of its training rows per n_c slots (n_c its training rows), so a
    corpus never repeats a row within n_c slots. Everything is a pure function of (seed, step):
    resume needs only the step. The held-out rows are every corpus's own held-out rows
    (TextData's split, per corpus), in corpus order."""

    def __init__(self, parts, weights, names=None, seed: int = 0):
        """parts: TextData of prepared corpora; weights: one finite weight > 0 each."""
        if not parts:
            raise ValueError("a mixture needs at least one corpus")
        names = [f"corpus {k}" for k in range(len(parts))] if names is None else list(names)
        if len(names) != len(parts) or not all(isinstance(n, str) for n in names):  # zip dropped the extra
            raise ValueError(f"a mixture of {len(parts)} corpora needs {len(parts)} names (strings), got {_shown(names)}")
        weights = [float(w) for w in weights]
        if len(weights) != len(parts):
            raise ValueError(f"a mixture of {len(parts)} corpora needs {len(parts)} weights, got {len(weights)}")
        # One corpus twice (or through a link, or a copy) would be trained on with the sum of its
        # weights and held out twice in the held-out loss: refused, as raw text refuses a file twice.
        seen = {}
        for name, p in zip(names, parts):
            key = p.fingerprint()["sha256"]  # a prepared corpus's manifest fingerprint: read, not computed
            if key in seen:
                raise ValueError(f"{seen[key]} and {name} are the same corpus (fingerprint {key[:12]}...): list it "
                                 f"once, with the weight it should have")
            seen[key] = name
        for name, w in zip(names, weights):
            if not math.isfinite(w) or w <= 0:
                raise ValueError(f"the weight of {name} must be a finite number > 0, got {_shown(w)}")
        first = parts[0]
        for name, p in zip(names[1:], parts[1:]):
            if (p.pad_id, p.bos_id, p.eos_id, p.vocab_size) != (first.pad_id, first.bos_id, first.eos_id, first.vocab_size):
                raise ValueError(f"{name} and {names[0]} have different vocabularies or special ids")
        self.parts, self.names, self.seed = list(parts), names, seed
        self.weights = np.array(weights, dtype=np.float64) / max(weights)  # 1e308 twice summed to inf
        self.weights /= self.weights.sum()
        self.tokenizer = first.tokenizer
        self.vocab_size, self.max_len = first.vocab_size, first.max_len
        self.pad_id, self.bos_id, self.eos_id = first.pad_id, first.bos_id, first.eos_id
        if len({p.packed for p in parts}) > 1:
            raise ValueError("the corpora of a mixture must be all packed or all unpacked")
        self.packed = first.packed
        self._perms = [{} for _ in parts]  # per corpus: epoch -> permutation (the last two kept)

    @property
    def n_train(self) -> int:
        return sum(p.n_train for p in self.parts)

    @property
    def n_held_out(self) -> int:
        return sum(p.n_held_out for p in self.parts)

    @property
    def n_documents(self) -> int:
        return sum(p.n_documents for p in self.parts)

    @property
    def held_out_lengths(self) -> torch.Tensor:
        return torch.cat([p.held_out_lengths for p in self.parts])

    @property
    def dropped_documents(self) -> int:
        return sum(p.dropped_documents for p in self.parts)

    @property
    def dropped_when_tokenised(self) -> int:
        return sum(p.dropped_when_tokenised for p in self.parts)

    def padding(self, batch_size: int) -> tuple[float, float]:
        """TextData.padding, over every corpus's training rows, the corpora weighed by their rows
        (not by the mixture's weights)."""
        return padding_saved([p._train for p in self.parts], batch_size, self.seed)

    def fingerprint(self) -> dict:
        """Each corpus's fingerprint with its normalised weight, and its name (the path as the config
        gives it: for the reader of data.json; a resume compares data_identity, without it)."""
        return {"mixture": [{"corpus": name, "weight": float(w), **p.fingerprint()}
                            for name, w, p in zip(self.names, self.weights, self.parts)]}

    def draw(self, step: int, batch_size: int, seed: int) -> np.ndarray:
        """(batch_size,) the corpus of each row of batch `step`."""
        step, seed = check_int("step", step, 0), check_int("seed", seed, 0)
        batch_size = check_int("batch_size", batch_size, 1)
        rng = np.random.default_rng([seed, _TAG_MIX, step])
        return rng.choice(len(self.parts), size=batch_size, p=self.weights)

    def _rows(self, c: int, slots: np.ndarray, seed: int) -> np.ndarray:
        n = self.parts[c].n_train
        epochs, at = np.divmod(slots, n)
        out = np.empty(len(slots), dtype=np.int64)
        cache = self._perms[c]
        for e in np.unique(epochs):
            key = (int(e), n, seed)
            if key not in cache:
                if len(cache) >= 2:
                    cache.pop(next(iter(cache)))
                cache[key] = np.random.default_rng([seed, _TAG_MIX_PERM, c, int(e)]).permutation(n)
            m = epochs == e
            out[m] = cache[key][at[m]]
        return out

    def batch(self, step: int, batch_size: int, seed: int):
        """Training batch `step`: (tokens (B, L_max) int64 padded with PAD, lengths (B,) int64),
        and packed, documents (B, L_max) int64 (as TextData.batch)."""
        step, batch_size = check_int("step", step, 0), check_int("batch_size", batch_size, 1)  # Python ints
        which = self.draw(step, batch_size, seed)
        if (step + 1) * batch_size > np.iinfo(np.int64).max:  # the slots are int64 (2**62 was an OverflowError)
            raise ValueError(f"step must be below {np.iinfo(np.int64).max // batch_size} at batch_size {batch_size} "
                             f"(a mixture numbers its rows' slots step * batch_size + r in int64), got {_shown(step)}")
        slots = step * batch_size + np.arange(batch_size, dtype=np.int64)
        pieces = []
        for c in np.unique(which):
            rows = np.flatnonzero(which == c)
            pieces.append((rows, self.parts[c]._train.gather(self._rows(int(c), slots[rows], seed))))
        width = max(got[0].shape[1] for _, got in pieces)
        out = torch.full((batch_size, width), self.pad_id, dtype=torch.long)
        lengths = torch.empty(batch_size, dtype=torch.long)
        documents = torch.zeros((batch_size, width), dtype=torch.long) if self.packed else None
        for rows, got in pieces:
            idx, tokens = torch.from_numpy(rows), got[0]
            out[idx, :tokens.shape[1]] = tokens
            lengths[idx] = got[1]
            if self.packed:  # padding continues each row's last document id
                documents[idx] = torch.cat([got[2], got[2][:, -1:].expand(-1, width - tokens.shape[1])], 1)
        return (out, lengths) if documents is None else (out, lengths, documents)

    def held_out_batches(self, batch_size: int):
        """Every corpus's held-out rows once, in batches (each corpus's last may be short), the corpora
        in turn: a batch of each, then the next of each, so that the first batches (eval_batches)
        hold rows of every corpus while it has some."""
        pending = [p.held_out_batches(batch_size) for p in self.parts]
        while pending:
            for batches in list(pending):
                batch = next(batches, None)
                if batch is None:
                    pending.remove(batches)
                else:
                    yield batch


def data_identity(fingerprint, drop=("corpus",)):
    """What a resume compares of a run's data fingerprint (its data.json, or fingerprint() now): all
    of it but the `drop` keys of a mixture's entries, by default the corpus names. A name is the path
    as the config wrote it, and a link, a moved folder or a trailing '/' names the same corpus; the
    corpora's content fingerprints and weights, in order, set every batch and stay. data.json keeps
    the names, so older run folders compare alike."""
    mixture = fingerprint.get("mixture") if isinstance(fingerprint, dict) else None
    if not isinstance(mixture, list):
        return fingerprint
    return {**fingerprint, "mixture": [{k: v for k, v in e.items() if k not in drop} if isinstance(e, dict) else e
                                       for e in mixture]}


def weights_alone_differ(then, now):
    """(then's, now's) normalised weights when two data fingerprints differ in a mixture's weights
    alone (and its names), else None: a resume's refusal then names the weights, not the corpora
    ([3, 1] and [0.3, 0.1] normalise one ulp apart, and the draws would differ)."""
    if data_identity(then, ("corpus", "weight")) != data_identity(now, ("corpus", "weight")):
        return None
    weights = [[e.get("weight") if isinstance(e, dict) else None for e in x.get("mixture", [])]
               if isinstance(x, dict) else [] for x in (then, now)]
    return tuple(weights) if weights[0] != weights[1] else None


def open_data(data, max_len: int, held_out: float = 0.05, seed: int = 0, pack: bool = False,
              max_doc_tokens: int | None = None):
    """TrainConfig.data of prepared corpora as batches: one folder (or a list of one) gives its
    TextData, several a MixtureData; every corpus must have the same tokenizer (its tokenizer.json's
    SHA-256), else a ValueError naming them. pack, max_doc_tokens: as TextData takes them (each
    corpus packed alone)."""
    entries = corpus_entries(data)
    for path, w in entries:
        if not math.isfinite(w) or w <= 0:
            raise ValueError(f"config field 'data': the weight of {_shown(path, True)} must be a finite number > 0, "
                             f"got {_shown(w)}")
    opened = []
    for path, _ in entries:
        if not is_prepared(path):
            raise ValueError(f"config field 'data': {_shown(path, True)} is not a prepared corpus (a folder with a "
                             f"{MANIFEST}): a list of corpora takes prepared corpora only; write one with "
                             f"`bst-fast tokenize TEXT --out DIR`")
        opened.append(PreparedCorpus.open(path))
    tok = {c.tokenizer_sha256 for c in opened}
    if len(tok) > 1:
        groups = {}
        for (path, _), c in zip(entries, opened):
            groups.setdefault(c.tokenizer_sha256[:12], []).append(path)
        raise ValueError("config field 'data': the corpora of a mixture must share one tokenizer, but their "
                         "tokenizer.json differ: " + "; ".join(f"{', '.join(map(str, paths))} (tokenizer sha256 {h}...)"
                                                           for h, paths in groups.items())
                         + "; tokenize them all with the same --tokenizer")
    parts = [prepared_text_data(c, max_len, held_out=held_out, seed=seed, pack=pack, max_doc_tokens=max_doc_tokens)
             for c in opened]
    if len(parts) == 1:
        return parts[0]
    try:
        return MixtureData(parts, [w for _, w in entries], names=[p for p, _ in entries], seed=seed)
    except ValueError as e:  # e.g. one corpus listed twice
        raise ValueError(f"config field 'data': {e}") from None


def _size(mb: float) -> str:
    """MB as text a person reads: a small corpus is not "0.0 MB" or "1e-05 MB", a large one not 1.92e+03."""
    return f"{mb:.1f} MB" if mb >= 1 else f"{mb * 1e3:.1f} kB" if mb >= 1e-3 else f"{mb * 1e6:.0f} bytes"


def print_summary(manifest: dict, out, seconds: float, file=None):
    """The line `bst-fast tokenize` prints when it is done."""
    trained = (manifest.get("tokenizer_origin") or {}).get("trained", {})  # a BPE trained here: what was asked
    shortfall = bpe_shortfall(trained.get("vocab_size", 0), manifest["vocab_size"],
                              "the --bpe-sample-mb sample" if trained.get("sample_bytes") is not None else "the text")
    mb = manifest["source"]["bytes"] / 1e6
    print(f"{out}: {manifest['documents']} documents, {manifest['tokens']} tokens ({manifest['dtype']}, "
          f"vocab {manifest['vocab_size']}) from {_size(mb)} of text in {seconds:.1f} s "
          f"(tokenising {_size(mb / max(manifest['seconds']['encode'], 1e-9))}/s)"
          + (f"; dropped {manifest['dropped_documents']} documents longer than {manifest['max_doc_tokens']} tokens"
             if manifest.get("max_doc_tokens") is not None else "")
          + (f"; dropped {manifest['empty_documents']} documents the tokenizer encodes to no token"
             if manifest.get("empty_documents") else "")
          + (f"; {shortfall}" if shortfall else ""), file=file or sys.stdout)
