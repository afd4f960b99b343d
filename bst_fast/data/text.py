"""Text corpora for BST training: a byte-level BPE tokenizer (HF `tokenizers`) and padded batches.

Documents: every *.txt file given (a folder is searched recursively, skipping hidden files and
folders such as .git or .ipynb_checkpoints, whose copies would straddle the split) is read as
UTF-8 (a leading byte-order mark is dropped; any other encoding is an error naming the file) and
split at blank lines (one or more lines holding only whitespace); each non-empty block is one
document, so a file without blank lines is a single document. A document becomes rows
[BOS, x_1, ..., x_T, EOS] of at most max_len tokens: a longer one is cut into consecutive chunks
of max_len - 2 tokens, each wrapped in its own BOS/EOS.

The held-out split counts rows: round(held_out * rows) of them (at least one when held_out > 0
and there are two rows, never all). Whole documents are taken in a seeded order, each one that
still fits; if that falls short, the rest are the last rows of the next document that did not
fit (so a corpus of one document, a book, holds out its last rows). Only that one document is
both trained on and held out, in disjoint rows.

Memory: the corpus is read a file at a time and tokenised a megabyte of text at a time into one flat int32 array
(4 bytes a token); rows are (start, length) views of it, wrapped in BOS/EOS when batched.
"""
from __future__ import annotations

import hashlib
import itertools
import re
from pathlib import Path

import numpy as np
import torch

from .._checks import check_int
from .star import _Batches, _epoch_indices

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 in a tokenizer from train_bpe
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")
# Text per encode_batch call: HF tokenizers' Encoding objects and the Python id lists take about
# 100 bytes a token, so the corpus is encoded about a megabyte of text (~250k tokens) at a time.
_ENCODE_CHARS = 1 << 20


def _text_files(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix.lower() == ".txt" and q.is_file()
                           and not any(part.startswith(".") for part in q.relative_to(p).parts))
            if not found:
                raise FileNotFoundError(f"no *.txt files under {p} (hidden files and folders are skipped)")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def iter_documents(paths):
    """The documents of a file, a folder or a list of them, in sorted file order, one file read at
    a time. The files are listed (and a missing one reported) before the first is read."""
    files = _text_files(paths)

    def documents():
        for f in files:
            raw = f.read_bytes()
            try:
                text = raw.decode("utf-8-sig")  # drops a byte-order mark, strict otherwise
            except UnicodeDecodeError as e:
                raise ValueError(f"{f}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                                 f"convert it to UTF-8, or give token ids to TextData.from_ids") from None
            for block in _BLANK_LINE.split(text):
                block = block.strip()
                if block:
                    yield block
    return documents()


def train_bpe(paths, vocab_size: int = 1000, special_tokens=SPECIAL_TOKENS):
    """A byte-level BPE tokenizer trained on the documents of `paths` (the paper: vocab 1000).

    Byte level: any text encodes, with no unknown token. The specials get ids 0.. in order, so the
    default gives PAD=0, BOS=1, EOS=2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special_tokens = list(special_tokens)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(f"vocab_size must be >= {len(alphabet) + len(special_tokens)} "
                         f"(256 bytes + {len(special_tokens)} specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(iter_documents(paths), trainer=trainer)
    return _text_only(tok)


def save_tokenizer(tokenizer, path) -> None:
    """Write the tokenizer as one JSON file."""
    tokenizer.save(str(path))


def load_tokenizer(path):
    """Read a tokenizer written by save_tokenizer (or any HF tokenizer.json)."""
    from tokenizers import Tokenizer

    return _text_only(Tokenizer.from_file(str(path)))


def _text_only(tokenizer):
    """The tokenizer set to encode '<pad>', '<bos>' or '<eos>' written in a text as that text:
    otherwise HF tokenizers matches them in the input and a document would hold special ids (the
    specials are added by id, never by text). The setting is not saved in tokenizer.json. Padding
    and truncation, which a tokenizer.json may hold, are turned off: a document is encoded whole
    (rows are cut here) and never padded (PAD would become content and a training label)."""
    tokenizer.encode_special_tokens = True
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _encode_documents(tokenizer, documents) -> tuple[np.ndarray, np.ndarray]:
    """(flat int32 ids of every document, each document's length (n_docs,) int64), encoded
    about _ENCODE_CHARS characters at a time."""
    parts, lengths, batch, chars = [], [], [], 0

    def flush():
        ids = [e.ids for e in tokenizer.encode_batch(batch, add_special_tokens=False)]
        lengths.extend(map(len, ids))
        parts.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32,
                                 count=sum(map(len, ids))))
        batch.clear()
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if chars >= _ENCODE_CHARS:
            flush()
            chars = 0
    flush()
    flat = np.concatenate(parts) if parts else np.empty(0, np.int32)
    return flat, np.array(lengths, dtype=np.int64)


def load_ids(path) -> list[np.ndarray]:
    """Documents of token ids from a .npy or .pt file: a 1-D array is one document, a 2-D array
    one document per row, a .pt list one document per entry."""
    path = Path(path)
    if path.suffix == ".npy":
        obj = np.load(path, allow_pickle=False)
    elif path.suffix == ".pt":
        obj = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: expected a .npy or .pt file of token ids")
    return _as_rows(obj, str(path))


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
    return [row.astype(np.int64) for row in rows]


def _check_vocab(rows: list[np.ndarray], vocab_size: int, source: str) -> None:
    if not 1 <= vocab_size <= 2**31:  # the rows are stored as int32
        raise ValueError(f"vocab_size must lie in [1, 2**31] (ids are stored as int32), got {vocab_size}")
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    flat = np.concatenate(rows) if rows else np.empty(0, dtype=np.int64)
    bad = np.flatnonzero((flat < 0) | (flat >= vocab_size))
    if len(bad):
        at = int(bad[0])
        r = int(np.searchsorted(np.cumsum(lengths), at, side="right"))
        i = at - int(lengths[:r].sum())
        raise ValueError(f"{source}: token id {int(flat[at])} at row {r}, index {i} is outside "
                         f"the vocabulary 0..{vocab_size - 1}")


class _Rows:
    """Rows as (start, size) views of one flat int32 array of content ids, gathered into padded
    [BOS, content, EOS] batches."""

    def __init__(self, flat: np.ndarray, starts: np.ndarray, sizes: np.ndarray, pad_id, bos_id, eos_id):
        self.flat, self.starts, self.sizes = flat, starts, sizes
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    def __len__(self) -> int:
        return len(self.sizes)

    def gather(self, index):
        """(tokens (B, L_max) int64 padded with PAD, lengths (B,) int64) of rows `index`."""
        index = np.asarray(index, dtype=np.int64)
        sizes = self.sizes[index]                                        # (B,)
        width = int(sizes.max(initial=0))
        out = np.full((len(index), width + 2), self.pad_id, dtype=np.int64)
        out[:, 0] = self.bos_id
        col = np.arange(width)
        inside = col[None, :] < sizes[:, None]                           # (B, width)
        out[:, 1:width + 1][inside] = self.flat[(self.starts[index, None] + col)[inside]]
        out[np.arange(len(index)), sizes + 1] = self.eos_id
        return torch.from_numpy(out), torch.from_numpy(sizes + 2)        # (B, L_max), (B,)


class TextData(_Batches):
    """Tokenised documents split into train / held-out rows of at most max_len tokens.

    Rows are [BOS, x..., EOS] (see the module docstring for the split); batches are padded with
    PAD and carry their lengths (docs/contract.md §1).
    """

    def __init__(self, paths, tokenizer, max_len: int, held_out: float = 0.05, seed: int = 0):
        max_len, held_out, seed = _check_split(max_len, held_out, seed)  # before reading anything
        ids = {}
        for name in SPECIAL_TOKENS:
            ids[name] = tokenizer.token_to_id(name)
            if ids[name] is None:
                raise ValueError(f"tokenizer has no {name} token (train it with train_bpe)")
        from tokenizers import Tokenizer

        # A copy: the caller's tokenizer keeps its own padding/truncation settings.
        encoder = _text_only(Tokenizer.from_str(tokenizer.to_str()))
        flat, doc_lengths = _encode_documents(encoder, iter_documents(paths))
        self.tokenizer = tokenizer
        self._build(flat, doc_lengths, tokenizer.get_vocab_size(), ids["<pad>"], ids["<bos>"],
                    ids["<eos>"], max_len, held_out, seed)

    @classmethod
    def from_ids(cls, rows, vocab_size: int, source_name: str | None = None, *,
                 max_len: int | None = None, held_out: float = 0.05, seed: int = 0,
                 pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> "TextData":
        """Pre-tokenised documents: `rows` is a path to a .npy/.pt file (see load_ids), an array,
        or a list of id sequences, one document each, holding content ids only (BOS/EOS are
        added here). Any id outside 0..vocab_size-1 raises a ValueError naming the source and the
        (row, index) of the first one. max_len=None keeps documents whole."""
        vocab_size = check_int("vocab_size", vocab_size, 1)
        # before a file is read; max_len None is replaced below by the longest document's
        checked_len, held_out, seed = _check_split(3 if max_len is None else max_len, held_out, seed)
        if isinstance(rows, (str, Path)):
            source_name = source_name or str(rows)
            rows = load_ids(rows)
        source_name = source_name or "ids"
        rows = _as_rows(rows, source_name)
        _check_vocab(rows, vocab_size, source_name)
        for name, v in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if not 0 <= check_int(name, v, 0) < vocab_size:
                raise ValueError(f"{name}={v} is outside the vocabulary 0..{vocab_size - 1}")
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(f"pad_id, bos_id and eos_id must differ, got {pad_id}, {bos_id}, {eos_id}")
        # (empty documents are dropped, and none left is an error, below)
        max_len = checked_len if max_len is not None else max(max((len(r) for r in rows), default=0), 1) + 2
        self = cls.__new__(cls)
        self.tokenizer = None
        flat = np.concatenate(rows).astype(np.int32) if rows else np.empty(0, np.int32)
        self._build(flat, np.array([len(r) for r in rows], dtype=np.int64), vocab_size, pad_id,
                    bos_id, eos_id, max_len, held_out, seed)
        return self

    def _build(self, flat, doc_lengths, vocab_size, pad_id, bos_id, eos_id, max_len, held_out, seed):
        offsets = np.concatenate([[0], np.cumsum(doc_lengths)])[:-1]
        kept = doc_lengths > 0
        offsets, doc_lengths = offsets[kept], doc_lengths[kept]
        if not len(doc_lengths):
            raise ValueError("no documents (every input was empty)")
        self.vocab_size, self.max_len, self.seed = int(vocab_size), max_len, seed
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)
        self._flat, self._doc_lengths = flat, doc_lengths
        # Rows: consecutive chunks of `content` ids of each document, in document order.
        content = max_len - 2
        doc_rows = -(-doc_lengths // content)                     # rows of each document
        first = np.concatenate([[0], np.cumsum(doc_rows)])        # its first row; first[-1] = rows
        doc = np.repeat(np.arange(len(doc_rows)), doc_rows)       # the document of each row
        k = np.arange(first[-1]) - first[doc]                     # the row's chunk in its document
        starts = offsets[doc] + k * content
        sizes = np.minimum(content, doc_lengths[doc] - k * content)
        held = _held_out_rows(doc_rows, first, held_out, seed)
        self._train, self._held = (_Rows(flat, starts[m], sizes[m], self.pad_id, self.bos_id, self.eos_id)
                                   for m in (~held, held))
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
        return torch.from_numpy(self._held.sizes + 2)

    @property
    def n_documents(self) -> int:
        return len(self._doc_lengths)

    def fingerprint(self) -> dict:
        """Documents, tokens and a SHA-256 of the ids and document lengths: equal exactly when the
        rows, and so the split and every batch, are (given max_len, held_out and seed)."""
        h = hashlib.sha256(self._doc_lengths.astype("<i8").tobytes())
        h.update(self._flat.astype("<i4", copy=False).data)  # no copy of the corpus
        return {"documents": self.n_documents, "tokens": int(self._doc_lengths.sum()), "sha256": h.hexdigest()}

    def batch(self, step: int, batch_size: int, seed: int):
        """Training batch `step`: (tokens (B, L_max) int64 padded with PAD, lengths (B,) int64),
        L_max the longest row in the batch. Epoch-wise seeded permutation (full batches only), so
        it is a pure function of (step, batch_size, seed)."""
        index = _epoch_indices(self, self.n_train, step, batch_size, seed)
        return self._train.gather(index.numpy())

    def held_out_batches(self, batch_size: int):
        """Every held-out row once, in order, as (tokens, lengths) batches (the last may be short)."""
        batch_size = check_int("batch_size", batch_size, 1)
        for lo in range(0, self.n_held_out, batch_size):
            yield self._held.gather(np.arange(lo, min(lo + batch_size, self.n_held_out)))


def _check_split(max_len, held_out, seed):
    max_len, seed = check_int("max_len", max_len, 3), check_int("seed", seed, 0)  # BOS, a token, EOS
    if isinstance(held_out, bool) or not isinstance(held_out, (int, float, np.floating)) or not 0 <= held_out < 1:
        raise ValueError(f"held_out must be a fraction in [0, 1), got {held_out!r}")
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
