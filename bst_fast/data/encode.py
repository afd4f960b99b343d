"""Encoding documents into flat token arrays, exactly as the tokenizer's own encode_batch does, fast.

HF tokenizers' byte-level BPE spends most of its time per pre-token (the GPT-2 regex, alignment
bookkeeping, the Encoding objects): about 1-2 MB of text a second a core. For the tokenizers
train_bpe builds (no normalizer; a ByteLevel pre-tokeniser without prefix space, optionally followed
by a Split that only cuts pre-tokens further; a BPE model without dropout; special tokens only),
encoding is local to pieces of text that start at a single space between two non-space characters:

    "Once upon a time, Tom  ran." -> "Once" | " upon" | " a" | " time," | " Tom  ran."

Every GPT-2 pre-token that holds a non-space character ends before the next space (the pattern's
alternatives admit a space only as their first character), and no pre-token of whitespace starts at
such a space (it is followed by a non-space character). So the document's pre-tokens are the
pieces' pre-tokens, in order, and its ids are the concatenation of the pieces' ids. Pieces repeat
(words), so each distinct piece is encoded once, by the tokenizer itself (encode_batch, on all its
threads), and cached as the bytes of its ids; a document is then a join of cached bytes. The
"non-space" test is Python's str.isspace, a superset of Unicode White_Space (the regex's \\s), so a
piece boundary is only ever placed where the tokenizer has one.

Any other tokenizer is encoded with encode_batch itself. PieceEncoder checks its first documents
and then one document of every call against encode_batch (a RuntimeError if they ever differ).
"""
from __future__ import annotations

import itertools
import json
import re
import sys

import numpy as np

# A document whose every space sits between two non-space characters splits at its spaces (str.split):
# one with a space before a whitespace character (_SPACE_WS) or after one (_WS_SPACE, every character
# str.isspace holds but the space itself) does not. Two searches that start with a literal or a set
# are several times faster than one alternation.
_WHITESPACE = "\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"
_SPACE_WS = re.compile(r" \s")
_WS_SPACE = re.compile(f"[{_WHITESPACE}] ")
# Otherwise: cut before each " x" that follows a non-space character.
_CUT = re.compile(r"(?<=\S)(?= \S)")
# Distinct pieces cached, at most (about 150 bytes each), and the bytes they hold (a piece of text
# without spaces is a whole paragraph: CJK text held ~4x its size in 1M pieces); the cache is
# emptied when either is full.
MAX_CACHE = 1 << 20
MAX_CACHE_BYTES = 160 << 20
# Documents of the first call checked against encode_batch, and documents of each later call.
_CHECK_FIRST, _CHECK_EACH = 64, 1
# Only documents of at most this many characters are checked against encode_batch: its Encoding
# objects take about 100 bytes a token, so checking one 50 MB document (no blank lines) held 13 GB
# in three processes (review helper-90). Long documents take the same piece path as short ones.
_CHECK_CHARS = 1 << 14


def piece_encodable(tokenizer) -> bool:
    """Whether `tokenizer` (a HF Tokenizer) encodes every document as the concatenation of its
    pieces' encodings (the module docstring): the shape of a tokenizer from train_bpe."""
    try:
        obj = json.loads(tokenizer.to_str())
    except Exception:
        return False
    pre = obj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or not _plain_byte_level(steps[0]):
        return False
    # later steps only cut the pre-tokens of the first one further (Split never joins pre-tokens)
    if any(s.get("type") != "Split" for s in steps[1:]):
        return False
    model = obj.get("model") or {}
    return (obj.get("normalizer") is None and model.get("type") == "BPE" and model.get("dropout") is None
            and all(t.get("special") for t in obj.get("added_tokens") or []))


def _plain_byte_level(step) -> bool:
    return (step.get("type") == "ByteLevel" and step.get("add_prefix_space") is False
            and step.get("use_regex", True) is True)


class _Cache(dict):
    """piece -> the bytes of its ids; a missing piece is recorded and reads as no ids."""

    def __init__(self):
        super().__init__()
        self.misses = []

    def __missing__(self, key):
        self.misses.append(key)
        return b""


def _pieces(doc: str) -> list:
    """The document's pieces as cache keys: the first piece as a 1-tuple (it has no leading
    space), every other one without its leading space."""
    if _SPACE_WS.search(doc) is None and _WS_SPACE.search(doc) is None:
        p = doc.split(" ")
    else:
        p = _CUT.split(doc)
        p[1:] = [x[1:] for x in p[1:]]
    p[0] = (p[0],)
    return p


class PieceEncoder:
    """encode(documents) -> (flat ids of `dtype`, each document's length (n,) int64): the ids
    `tokenizer.encode_batch(documents, add_special_tokens=False)` gives, concatenated."""

    def __init__(self, tokenizer, dtype=np.int32, fast: bool | None = None, max_cache: int = MAX_CACHE):
        self.tokenizer = tokenizer
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.fast = piece_encodable(tokenizer) if fast is None else bool(fast)
        self.max_cache = int(max_cache)
        self._cache = _Cache()
        self._cache_bytes = 0  # what the cached pieces hold: keys, values and a dict slot each
        self._calls = 0

    def _hf(self, docs):
        enc = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        return [e.ids for e in enc(docs, add_special_tokens=False)]

    def encode(self, docs) -> tuple[np.ndarray, np.ndarray]:
        docs = list(docs)
        if not self.fast:
            ids = self._hf(docs)
            lengths = np.fromiter(map(len, ids), np.int64, len(ids))
            flat = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
            return flat, lengths
        flat, lengths = self._encode_fast(docs)
        self._check(docs, flat, lengths)
        return flat, lengths

    def _encode_fast(self, docs):
        cache = self._cache
        if len(cache) > self.max_cache or self._cache_bytes > MAX_CACHE_BYTES:
            cache.clear()
            self._cache_bytes = 0
        get, misses, join = cache.__getitem__, cache.misses, b"".join
        out, redo = [], []
        for k, doc in enumerate(docs):
            n = len(misses)
            out.append(join(map(get, _pieces(doc))))
            if len(misses) != n:
                redo.append(k)
        if redo:  # encode the new pieces, all at once (the tokenizer's threads), then those documents again
            keys = list(dict.fromkeys(misses))
            misses.clear()
            texts = [key[0] if type(key) is tuple else " " + key for key in keys]
            for key, text, ids in zip(keys, texts, self._hf(texts)):
                cache[key] = value = np.asarray(ids, dtype=self.dtype).tobytes()
                self._cache_bytes += sys.getsizeof(text) + sys.getsizeof(value) + 100
            for k in redo:
                out[k] = join(map(get, _pieces(docs[k])))
            if misses:  # cannot happen: every piece was just added
                raise RuntimeError("PieceEncoder: a piece was not cached")
        size = self.dtype.itemsize
        lengths = np.fromiter(map(len, out), np.int64, len(out)) // size
        return np.frombuffer(join(out), dtype=self.dtype), lengths

    def _check(self, docs, flat, lengths):
        """Some documents of at most _CHECK_CHARS characters against encode_batch: the first
        _CHECK_FIRST, then _CHECK_EACH a call (none in a call whose picks are all longer)."""
        n = _CHECK_FIRST if self._calls == 0 else _CHECK_EACH
        self._calls += 1
        if not docs:
            return
        short = lambda k: len(docs[k]) <= _CHECK_CHARS
        pick = [k for k in range(len(docs)) if short(k)][:n] if self._calls == 1 else \
            sorted(k for k in {(self._calls * 7919 + j) % len(docs) for j in range(n)} if short(k))
        if not pick:
            return
        ends = np.cumsum(lengths)
        for k, ids in zip(pick, self._hf([docs[k] for k in pick])):
            got = flat[ends[k] - lengths[k]:ends[k]]
            if len(got) != len(ids) or not np.array_equal(got, np.asarray(ids, dtype=np.int64)):
                raise RuntimeError("the piece-wise encoding differs from the tokenizer's own on document "
                                   f"{k} of a batch ({docs[k][:80]!r}...); this is a bug in "
                                   "bst_fast.data.encode: encode with PieceEncoder(..., fast=False)")
