"""Text corpora for BST training: a byte-level BPE tokenizer (HF `tokenizers`) and padded batches.

Documents: every *.txt file given (a folder is searched recursively, skipping hidden files and
folders such as .git or .ipynb_checkpoints, whose copies would straddle the split) is read as
UTF-8 (a leading byte-order mark is dropped; any other encoding is an error naming the file) and
split at blank lines (one or more lines holding only ASCII spaces, tabs, \r, \f or \v: a line of
U+00A0 or U+3000 is content; lines end at \n, so a file of \r-only line ends is one line, and a
CRLF file's \r stays in its documents); each block is stripped of leading and trailing whitespace
(Python's str.strip: Unicode spaces such as U+3000 too, so a paragraph's indent on its first line
goes, and a block of such spaces alone is empty) and each non-empty one is one document, so a file
without blank lines is a single document. A linked folder inside a folder is searched too. A document becomes rows
[BOS, x_1, ..., x_T, EOS] of at most max_len tokens: a longer one is cut into consecutive chunks
of max_len - 2 tokens, each wrapped in its own BOS/EOS (or, with max_doc_tokens, a document longer
than that is dropped). pack=True then packs these rows several to a row of max_len, pack="split"
joins them into one stream cut into rows of exactly max_len (packing.py).

The held-out split counts rows: round(held_out * rows) of them (at least one when held_out > 0
and there are two rows, never all). Whole documents are taken in a seeded order, each one that
still fits; if that falls short, the rest are the last rows of the next document that did not
fit (so a corpus of one document, a book, holds out its last rows). Only that one document is
both trained on and held out, in disjoint rows.

Memory: the corpus is read _READ_BYTES of a file at a time and tokenised a megabyte of text at a time
(encode.PieceEncoder: the tokenizer's own ids, faster) into one flat int32 array (4 bytes a token);
rows are (start, length) views of it, wrapped in BOS/EOS when batched. A prepared corpus
(prepared.py, `bst-fast tokenize`) holds the ids in a memory-mapped file instead (prepared.prepared_text_data).

Long runs: the byte-level pre-tokeniser keeps a word, a number or a run of punctuation whole (the
GPT-2 pattern), and HF tokenizers' BPE trainer takes time quadratic in the longest such pre-token (a
2 MB text without whitespace: minutes). A tokenizer from train_bpe therefore cuts every pre-token
longer than MAX_PRETOKEN bytes into consecutive pieces of MAX_PRETOKEN bytes (the last shorter).
The cut is part of the tokenizer (saved in its tokenizer.json), so training, TextData and any later
encode agree; text whose pre-tokens are all shorter (ordinary prose) is tokenised exactly as without
it. A tokenizer.json written before the cut existed is loaded as it is (its ids stay what they were).

Progress: reading and tokenising more than PROGRESS_BYTES of files shows a tqdm bar on stderr
(progress=None, the default; True or False forces it).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Set as AbstractSet
from pathlib import Path

import numpy as np
import torch

from .._checks import MAX_VOCAB, check_int, short
from .corpus_layout import is_prepared
from .packing import PackedRows, SplitRows, check_pack, padding_saved
from .star import _Batches, _epoch_indices

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 in a tokenizer from train_bpe
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
_SEPARATOR = re.compile(_BLANK_LINE.pattern.encode())  # the same, on bytes
_BLANKS = b" \t\r\f\v"
_BOM = b"\xef\xbb\xbf"
_READ_BYTES = 8 << 20  # bytes of a file read at a time
# Text per encode_batch call: HF tokenizers' Encoding objects and the Python id lists take about
# 100 bytes a token, so the corpus is encoded about a megabyte of text (~250k tokens) at a time.
_ENCODE_CHARS = 1 << 20
# The longest pre-token (in bytes) of a tokenizer from train_bpe; longer ones are cut (module
# docstring). BPE training costs about MAX_PRETOKEN x the corpus's length for a text without
# whitespace; 256 bytes keeps any English word, number or URL component whole, and about 85
# characters of CJK text (3 bytes each) without a space or punctuation.
MAX_PRETOKEN = 256
# Files larger than this in all (bytes) show a progress bar when read and tokenised.
PROGRESS_BYTES = 8 << 20
# Characters of a user's value quoted in an error message, at most.
_SHOWN = 200


def _shown(value, text: bool = False) -> str:
    """short(value) (a bounded repr), or with text=True str(value) (paths, names, messages), cut to
    _SHOWN characters: an error message never quotes a megabyte of the user's input."""
    try:
        if not text:
            s = short(value, _SHOWN)
        else:
            s = value[:_SHOWN + 1] if isinstance(value, str) else str(value)
    except Exception:  # e.g. an int too long to print (sys.set_int_max_str_digits)
        s = f"<{type(value).__name__}>"
    return s if len(s) <= _SHOWN else s[:_SHOWN - 3] + "..."


def path_list(paths) -> list:
    """The data paths as given (a path, or an ordered iterable of them: a list, a generator such as
    Path.glob) as a list, read once; a ValueError for anything else."""
    if isinstance(paths, (str, os.PathLike)):
        return [paths]
    expected = "a .txt file or a folder of them, or a list of those"
    # None was "'NoneType' object is not iterable"; a set's order (so the corpus's) changes with the hash seed
    if isinstance(paths, (bytes, Mapping, AbstractSet)) or not isinstance(paths, Iterable):
        raise ValueError(f"the data paths must be {expected}, got {type(paths).__name__} {_shown(paths)}")
    paths = list(paths)
    if not paths:
        raise ValueError(f"no data paths given: expected {expected}")
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise ValueError(f"the data paths must be {expected}; one is {type(p).__name__} {_shown(p)}")
    return paths


def _text_files(paths) -> list[Path]:
    paths = path_list(paths)
    files, prepared = [], {}  # prepared: is_prepared of each parent folder, read once (many files, one manifest)
    for p in map(Path, paths):
        # os.path's tests, not Path's: they answer False (not an OSError quoting it) for a path too
        # long for the system
        if os.path.isdir(p):
            found = _folder_files(p)
            if not found:
                if is_prepared(p):
                    raise FileNotFoundError(f"no *.txt files under {_shown(p, True)}: it is a prepared corpus "
                                            f"(bst-fast tokenize's output), already tokenised; give it as a run's "
                                            f"data, not as text to tokenise")
                hint = (" and no manifest.json: not a prepared corpus either (one without its manifest is "
                        "incomplete or corrupt; tokenize it again)") if os.path.exists(p / "tokens.bin") else ""
                raise FileNotFoundError(f"no *.txt files under {_shown(p, True)} (hidden files and folders are "
                                        f"skipped){hint}")
            files += found
        elif os.path.isfile(p):
            if p.parent not in prepared:
                prepared[p.parent] = is_prepared(p.parent)
            if prepared[p.parent]:  # its manifest or token file read as text would train on JSON or bytes
                raise ValueError(f"{_shown(p, True)} is a file of the prepared corpus {_shown(p.parent, True)}: "
                                 f"give the folder as data")
            files.append(p)
        elif os.path.exists(p):  # read as text it would block (a pipe), end at once or never (a device)
            raise ValueError(f"data path {_shown(p, True)} is {_special_kind(p)}, not a .txt file or a folder of them")
        else:
            raise FileNotFoundError(f"no such file or folder: {_shown(p, True)}")
    # A file reached twice (a folder and a file in it, or overlapping folders) would put its
    # documents twice into the corpus, perhaps on both sides of the held-out split.
    seen = {}
    for f in files:
        real = os.path.realpath(f)
        if real in seen:
            raise ValueError(f"the data paths reach one file twice, as {_shown(seen[real], True)} and {_shown(f, True)}: "
                             f"each file is read once (remove the overlap of the paths, or the link)")
        seen[real] = f
    return files


def _folder_files(root: Path) -> list[Path]:
    """The .txt files under `root`, sorted, hidden files and folders skipped. A linked folder inside
    it is read as a folder (Path.rglob does not enter one: `corpus/wiki -> /data/wiki` was left out,
    silently); a link to a folder on the walk's own path (a cycle) is refused, and a folder that
    cannot be read raises (os.walk skips it silently by default)."""
    found = []
    chains = {os.path.normpath(root): (os.path.realpath(root),)}  # each folder's real path and its ancestors'
    for top, dirs, names in os.walk(root, followlinks=True, onerror=_raise):
        chain = chains.pop(os.path.normpath(top))
        for d in list(dirs):
            if d.startswith("."):
                dirs.remove(d)
                continue
            there = os.path.realpath(os.path.join(top, d))
            chains[os.path.normpath(os.path.join(top, d))] = chain + (there,)
            if there in chain:
                raise ValueError(f"the data folder {_shown(root, True)} reaches a link cycle: "
                                 f"{_shown(os.path.join(top, d), True)} -> {_shown(there, True)}, a folder that "
                                 f"path is already inside")
        found += [Path(top) / n for n in names
                  if not n.startswith(".") and Path(n).suffix.lower() == ".txt" and os.path.isfile(os.path.join(top, n))]
    return sorted(found)


def _raise(error: OSError):
    raise error


def _special_kind(path) -> str:
    """What a path that is neither a file nor a folder is, in words."""
    import stat

    mode = os.stat(path).st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "neither a file nor a folder"


def iter_documents(paths):
    """The documents of a file, a folder or a list of them, in sorted file order, one file read at
    a time. The files are listed (and a missing one reported) before the first is read."""
    return _documents(_text_files(paths))


def _documents(files, bar=None):
    """The documents of `files` (a list of files), each file read _READ_BYTES at a time (memory:
    a read and the document it is in, whatever the file's size); `bar` (a tqdm or None) advances
    by the bytes read. The same documents as splitting each whole decoded file at _BLANK_LINE: the
    separator is ASCII, so it is found in the bytes (UTF-8 never holds an ASCII byte inside a
    character), and a match cannot reach past its closing newline."""
    for f in files:
        yield from _file_documents(f, bar)


def _file_documents(path, bar):
    buf, offset, checked = bytearray(), 0, False  # unread text, its position in the file, BOM looked for
    # the blanks ending buf, counted as it grows: a long run of them is walked once, not at each
    # read (walking back over it at every read took minutes for 256 MB of spaces)
    blank_tail = 0
    with open(path, "rb") as fh:
        while True:
            chunk = fh.read(_READ_BYTES)
            if bar is not None:
                bar.update(len(chunk))
            # a separator that began in the unread text starts at its last newline followed only
            # by blanks; none starts before that
            scan = len(buf) - blank_tail
            scan = scan - 1 if scan and buf[scan - 1] == 10 else len(buf)
            buf += chunk
            content = len(chunk.rstrip(_BLANKS))
            blank_tail = blank_tail + len(chunk) if content == 0 else len(chunk) - content
            if not checked:  # utf-8-sig: a leading byte-order mark is dropped
                if chunk and len(buf) < len(_BOM):
                    continue
                checked, scan = True, 0
                if buf.startswith(_BOM):
                    del buf[:len(_BOM)]
                    offset = len(_BOM)
                    blank_tail = min(blank_tail, len(buf))
            if not chunk:
                yield from _block(path, buf, offset)
                return
            if b"\n" not in chunk:  # a separator ends in a newline: none ends in this chunk, and the text
                continue            # before it holds none (searched), so a long blank run is searched once
            pos = 0
            for m in _SEPARATOR.finditer(buf, scan):
                yield from _block(path, buf[pos:m.start()], offset + pos)
                pos = m.end()
            if pos:
                del buf[:pos]
                offset += pos
                blank_tail = min(blank_tail, len(buf))


def _block(path, raw, at):
    """The document of the bytes `raw` (at byte `at` of file `path`): none if it is blank."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{_shown(path, True)}: not UTF-8 text (byte {at + e.start}: "
                         f"{bytes(raw[e.start:e.start + 4])!r}); convert it to UTF-8, or give token ids "
                         f"to TextData.from_ids") from None
    text = text.strip()
    if text:
        yield text


def _progress_bar(files, progress, desc: str):
    """A tqdm bar on stderr over the bytes of `files`, or None: progress=None shows one when they
    hold more than PROGRESS_BYTES (tests and small runs stay quiet)."""
    total = sum(f.stat().st_size for f in files)
    if progress is None:
        progress = total > PROGRESS_BYTES
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True)


def _pre_tokenizer():
    """Byte-level pre-tokens (the GPT-2 pattern, no prefix space), each cut into pieces of at most
    MAX_PRETOKEN bytes (module docstring). The cut works on the byte-level form (one character a
    byte), so it may fall inside a UTF-8 character; the byte-level decoder joins the bytes again."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.ByteLevel(add_prefix_space=False),
        pre_tokenizers.Split(Regex(rf"[\s\S]{{1,{MAX_PRETOKEN}}}"), behavior="isolated"),
    ])


def check_vocab_size(name: str, value, specials: int = len(SPECIAL_TOKENS)) -> int:
    """`value` as a BPE vocabulary size: an int from 256 byte tokens + `specials` to MAX_VOCAB; a
    ValueError naming `name` (vocab_size, --vocab) otherwise."""
    least = 256 + specials
    try:
        v = check_int(name, value, least)
    except ValueError:
        v = None
    if v is None or v > MAX_VOCAB:
        raise ValueError(f"{name} must be an int from {least} (256 byte tokens + {specials} specials) to {MAX_VOCAB} "
                         f"(HF tokenizers' trainer reserves memory for every entry up front), got {_shown(value)}")
    return v


def train_bpe(paths, vocab_size: int = 1000, special_tokens=SPECIAL_TOKENS, progress=None,
              sample_bytes: int | None = None):
    """A byte-level BPE tokenizer trained on the documents of `paths` (the paper: vocab 1000).

    Byte level: any text encodes, with no unknown token. The specials get ids 0.. in order, so the
    default gives PAD=0, BOS=1, EOS=2. Pre-tokens longer than MAX_PRETOKEN bytes are cut (module
    docstring), which keeps training near-linear in the corpus's size. progress: a bar on stderr
    (None: only for more than PROGRESS_BYTES of files). sample_bytes: train on documents spread
    evenly over the corpus, about this many bytes of them (None, or at least the corpus: all): each
    document kept with probability sample_bytes / the files' bytes, long and short alike.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = list(special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab_size = check_vocab_size("vocab_size", vocab_size, len(special_tokens))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=alphabet, show_progress=False)
    files = _text_files(paths)
    if sample_bytes is not None:
        sample_bytes = check_int("sample_bytes", sample_bytes, 1)
    bar = _progress_bar(files, progress, "training the BPE tokenizer")
    try:
        docs = _documents(files, bar)
        total = sum(f.stat().st_size for f in files)
        if sample_bytes is not None and sample_bytes < total:
            docs = _spread_sample(docs, sample_bytes / total)
            first = next(docs, None)
            if first is None:  # the tokenizer would hold the bytes and specials only, learnt from nothing
                raise ValueError(f"sample_bytes {sample_bytes} (tokenize's --bpe-sample-mb) of the corpus's {total} "
                                 f"bytes sampled no document to train the BPE on: give a larger sample, or none "
                                 f"(the whole corpus)")
            docs = itertools.chain([first], docs)
        try:
            _interruptible(lambda: tok.train_from_iterator(docs, trainer=trainer))
        except BaseException as e:
            # a Rust panic reaches Python as pyo3_runtime.PanicException, a BaseException that no
            # caller's `except Exception` (or the CLI's) catches: a traceback, exit 1
            if type(e).__name__ != "PanicException":
                raise
            raise ValueError(f"HF tokenizers' BPE trainer failed (vocab_size {vocab_size}, "
                             f"{len(special_tokens)} special tokens): {_shown(str(e), True)}") from None
    finally:
        if bar is not None:
            bar.close()
    return _text_only(tok)


def _interruptible(work):
    """work() on a worker thread while the main thread waits. HF's BPE trainer releases the GIL but
    never checks for signals: on the main thread a Ctrl-C (or any Python signal handler) took effect
    only when its merges ended, seconds to minutes later. Now the main thread's handlers run within
    0.1 s, and the exception they raise leaves the worker (a daemon) to finish unseen, its result
    dropped, or to end with the process. Off the main thread, where no signal
    handler runs, work() runs in place. An exception of work() is raised here."""
    if threading.current_thread() is not threading.main_thread():
        return work()
    box, done = {}, threading.Event()

    def run():
        try:
            box["result"] = work()
        except BaseException as e:  # a PanicException too: the caller turns it into a ValueError
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="bst_fast-bpe-trainer", daemon=True).start()
    # an Event, not join(timeout): a join cut by the handler's exception marks the running thread
    # as stopped (CPython's _wait_for_tstate_lock releases its lock)
    while not done.wait(0.1):
        pass
    if "error" in box:
        raise box["error"]
    return box["result"]


def _spread_sample(documents, rate: float):
    """Documents holding about `rate` of the characters, spread evenly: each kept with probability
    `rate` whatever its length, by a fixed-seed draw (every process, so every DDP rank, keeps the
    same). Keeping a document once the characters owed covered it, as before, kept short documents
    far more often than long ones: at rate 0.02, 98% of a sample from 2% of the text."""
    draw = random.Random(0).random
    for doc in documents:
        if draw() < rate:
            yield doc


def save_tokenizer(tokenizer, path) -> None:
    """Write the tokenizer as one JSON file."""
    tokenizer.save(str(path))


def load_tokenizer(path):
    """Read a tokenizer written by save_tokenizer (or any HF tokenizers JSON file holding the
    <pad>, <bos> and <eos> tokens). A missing file is a FileNotFoundError; a folder, a file that is
    not JSON, JSON that is not a tokenizer, or a tokenizer without those tokens a ValueError naming
    the file."""
    from tokenizers import Tokenizer

    path = Path(path)
    expected = ("expected a tokenizer.json written by bst_fast (a HF tokenizers JSON file with the "
                + ", ".join(SPECIAL_TOKENS) + " tokens)")
    where = _shown(path, True)
    if os.path.isdir(path):
        raise ValueError(f"{where} is a folder; {expected}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such tokenizer file: {where}; {expected}")
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start}), so not a tokenizer.json; {expected}") from None
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({_shown(e.strerror or e, True)}); {expected}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"{expected}") from None
    if not isinstance(obj, dict) or "model" not in obj:
        raise ValueError(f"{where}: JSON that is not a tokenizer (no \"model\" in it); {expected}")
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # HF tokenizers raises a bare Exception
        raise ValueError(f"{where}: not a HF tokenizers JSON ({_shown(str(e), True)}); {expected}") from None
    missing = [name for name in SPECIAL_TOKENS if tok.token_to_id(name) is None]
    if missing:
        raise ValueError(f"{where}: the tokenizer has no {', '.join(missing)} token"
                         f"{'s' if len(missing) > 1 else ''}; {expected}")
    return _text_only(tok, where)


def vocabulary_size(tokenizer) -> int:
    """The model's vocabulary for `tokenizer`: its largest id + 1. (get_vocab_size counts the ids;
    a tokenizer whose ids skip numbers has ids at or above that count.)"""
    return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def bpe_shortfall(asked: int, got: int, source: str = "the text", field: str = "") -> str:
    """The note for a BPE that found fewer entries than `asked` (by `field`, if named) in `source`,
    too few distinct pieces of text to merge: the model's vocabulary is `got`. '' if none."""
    if got >= asked:
        return ""
    return (f"a BPE of vocab {asked}{f' ({field})' if field else ''} was asked for, and {source} had merges for "
            f"{got} only (too few distinct pieces of text): the model's vocabulary is {got}")


def _text_only(tokenizer, where: str = "tokenizer"):
    """The tokenizer set to encode '<pad>', '<bos>' or '<eos>' written in a text as that text:
    otherwise HF tokenizers matches them in the input and a document would hold special ids (the
    specials are added by id, never by text). The setting is not saved in tokenizer.json, and it
    covers special tokens only: the three must be special added tokens (train_bpe's are), else
    their text is still matched, so another tokenizer is refused, naming it as `where`. Padding
    and truncation, which a tokenizer.json may hold, are turned off: a document is encoded whole
    (rows are cut here) and never padded (PAD would become content and a training label)."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    plain = [name for name in SPECIAL_TOKENS if name not in special]
    if plain:
        raise ValueError(f"{where}: {', '.join(plain)} must be {'special added tokens' if len(plain) > 1 else 'a special added token'} "
                         "(special=True, as train_bpe makes them): otherwise a document's text '<eos>' would "
                         "encode as the EOS id")
    tokenizer.encode_special_tokens = True
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def check_no_special_ids(flat: np.ndarray, tokenizer, where: str = "tokenizer"):
    """A document's ids hold none of PAD, BOS and EOS. _text_only stops the tokenizer matching the
    specials' text as added tokens, but a model whose own vocabulary holds '<eos>' as a word (a
    WordLevel or WordPiece one) still encodes '<eos>' written in a document as the EOS id: such a
    row would end mid-document. One pass over each batch's ids."""
    ids = {tokenizer.token_to_id(name): name for name in SPECIAL_TOKENS}
    hit = np.flatnonzero(np.isin(flat, list(ids)))
    if hit.size:
        v = int(flat[hit[0]])
        raise ValueError(f"{where}: documents' text encodes as special ids ({hit.size} in this batch, the first {v}, "
                         f"{ids[v]}): the tokenizer's model has {ids[v]!r} in its vocabulary, so text would become "
                         "PAD/BOS/EOS; use a tokenizer whose model cannot produce the special ids (train_bpe's)")


def _encode_documents(tokenizer, documents) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 ids of every document, each document's length (n_docs,) int64), encoded
    about _ENCODE_CHARS characters at a time (PieceEncoder: the ids encode_batch gives); no
    special id among them (check_no_special_ids)."""
    from .encode import PieceEncoder

    encoder = PieceEncoder(tokenizer, np.int32)
    parts, lengths = [], []
    for batch in _doc_batches(documents, _ENCODE_CHARS):
        flat, n = encoder.encode(batch)
        check_no_special_ids(flat, tokenizer)
        parts.append(flat)
        lengths.append(n)
    # copied part by part into one array, each part freed once copied: its pages are written as they
    # are filled, so the peak stays near the ids' 4 bytes a token (a concatenate held both, 7.8)
    flat, at = np.empty(sum(len(p) for p in parts), np.int32), 0
    for k in range(len(parts)):
        part, parts[k] = parts[k], None
        flat[at:at + len(part)] = part
        at += len(part)
    return flat, (np.concatenate(lengths) if lengths else np.empty(0, np.int64))


def _doc_batches(documents, chars: int):
    """Lists of consecutive documents of about `chars` characters (at least one document each)."""
    batch, n = [], 0
    for doc in documents:
        batch.append(doc)
        n += len(doc)
        if n >= chars:
            yield batch
            batch, n = [], 0
    if batch:
        yield batch


def load_ids(path) -> list[np.ndarray]:
    """Documents of token ids from a .npy or .pt file: a 1-D array is one document, a 2-D array
    one document per row, a .pt list one document per entry; each in the file's integer dtype (an
    empty one may be float)."""
    path = Path(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {_shown(path, True)}")
    if path.suffix == ".npy":
        obj = np.load(path, allow_pickle=False)
    elif path.suffix == ".pt":
        obj = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{_shown(path, True)}: expected a .npy or .pt file of token ids")
    return _as_rows(obj, _shown(path, True))


def _as_rows(obj, source: str) -> list[np.ndarray]:
    if isinstance(obj, torch.Tensor):
        obj = obj.numpy()
    if isinstance(obj, np.ndarray) and obj.ndim in (1, 2):
        rows = [obj] if obj.ndim == 1 else list(obj)
    elif isinstance(obj, (list, tuple)):
        rows = [r.numpy() if isinstance(r, torch.Tensor) else np.asarray(r) for r in obj]
    else:
        raise ValueError(f"{source}: expected a 1-D/2-D array or a list of id sequences, "
                         f"got {type(obj).__name__}")
    for r, row in enumerate(rows):
        if row.ndim != 1 or not (row.dtype.kind in "iu" or row.size == 0):
            raise ValueError(f"{source}: row {r} must be a 1-D sequence of integer ids, "
                             f"got dtype {row.dtype} and shape {row.shape}")
        if row.dtype == np.uint64 and row.size and int(row.max()) >= 2**63:  # past int64: in no vocabulary (nor int32)
            i = int(row.argmax())
            raise ValueError(f"{source}: token id {int(row[i])} at row {r}, index {i} is outside any vocabulary "
                             f"(ids are stored as int32)")
    return rows  # in their own dtypes: _flat_ids copies them once, into int32


_GROUP_IDS = 1 << 20  # ids checked and copied at a time by _flat_ids


def _flat_ids(rows: list[np.ndarray], vocab_size: int, specials: dict, source: str):
    """(flat int32 ids of `rows` back to back, each row's length (n,) int64), every id checked to be
    in the vocabulary and none of `specials` ({name: id}: content holds no PAD, BOS or EOS, which
    are added around it). Rows are read about _GROUP_IDS ids at a time, in their own dtype: the
    peak is the int32 result and a group, not int64 copies of the whole corpus (about 20 bytes a
    token before, traced)."""
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.empty(int(lengths.sum()), dtype=np.int32)

    def where(at):  # (row, index) of flat position at
        r = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        return r, at - int(lengths[:r].sum())

    def check_and_copy(group, lo, hi):
        if len({g.dtype for g in group}) > 1:  # mixed kinds would promote to float64
            group = [g.astype(np.int64) for g in group]
        ids = np.concatenate(group) if len(group) > 1 else group[0]
        outside = (ids < 0) | (ids >= vocab_size)
        bad = outside | np.isin(ids, list(specials.values()))
        if bad.any():  # the first bad id, whichever its kind
            at = int(bad.argmax())
            r, i = where(lo + at)
            v = int(ids[at])
            if outside[at]:
                raise ValueError(f"{source}: token id {v} at row {r}, index {i} is outside the vocabulary "
                                 f"0..{vocab_size - 1}")
            name = next(k for k, s in specials.items() if s == v)
            raise ValueError(f"{source}: token id {v} at row {r}, index {i} is {name}: a document holds content "
                             f"ids only (PAD, BOS and EOS are added around it); split an EOS-joined stream of "
                             f"documents at its EOS ids into one row each")
        flat[lo:hi] = ids

    # rows cut into pieces of at most a group (a 1-D array is one long document), gathered into groups
    group, lo, hi = [], 0, 0
    for row in rows:
        for a in range(0, len(row), _GROUP_IDS):
            group.append(row[a:a + _GROUP_IDS])
            hi += len(group[-1])
            if hi - lo >= _GROUP_IDS:
                check_and_copy(group, lo, hi)
                group, lo = [], hi
    if group:
        check_and_copy(group, lo, hi)
    return flat, lengths


class _Rows:
    """Rows as (start, size) views of one flat int32 array of content ids, gathered into padded
    [BOS, content, EOS] batches."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray, sizes: np.ndarray, pad_id, bos_id, eos_id):
        self.flat, self.starts, self.sizes = flat, starts, sizes
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        # (vocab_size, source): ids read from a file not checked whole (a prepared corpus's
        # memory-mapped tokens) are checked as they are gathered
        self.limit = None

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def lengths(self) -> np.ndarray:
        """(rows,) int64: every row's length, BOS and EOS included."""
        return self.sizes + 2

    def read(self, at) -> np.ndarray:
        """The content ids at positions `at` of the flat array (checked against self.limit)."""
        ids = self.flat[at]
        if self.limit is not None and len(ids):
            if int(ids.max()) >= self.limit[0]:
                k = int(np.argmax(ids >= self.limit[0]))
                raise ValueError(f"{self.limit[1]}: token id {int(ids[k])} is outside the vocabulary "
                                 f"0..{self.limit[0] - 1} (the token file is corrupt; tokenize the corpus again)")
            special = (ids == self.pad_id) | (ids == self.bos_id) | (ids == self.eos_id)
            if special.any():  # a corpus tokenised before tokenize refused them (stop 41), in a block not verified
                v = int(ids[int(special.argmax())])
                raise ValueError(f"{self.limit[1]}: token id {v} inside a document is a special id (PAD, BOS or "
                                 f"EOS): the corpus was tokenised by a tokenizer whose model encodes text as "
                                 f"them; tokenize it again with one that cannot (train_bpe's)")
        return ids

    def gather(self, index):
        """(tokens (B, L_max) int64 padded with PAD, lengths (B,) int64) of rows `index`."""
        index = np.asarray(index, dtype=np.int64)
        sizes = self.sizes[index]                                        # (B,)
        width = int(sizes.max(initial=0))
        out = np.full((len(index), width + 2), self.pad_id, dtype=np.int64)
        out[:, 0] = self.bos_id
        col = np.arange(width)
        inside = col[None, :] < sizes[:, None]                           # (B, width)
        out[:, 1:width + 1][inside] = self.read((self.starts[index, None] + col)[inside])
        out[np.arange(len(index)), sizes + 1] = self.eos_id
        return torch.from_numpy(out), torch.from_numpy(sizes + 2)        # (B, L_max), (B,)


class TextData(_Batches):
    """Tokenised documents split into train / held-out rows of at most max_len tokens.

    Rows are [BOS, x..., EOS] (see the module docstring for the split); batches are padded with
    PAD and carry their lengths (docs/contract.md §1). pack=True packs those rows, train and
    held-out apart, into rows of max_len, pack="split" cuts them, joined, into rows of exactly
    max_len (packing.py): batches are then (tokens, lengths, documents). max_doc_tokens drops the
    documents longer than that many tokens (None or 0: none; a document longer than a row is otherwise
    cut into rows).
    """

    def __init__(self, paths, tokenizer, max_len: int, held_out: float = 0.05, seed: int = 0,
                 progress=None, pack: bool | str = False, max_doc_tokens: int | None = None):
        """progress: a bar on stderr while the corpus is tokenised (None: only for more than
        PROGRESS_BYTES of files)."""
        max_len, held_out, seed = _check_split(max_len, held_out, seed)  # before reading anything
        check_pack(pack)
        if not (hasattr(tokenizer, "token_to_id") and hasattr(tokenizer, "to_str")):
            raise ValueError(f"tokenizer must be a tokenizers.Tokenizer (load_tokenizer(path) reads one from a file, "
                             f"train_bpe trains one), got {type(tokenizer).__name__} {short(tokenizer)}")
        ids = {}
        for name in SPECIAL_TOKENS:
            ids[name] = tokenizer.token_to_id(name)
            if ids[name] is None:
                raise ValueError(f"tokenizer has no {name} token (train it with train_bpe)")
        from tokenizers import Tokenizer

        # A copy: the caller's tokenizer keeps its own padding/truncation settings.
        encoder = _text_only(Tokenizer.from_str(tokenizer.to_str()))
        files = _text_files(paths)
        bar = _progress_bar(files, progress, "tokenising the corpus")
        try:
            flat, doc_lengths = _encode_documents(encoder, _documents(files, bar))
        finally:
            if bar is not None:
                bar.close()
        self.tokenizer = tokenizer
        self._build(flat, doc_lengths, vocabulary_size(tokenizer), ids["<pad>"], ids["<bos>"],
                    ids["<eos>"], max_len, held_out, seed, pack=pack, max_doc_tokens=max_doc_tokens)

    @classmethod
    def from_ids(cls, rows, vocab_size: int, source_name: str | None = None, *,
                 max_len: int | None = None, held_out: float = 0.05, seed: int = 0,
                 pad_id: int = 0, bos_id: int = 1, eos_id: int = 2, pack: bool | str = False,
                 max_doc_tokens: int | None = None) -> "TextData":
        """Pre-tokenised documents: `rows` is a path to a .npy/.pt file (see load_ids), an array,
        or a list of id sequences, one document each, holding content ids only (BOS/EOS are
        added here). Any id outside 0..vocab_size-1, or equal to pad_id, bos_id or eos_id, raises a
        ValueError naming the source and the (row, index) of the first one (an EOS-joined stream,
        the official pre-tokenised layout, is split at its EOS ids into one document each first).
        max_len=None keeps documents whole; pack, max_doc_tokens: as TextData takes them."""
        vocab_size = check_int("vocab_size", vocab_size, 1)
        # before a file is read; max_len None is replaced below by the longest document's
        checked_len, held_out, seed = _check_split(3 if max_len is None else max_len, held_out, seed)
        check_pack(pack)
        if isinstance(rows, (str, Path)):
            source_name = source_name or _shown(rows, True)
            rows = load_ids(rows)
        source_name = _shown(source_name or "ids", True)
        rows = _as_rows(rows, source_name)
        if not 1 <= vocab_size <= 2**31:  # the rows are stored as int32
            raise ValueError(f"vocab_size must lie in [1, 2**31] (ids are stored as int32), got {_shown(vocab_size)}")
        for name, v in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if not 0 <= check_int(name, v, 0) < vocab_size:
                raise ValueError(f"{name}={_shown(v)} is outside the vocabulary 0..{vocab_size - 1}")
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(f"pad_id, bos_id and eos_id must differ, got {pad_id}, {bos_id}, {eos_id}")
        flat, lengths = _flat_ids(rows, vocab_size, {f"pad_id ({pad_id})": pad_id, f"bos_id ({bos_id})": bos_id,
                                                     f"eos_id ({eos_id})": eos_id}, source_name)
        del rows
        # (empty documents are dropped, and none left is an error, below)
        max_len = checked_len if max_len is not None else int(max(lengths.max(initial=0), 1)) + 2
        self = cls.__new__(cls)
        self.tokenizer = None
        self._build(flat, lengths, vocab_size, pad_id, bos_id, eos_id, max_len, held_out, seed, pack=pack,
                    max_doc_tokens=max_doc_tokens)
        return self

    _prepared = None  # the PreparedCorpus of prepared.prepared_text_data

    @property
    def dropped_when_tokenised(self) -> int:
        """Documents `bst-fast tokenize` dropped (its own max_doc_tokens) before a prepared corpus was
        written; 0 for text (dropped_documents counts the drops of this object's max_doc_tokens)."""
        return int(self._prepared.manifest.get("dropped_documents") or 0) if self._prepared is not None else 0

    def _build(self, flat, doc_lengths, vocab_size, pad_id, bos_id, eos_id, max_len, held_out, seed,
               pack=False, max_doc_tokens=None, limit=None):
        """The rows of the documents `doc_lengths` of `flat`; limit: (vocab_size, source) when the
        ids are checked as batches gather them (_Rows.limit)."""
        offsets = np.concatenate([[0], np.cumsum(doc_lengths)])[:-1]
        kept = doc_lengths > 0
        self.dropped_documents = 0  # longer than max_doc_tokens
        # 0 keeps every document, as the config's max_doc_tokens 0 does
        if max_doc_tokens is not None and check_int("max_doc_tokens", max_doc_tokens, 0):
            long = doc_lengths > max_doc_tokens
            self.dropped_documents = int(long.sum())
            kept &= ~long
        if not kept.all():
            offsets, doc_lengths = offsets[kept], doc_lengths[kept]
        if not len(doc_lengths):
            raise ValueError(f"no documents ({self.dropped_documents} longer than max_doc_tokens={max_doc_tokens}, "
                             f"the others empty)" if self.dropped_documents else "no documents (every input was empty)")
        self.vocab_size, self.max_len, self.seed = int(vocab_size), max_len, seed
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)
        self._flat, self._doc_lengths = flat, doc_lengths
        # Rows: consecutive chunks of `content` ids of each document, in document order.
        content = max_len - 2
        doc_rows = -(-doc_lengths // content)                     # rows of each document
        first = np.concatenate([[0], np.cumsum(doc_rows)])        # its first row; first[-1] = rows
        # (in place where it can: a few arrays of 8 bytes a row at a time, for corpora of millions of rows)
        doc = np.repeat(np.arange(len(doc_rows)), doc_rows)       # the document of each row
        k = np.arange(first[-1])
        k -= first[doc]                                           # the row's chunk in its document
        k *= content                                              # and its first id there
        starts = offsets[doc]
        starts += k
        sizes = doc_lengths[doc]
        del doc
        sizes -= k
        del k
        np.minimum(sizes, content, out=sizes)
        held = _held_out_rows(doc_rows, first, held_out, seed)
        self._train = _Rows(flat, starts[~held], sizes[~held], self.pad_id, self.bos_id, self.eos_id)
        self._held = _Rows(flat, starts[held], sizes[held], self.pad_id, self.bos_id, self.eos_id)
        self._train.limit = self._held.limit = limit
        self.pack = check_pack(pack)
        self.packed = bool(pack)  # batches carry documents
        if pack:  # the split is the unpacked rows': packing changes no row's side
            rows = SplitRows if pack == "split" else PackedRows
            self._train, self._held = rows(self._train, max_len), rows(self._held, max_len)
        self._perm_cache = (None, None)

    @property
    def n_train(self) -> int:
        return len(self._train)

    @property
    def n_held_out(self) -> int:
        return len(self._held)

    @property
    def held_out_lengths(self) -> torch.Tensor:
        """(n_held_out,) int64: every held-out row's length, BOS and EOS included."""
        return torch.from_numpy(self._held.lengths)

    def padding(self, batch_size: int) -> tuple[float, float]:
        """(unpacked, packed): the share of padding in an epoch of training batches of the unpacked
        rows and of the packed (or split) ones (packing.padding_saved; the same twice when not packed)."""
        return padding_saved([self._train], batch_size, self.seed)

    @property
    def n_documents(self) -> int:
        return len(self._doc_lengths)

    def fingerprint(self) -> dict:
        """Documents, tokens and a SHA-256 of the ids and document lengths: equal exactly when the
        rows, and so the split and every batch, are (given max_len, held_out and seed). A prepared
        corpus's SHA-256 is its manifest's fingerprint (the hashes of its files), read, not computed."""
        if self._prepared is not None:
            return {"documents": self.n_documents, "tokens": int(self._doc_lengths.sum()),
                    "sha256": self._prepared.fingerprint, "format": "prepared"}
        h = hashlib.sha256(self._doc_lengths.astype("<i8").tobytes())
        h.update(self._flat.astype("<i4", copy=False).data)  # no copy of the corpus
        return {"documents": self.n_documents, "tokens": int(self._doc_lengths.sum()), "sha256": h.hexdigest()}

    def batch(self, step: int, batch_size: int, seed: int):
        """Training batch `step`: (tokens (B, L_max) int64 padded with PAD, lengths (B,) int64),
        L_max the longest row in the batch, and packed, documents (B, L_max) int64 (packing.py).
        Epoch-wise seeded permutation (full batches only), so it is a pure function of (step,
        batch_size, seed)."""
        index = _epoch_indices(self, self.n_train, step, batch_size, seed)
        return self._train.gather(index.numpy())

    def held_out_batches(self, batch_size: int):
        """Every held-out row once, in order, as (tokens, lengths) batches, packed (tokens, lengths,
        documents) (the last may be short)."""
        batch_size = check_int("batch_size", batch_size, 1)
        for lo in range(0, self.n_held_out, batch_size):
            yield self._held.gather(np.arange(lo, min(lo + batch_size, self.n_held_out)))


def _check_split(max_len, held_out, seed):
    max_len, seed = check_int("max_len", max_len, 3), check_int("seed", seed, 0)  # BOS, a token, EOS
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float, np.floating)) or not 0 <= held_out < 1:
        raise ValueError(f"held_out must be a fraction in [0, 1), got {_shown(held_out)}")
    return max_len, float(held_out), seed


def _held_out_rows(doc_rows: np.ndarray, first: np.ndarray, held_out: float, seed: int) -> np.ndarray:
    """(rows,) bool: the held-out rows of the module docstring's rule."""
    rows = int(first[-1])
    held = np.zeros(rows, dtype=bool)
    target = min(max(int(round(held_out * rows)), 1), rows - 1) if held_out > 0 else 0
    left, partial = target, None
    for d in np.random.default_rng([seed, 0]).permutation(len(doc_rows)) if target else ():
        if doc_rows[d] <= left:
            held[first[d]:first[d + 1]] = True
            left -= int(doc_rows[d])
            if not left:
                break
        elif partial is None:
            partial = d
    if left:  # the last rows of the first document that did not fit (it has more than `left`)
        held[first[partial + 1] - left:first[partial + 1]] = True
    return held
