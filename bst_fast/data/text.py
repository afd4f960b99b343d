"""Text corpora for BST training: a byte-level BPE tokenizer (HF `tokenizers`) and padded batches.

Documents: every *.txt file given (a folder is searched recursively) is split at blank lines
(one or more lines holding only whitespace); each non-empty block is one document, so a file
without blank lines is a single document. A document becomes rows [BOS, x_1, ..., x_T, EOS] of at
most max_len tokens: a longer one is cut into consecutive chunks of max_len - 2 tokens, each
wrapped in its own BOS/EOS. The held-out split is taken by document, never by chunk, so no part
of a held-out document is trained on.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from .star import _Batches, _epoch_indices

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")  # ids 0, 1, 2 in a tokenizer from train_bpe
_BLANK_LINE = re.compile(r"\n[ \t\r\f\v]*\n")


def _text_files(paths) -> list[Path]:
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.suffix.lower() == ".txt" and q.is_file())
            if not found:
                raise FileNotFoundError(f"no *.txt files under {p}")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    return files


def read_documents(paths) -> list[str]:
    """The documents of a file, a folder or a list of them, in sorted file order."""
    docs = []
    for f in _text_files(paths):
        text = f.read_text(encoding="utf-8", errors="replace")
        docs += [b.strip() for b in _BLANK_LINE.split(text) if b.strip()]
    return docs


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
    tok.train_from_iterator(read_documents(paths), trainer=trainer)
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
    specials are added by id, never by text). The setting is not saved in tokenizer.json."""
    tokenizer.encode_special_tokens = True
    return tokenizer


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
    """Ragged rows stored flat (int32 keeps a large corpus small); gathered into padded batches."""

    def __init__(self, rows: list[np.ndarray]):
        self.lengths = np.array([len(r) for r in rows], dtype=np.int64)  # (n,)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)])    # (n+1,)
        self.flat = np.concatenate(rows).astype(np.int32) if rows else np.empty(0, np.int32)

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, index, pad_id: int):
        index = np.asarray(index, dtype=np.int64)
        lengths = self.lengths[index]                                    # (B,)
        out = np.full((len(index), int(lengths.max(initial=1))), pad_id, dtype=np.int64)
        for b, r in enumerate(index):
            out[b, :lengths[b]] = self.flat[self.offsets[r]:self.offsets[r + 1]]
        return torch.from_numpy(out), torch.from_numpy(lengths)          # (B, L_max), (B,)


class TextData(_Batches):
    """Tokenised documents split into train / held-out rows of at most max_len tokens.

    Rows are [BOS, x..., EOS] (see the module docstring); batches are padded with PAD and carry
    their lengths (docs/contract.md §1).
    """

    def __init__(self, paths, tokenizer, max_len: int, held_out: float = 0.05, seed: int = 0):
        ids = {}
        for name in SPECIAL_TOKENS:
            ids[name] = tokenizer.token_to_id(name)
            if ids[name] is None:
                raise ValueError(f"tokenizer has no {name} token (train it with train_bpe)")
        docs = read_documents(paths)
        _text_only(tokenizer)
        encoded = [np.asarray(e.ids, dtype=np.int64)
                   for e in tokenizer.encode_batch(docs, add_special_tokens=False)]
        self.tokenizer = tokenizer
        self._build(encoded, tokenizer.get_vocab_size(), ids["<pad>"], ids["<bos>"], ids["<eos>"],
                    max_len, held_out, seed)

    @classmethod
    def from_ids(cls, rows, vocab_size: int, source_name: str | None = None, *,
                 max_len: int | None = None, held_out: float = 0.05, seed: int = 0,
                 pad_id: int = 0, bos_id: int = 1, eos_id: int = 2) -> "TextData":
        """Pre-tokenised documents: `rows` is a path to a .npy/.pt file (see load_ids), an array,
        or a list of id sequences, one document each, holding content ids only (BOS/EOS are
        added here). Any id outside 0..vocab_size-1 raises a ValueError naming the source and the
        (row, index) of the first one. max_len=None keeps documents whole."""
        if isinstance(rows, (str, Path)):
            source_name = source_name or str(rows)
            rows = load_ids(rows)
        source_name = source_name or "ids"
        rows = _as_rows(rows, source_name)
        _check_vocab(rows, vocab_size, source_name)
        for name, v in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
            if not 0 <= v < vocab_size:
                raise ValueError(f"{name}={v} is outside the vocabulary 0..{vocab_size - 1}")
        if len({pad_id, bos_id, eos_id}) != 3:
            raise ValueError(f"pad_id, bos_id and eos_id must differ, got {pad_id}, {bos_id}, {eos_id}")
        if max_len is None:  # (empty documents are dropped, and none left is an error, below)
            max_len = max(max((len(r) for r in rows), default=0), 1) + 2
        self = cls.__new__(cls)
        self.tokenizer = None
        self._build(rows, vocab_size, pad_id, bos_id, eos_id, max_len, held_out, seed)
        return self

    def _build(self, docs, vocab_size, pad_id, bos_id, eos_id, max_len, held_out, seed):
        if max_len < 3:
            raise ValueError(f"max_len must be >= 3 (BOS, a token, EOS), got {max_len}")
        if not 0 <= held_out < 1:
            raise ValueError(f"held_out must be in [0, 1), got {held_out}")
        docs = [d for d in docs if len(d)]
        if not docs:
            raise ValueError("no documents (every input was empty)")
        self.vocab_size, self.max_len = int(vocab_size), int(max_len)
        self.pad_id, self.bos_id, self.eos_id = int(pad_id), int(bos_id), int(eos_id)
        content = self.max_len - 2
        rows = [[np.concatenate([[bos_id], doc[lo:lo + content], [eos_id]]) for lo in range(0, len(doc), content)]
                for doc in docs]
        if len(docs) == 1:  # one document (a book): its last rows are held out, none read twice
            docs, rows = [None] * len(rows[0]), [[r] for r in rows[0]]
            order = np.arange(len(rows))[::-1]
        else:  # split by document, seeded
            order = np.random.default_rng([seed, 0]).permutation(len(docs))
        # at least one held-out document (row) when asked for any and there are two
        n_held = int(round(held_out * len(docs)))
        if held_out > 0 and len(docs) > 1:
            n_held = min(max(n_held, 1), len(docs) - 1)
        held = set(order[:n_held].tolist())
        train_rows = [r for k, doc_rows in enumerate(rows) if k not in held for r in doc_rows]
        held_rows = [r for k, doc_rows in enumerate(rows) if k in held for r in doc_rows]
        self._train, self._held = _Rows(train_rows), _Rows(held_rows)
        self._perm_cache = (None, None)

    @property
    def n_train(self) -> int:
        return len(self._train)

    @property
    def n_held_out(self) -> int:
        return len(self._held)

    def batch(self, step: int, batch_size: int, seed: int):
        """Training batch `step`: (tokens (B, L_max) int64 padded with PAD, lengths (B,) int64),
        L_max the longest row in the batch. Epoch-wise seeded permutation (full batches only), so
        it is a pure function of (step, batch_size, seed)."""
        index = _epoch_indices(self, self.n_train, step, batch_size, seed)
        return self._train.gather(index.numpy(), self.pad_id)

    def held_out_batches(self, batch_size: int):
        """Every held-out row once, in order, as (tokens, lengths) batches (the last may be short)."""
        for lo in range(0, self.n_held_out, batch_size):
            yield self._held.gather(np.arange(lo, min(lo + batch_size, self.n_held_out)), self.pad_id)
