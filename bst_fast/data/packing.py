"""Packed text rows (TrainConfig.pack): several documents back to back in one row of max_len.

Two modes. `pack: true` (PackedRows) packs whole documents, each its own row's [BOS .. EOS], and
pads the rest of a row. `pack: "split"` (SplitRows) is the official TinyStories layout
(microsoft/BST data/tinystories.py, trl's ConstantLengthDataset): every item joined into one
stream, cut into rows of exactly max_len, documents cut across rows, no padding (the stream's last
row excepted).

pack: true. The items packed are the unpacked rows themselves, each [BOS, x_1 .. x_T, EOS] exactly
as TextData makes it (a document longer than a row is cut into its rows first, as unpacked), so
every document in a packed row is self-contained. They are packed greedily in data order (next fit:
a row takes the next item while it fits, else the next row starts), once, when the data is built:
packed rows are then batched as the unpacked ones are, so a batch stays a pure function of (seed,
step). A packed batch carries its document ids, (B, L) runs 0, 1, 2, ... along each row (padding
continues the last id), which the loss and the encoders take as `documents` (docs/contract.md §10).

pack: "split". The same items ([BOS, x_1 .. x_T, EOS], train and held-out apart) are joined back to
back in data order and the stream is cut every max_len tokens: row r is stream positions
r * max_len .. (r + 1) * max_len - 1. The last row holds what is left (padded when batched with full
rows) rather than being dropped as the official code drops it: nothing is lost, and a small
held-out side still has a row (one too short for the objective, such as one or two tokens for a
BST at min_gap 2, drawn alone makes a step with no update: trainer.train_step). A row's documents
are its runs between item starts (BOS): ids 0, 1, 2, ... counting the item starts after the row's first position, so a row that starts mid-document
trains on that fragment alone (id 0), as the official rows do. The ids come from the items'
offsets, not from the token values, and a row is read from the items' (start, size) views when
batched: the stream is never built, so a memory-mapped corpus stays on disk.
"""
from __future__ import annotations

import numpy as np
import torch

from .._checks import short


def check_pack(pack):
    """`pack` as given if it is False, True or "split", else a ValueError naming it (1 or "true" are
    refused: a config's value is a YAML bool or the word split)."""
    if not (isinstance(pack, bool) or (isinstance(pack, str) and pack == "split")):
        raise ValueError(f"pack must be False, True or 'split', got {short(pack)}")
    return pack


def pack_greedily(lengths, max_len: int) -> np.ndarray:
    """(rows + 1,) int64 `first`: packed row p holds items first[p] .. first[p + 1] - 1, in order,
    each row as many consecutive items as fit in max_len. Every length must be in 1..max_len."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > max_len):
        raise ValueError(f"items to pack must be 1..{max_len} long, got lengths {lengths.min()}..{lengths.max()}")
    cum = np.concatenate([[0], np.cumsum(lengths)])
    # A row starting at item s ends before the first item that would overflow it: found for every s
    # at once; walking from row to row is then one step a row, not one an item.
    ends = (np.searchsorted(cum, cum[:-1] + max_len, side="right") - 1).tolist()
    first, s = [0], 0
    while s < len(lengths):
        s = ends[s]
        first.append(s)
    return np.array(first, dtype=np.int64)


class PackedRows:
    """The rows of `units` (a text._Rows: __len__, lengths, gather) packed into rows of max_len."""

    def __init__(self, units, max_len: int):
        self.units = units
        self.first = pack_greedily(units.lengths, max_len)
        cum = np.concatenate([[0], np.cumsum(units.lengths)])
        self.lengths = cum[self.first[1:]] - cum[self.first[:-1]]  # (rows,) valid positions of each row

    def __len__(self) -> int:
        return len(self.first) - 1

    def gather(self, index):
        """(tokens (B, L_max) int64 padded with PAD, lengths (B,) int64, documents (B, L_max) int64)
        of packed rows `index`: each row's items back to back, document k of a row holding id k."""
        index = np.asarray(index, dtype=np.int64)
        lo, counts = self.first[index], self.first[index + 1] - self.first[index]
        at = np.cumsum(counts) - counts                          # each row's first item in the list below
        row = np.repeat(np.arange(len(index)), counts)           # the batch row of each item
        doc = np.arange(int(counts.sum())) - at[row]             # its place in that row: its document id
        tokens, sizes = (t.numpy() for t in self.units.gather(lo[row] + doc))
        offset = np.cumsum(sizes) - sizes
        offset -= offset[at][row]                                # where each item starts in its row
        col = np.arange(tokens.shape[1])
        inside = col[None, :] < sizes[:, None]
        rows, cols = np.broadcast_to(row[:, None], inside.shape)[inside], (offset[:, None] + col)[inside]
        lengths = self.lengths[index]
        out = np.full((len(index), int(lengths.max(initial=0))), self.units.pad_id, dtype=np.int64)
        out[rows, cols] = tokens[inside]
        documents = np.zeros_like(out)
        documents[rows, cols] = np.broadcast_to(doc[:, None], inside.shape)[inside]
        np.maximum.accumulate(documents, axis=1, out=documents)  # padding continues the last document's id
        return torch.from_numpy(out), torch.from_numpy(lengths.copy()), torch.from_numpy(documents)


class SplitRows:
    """The items of `units` (a text._Rows) joined into one stream, in order, cut into rows of exactly
    max_len (the last row: what is left)."""

    def __init__(self, units, max_len: int):
        self.units, self.max_len = units, max_len
        self.cum = np.concatenate([[0], np.cumsum(units.lengths)])  # (items + 1,) each item's stream position
        total = int(self.cum[-1])
        rows = -(-total // max_len)
        self.lengths = np.full(rows, max_len, dtype=np.int64)       # (rows,) valid positions of each row
        if rows:
            self.lengths[-1] = total - (rows - 1) * max_len

    def __len__(self) -> int:
        return len(self.lengths)

    def gather(self, index):
        """(tokens (B, L_max) int64 padded with PAD, lengths (B,) int64, documents (B, L_max) int64)
        of split rows `index`: row r is the stream's positions r * max_len on, document ids counting
        the items that start inside the row (padding continues the last id)."""
        index = np.asarray(index, dtype=np.int64)
        lengths = self.lengths[index]
        width = int(lengths.max(initial=0))
        begin = index * self.max_len                                     # (B,) each row's first stream position
        first = np.searchsorted(self.cum, begin, side="right") - 1      # the item holding it
        end = np.searchsorted(self.cum, begin + lengths, side="left")   # items first + 1 .. end - 1 start inside
        counts = end - first - 1
        row = np.repeat(np.arange(len(index)), counts)
        item = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + first[row] + 1
        starts = np.zeros((len(index), width), dtype=np.int64)
        starts[row, self.cum[item] - begin[row]] = 1
        documents = np.cumsum(starts, axis=1)                            # ids 0, 1, ... at each item start
        k = first[:, None] + documents                                   # the item at every position
        at = begin[:, None] + np.arange(width) - self.cum[k]             # the position inside it: 0 is its BOS
        size = self.units.sizes[k]                                       # its content ids: EOS at size + 1
        valid = np.arange(width)[None, :] < lengths[:, None]
        out = np.full((len(index), width), self.units.pad_id, dtype=np.int64)
        out[valid & (at == 0)] = self.units.bos_id
        out[valid & (at == size + 1)] = self.units.eos_id
        content = valid & (at >= 1) & (at <= size)
        out[content] = self.units.read(self.units.starts[k[content]] + at[content] - 1)
        return torch.from_numpy(out), torch.from_numpy(lengths.copy()), torch.from_numpy(documents)


def padding_fraction(lengths, batch_size: int, seed: int = 0) -> float:
    """The share of padding among the positions of one epoch of batches of `batch_size` rows of
    these lengths, drawn in a seeded order, each batch padded to its longest row (as the trainer's
    batches are): what packing saves is this figure for the unpacked rows against the packed ones."""
    lengths = np.asarray(lengths, dtype=np.int64)
    b = max(1, min(int(batch_size), len(lengths)))
    order = np.random.default_rng(seed).permutation(len(lengths))[:len(lengths) // b * b].reshape(-1, b)
    rows = lengths[order]
    return float(1.0 - rows.sum() / max(int(rows.max(1, initial=0).sum()) * b, 1))


def padding_saved(rows, batch_size: int, seed: int = 0) -> tuple[float, float]:
    """(unpacked, packed): padding_fraction of the training rows `rows` (a list of text._Rows,
    PackedRows or SplitRows, taken together) before packing and as they are (for unpacked rows, the
    same twice)."""
    units = [getattr(r, "units", r) for r in rows]
    return tuple(padding_fraction(np.concatenate([r.lengths for r in side]), batch_size, seed) for side in (units, rows))
