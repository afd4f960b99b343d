"""Packed text rows (TrainConfig.pack): several documents back to back in one row of max_len.

The items packed are the unpacked rows themselves, each [BOS, x_1 .. x_T, EOS] exactly as TextData
makes it (a document longer than a row is cut into its rows first, as unpacked), so every document
in a packed row is self-contained. They are packed greedily in data order (next fit: a row takes
the next item while it fits, else the next row starts), once, when the data is built: packed rows
are then batched as the unpacked ones are, so a batch stays a pure function of (seed, step). A
packed batch carries its document ids, (B, L) runs 0, 1, 2, ... along each row (padding continues
the last id), which the loss and the encoders take as `documents` (docs/contract.md §10).
"""
from __future__ import annotations

import numpy as np
import torch


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
    """(unpacked, packed): padding_fraction of the training rows `rows` (a list of text._Rows or
    PackedRows, taken together) before packing and as they are (for unpacked rows, the same twice)."""
    units = [r.units if isinstance(r, PackedRows) else r for r in rows]
    return tuple(padding_fraction(np.concatenate([r.lengths for r in side]), batch_size, seed) for side in (units, rows))
