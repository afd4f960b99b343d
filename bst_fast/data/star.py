"""Star graphs G(d, l) (Bachmann & Nagarajan), their token format, splits, streams and path accuracy.

A star graph G(d, l) over N node labels has a start node s with d arms; each arm is a path of l
nodes that begins at s, so it adds l - 1 new nodes, and the graph holds 1 + d(l-1) distinct
labels drawn at random from 0..N-1. The goal g is the last node of one random arm and the answer
is that arm, s first. Edges are directed parent -> child and listed in a random order.

A row (docs/contract.md §7, the paper's format with commas dropped), E = d(l-1) edges:

    BOS  u v | u v | ... | u v  /  s g  =  s p_2 ... p_{l-1} g  EOS
    0    1 ..............3E-1   3E 3E+1 3E+3 3E+4 ......... 3E+3+l  3E+4+l

so every row has length L = 3E + l + 5 and "=" sits at prefix_start = 3E + 3.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import math

import numpy as np
import torch

from .._checks import check_int

# Seed-sequence tags keep the test split, the train split, the epoch permutations and the stream
# on independent random streams even when they are given the same seed.
_TAG_TEST, _TAG_TRAIN, _TAG_PERM, _TAG_STREAM = 1, 2, 3, 4
_MAX_ROUNDS = 100  # redraw rounds before deciding the graph space is too small
_BLOCK = 1 << 16  # rows per draw: bounds the scratch memory of building a large set


class StarGraph(NamedTuple):
    """One parsed row. `path` may be shorter than l when parsing a partial (generated) row."""
    edges: list  # [(u, v), ...] in row order, u the parent of v
    start: int
    goal: int
    path: list


class StarGraphTokenizer:
    """Token ids 0..N-1 are the nodes; then PAD, BOS, EOS, "|", "/", "=" in that order."""

    SPECIALS = ("<pad>", "<bos>", "<eos>", "|", "/", "=")

    def __init__(self, n_nodes: int):
        self.n_nodes = check_int("n_nodes", n_nodes, 1)
        self.pad_id, self.bos_id, self.eos_id, self.edge_sep_id, self.query_id, self.answer_id = (
            self.n_nodes + k for k in range(len(self.SPECIALS)))
        self.vocab_size = self.n_nodes + len(self.SPECIALS)

    def _node(self, x) -> int:
        x = check_int("node", x, 0)  # int(1.7) was node 1
        if not x < self.n_nodes:
            raise ValueError(f"node {x} is outside 0..{self.n_nodes - 1}")
        return x

    def encode_row(self, edges, start, goal, path) -> list[int]:
        """[BOS, u v | u v | ... / s g = s p_2 ... g, EOS] as a list of ids."""
        ids = [self.bos_id]
        for k, (u, v) in enumerate(edges):
            if k:
                ids.append(self.edge_sep_id)
            ids += [self._node(u), self._node(v)]
        ids += [self.query_id, self._node(start), self._node(goal), self.answer_id]
        ids += [self._node(p) for p in path]
        ids.append(self.eos_id)
        return ids

    def encode_batch(self, edges: np.ndarray, start: np.ndarray, goal: np.ndarray,
                     path: np.ndarray) -> np.ndarray:
        """Vectorised encode_row: edges (n, E, 2), start (n,), goal (n,), path (n, l) -> (n, L) int64."""
        n, n_edges, _ = edges.shape
        l = path.shape[1]
        e3 = 3 * n_edges
        out = np.empty((n, e3 + l + 5), dtype=np.int64)
        out[:, 0] = self.bos_id
        out[:, 1:e3:3] = edges[:, :, 0]
        out[:, 2:e3:3] = edges[:, :, 1]
        out[:, 3:e3:3] = self.edge_sep_id  # E-1 separators; slot 3E is "/" below
        out[:, e3] = self.query_id
        out[:, e3 + 1] = start
        out[:, e3 + 2] = goal
        out[:, e3 + 3] = self.answer_id
        out[:, e3 + 4:e3 + 4 + l] = path
        out[:, -1] = self.eos_id
        return out

    def decode(self, ids, skip_special: bool = False) -> str:
        """Space-separated: nodes as numbers, specials by name; stops at the first PAD."""
        words = []
        for t in _as_list(ids):
            if t == self.pad_id:
                break
            if skip_special and t in (self.bos_id, self.eos_id):
                continue
            words.append(str(t) if 0 <= t < self.n_nodes else
                         self.SPECIALS[t - self.n_nodes] if self.n_nodes <= t < self.vocab_size else f"<unk:{t}>")
        return " ".join(words)

    def parse(self, ids) -> StarGraph:
        """Back from ids (BOS/EOS/PAD optional) to edges, start, goal and path."""
        ids = _as_list(ids)
        if self.pad_id in ids:
            ids = ids[:ids.index(self.pad_id)]
        if ids and ids[0] == self.bos_id:
            ids = ids[1:]
        if self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        if self.query_id not in ids:
            raise ValueError(f"no '/' in row: {self.decode(ids)!r}")
        q = ids.index(self.query_id)
        edge_part, rest = ids[:q], ids[q + 1:]
        edges = []
        if edge_part:
            groups = [[]]
            for t in edge_part:
                if t == self.edge_sep_id:
                    groups.append([])
                else:
                    groups[-1].append(t)
            for grp in groups:
                if len(grp) != 2:
                    raise ValueError(f"malformed edge {grp} in row: {self.decode(ids)!r}")
                edges.append((self._node(grp[0]), self._node(grp[1])))
        if len(rest) < 3 or rest[2] != self.answer_id:
            raise ValueError(f"expected '/ s g =' in row: {self.decode(ids)!r}")
        return StarGraph(edges, self._node(rest[0]), self._node(rest[1]),
                         [self._node(p) for p in rest[3:]])


def _as_list(ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        return ids.tolist()
    return [int(t) for t in ids]


class _Batches:
    """`batches` for any class with a pure `batch(step, batch_size, seed)`."""

    def batches(self, batch_size: int, seed: int | None = None, start_step: int = 0):
        """Batches start_step, start_step + 1, ... forever (resume = pass the saved step); seed
        None: the data's own (a stream's seed, else 0)."""
        seed = getattr(self, "seed", 0) if seed is None else seed
        step = int(start_step)
        while True:
            yield self.batch(step, batch_size, seed)
            step += 1


class StarLayout:
    """Positions in a G(d, l) row; the same for every row, so no per-row prefix is needed."""

    def __init__(self, d: int, l: int):
        self.d, self.l = check_int("d", d, 1), check_int("l", l, 2)  # int(2.5) was d = 2; the path counts s and g

    @property
    def path_len(self) -> int:
        return self.l

    @property
    def n_edges(self) -> int:
        return self.d * (self.l - 1)

    @property
    def row_length(self) -> int:
        # BOS + (2E tokens + E-1 "|") + "/" s g "=" + l path nodes + EOS
        return 1 + (3 * self.n_edges - 1) + 4 + self.l + 1

    @property
    def prefix_start(self) -> int:
        return 3 * self.n_edges + 3  # the "=" position (docs/contract.md §7)

    @property
    def answer_slice(self) -> slice:
        return slice(self.prefix_start + 1, self.prefix_start + 1 + self.l)


def _check_params(d: int, l: int, n_nodes: int):
    d, l = check_int("d", d, 1), check_int("l", l, 2)  # the path counts s and g
    need = 1 + d * (l - 1)
    if check_int("n_nodes", n_nodes, 1) < need:
        raise ValueError(f"n_nodes must be >= 1 + d*(l-1) = {need} for G({d}, {l}), got {n_nodes}")


_SHUFFLE_MAX_NODES = 256  # above it (and above 2k), labels are drawn by rejection: cost k, not N, a row


def _distinct_labels(n: int, k: int, n_nodes: int, rng: np.random.Generator) -> np.ndarray:
    """(n, k) int64: each row k distinct labels of 0..n_nodes-1, uniform in a uniform order."""
    if n_nodes <= max(_SHUFFLE_MAX_NODES, 2 * k):
        # Row-wise Fisher-Yates of 0..N-1: the first k entries (about 3x faster than argsort of
        # random keys). Time and scratch grow with N a row, hence the bound.
        return rng.permuted(np.broadcast_to(np.arange(n_nodes, dtype=np.int64), (n, n_nodes)), axis=1)[:, :k]
    # Column by column, each label uniform among those its row has not used (a draw that repeats
    # one is drawn again: at most half the labels are used, so under 2 draws a label on average)
    labels = np.empty((n, k), dtype=np.int64)
    for c in range(k):
        col = rng.integers(0, n_nodes, size=n, dtype=np.int64)
        redo = np.flatnonzero((labels[:, :c] == col[:, None]).any(axis=1))
        while len(redo):
            col[redo] = rng.integers(0, n_nodes, size=len(redo), dtype=np.int64)
            redo = redo[(labels[redo, :c] == col[redo, None]).any(axis=1)]
        labels[:, c] = col
    return labels


def sample_star_graphs(n: int, d: int, l: int, n_nodes: int, rng: np.random.Generator):
    """Draw n graphs at once. Returns (edges (n, E, 2), start (n,), goal (n,), path (n, l)), int64."""
    _check_params(d, l, n_nodes)
    k = 1 + d * (l - 1)
    labels = _distinct_labels(n, k, n_nodes, rng)
    start = labels[:, 0]
    # chains[:, a] = arm a as its l nodes, s first: (n, d, l)
    chains = np.empty((n, d, l), dtype=np.int64)
    chains[:, :, 0] = start[:, None]
    chains[:, :, 1:] = labels[:, 1:].reshape(n, d, l - 1)
    # edges of arm a: chains[a, t] -> chains[a, t+1]; (n, E, 2) in arm order, shuffled below
    edges = np.stack([chains[:, :, :-1], chains[:, :, 1:]], axis=-1).reshape(n, d * (l - 1), 2)
    order = rng.permuted(np.broadcast_to(np.arange(d * (l - 1)), (n, d * (l - 1))), axis=1)
    edges = np.take_along_axis(edges, order[:, :, None], axis=1)
    arm = rng.integers(0, d, size=n)
    path = chains[np.arange(n), arm]  # (n, l)
    return edges, start.copy(), path[:, -1].copy(), path


def generate_star_graphs(n: int, d: int, l: int, n_nodes: int, seed) -> np.ndarray:
    """n token rows (n, L) int64 of G(d, l) over n_nodes labels; `seed` is an int, a list of
    ints (a numpy SeedSequence entropy) or a numpy Generator."""
    n = check_int("n", n, 0)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return StarGraphTokenizer(n_nodes).encode_batch(*sample_star_graphs(n, d, l, n_nodes, rng))


def _mix64(h: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: every input bit affects every output bit, so the chained hash below
    # has no structured collisions; uint64 arithmetic wraps, which is what we want.
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def graph_keys(tokens, d: int, l: int) -> np.ndarray:
    """A 64-bit key per row (n,) uint64 of the graph, its edge set: independent of edge order and
    of the query. The paper tests on unseen graphs, so a test graph may not reach training with
    any goal, nor re-shuffled (the edges fix the start; d = 2 makes the other goal's path the
    other arm). A false collision (~n^2 / 2^64) only drops a training row.
    """
    t = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens, dtype=np.int64)
    layout = StarLayout(d, l)
    if t.ndim != 2 or t.shape[1] != layout.row_length:
        raise ValueError(f"tokens must be (n, {layout.row_length}) rows of G({d}, {l}), got shape {t.shape}")
    e3 = 3 * layout.n_edges
    cols = np.sort((t[:, 1:e3:3] << 32) + t[:, 2:e3:3], axis=1).astype(np.uint64)  # (n, E), order-free
    h = np.full(len(t), 0x9E3779B97F4A7C15, dtype=np.uint64)
    for c in range(cols.shape[1]):
        h = _mix64(h ^ cols[:, c])
    return h


class StarGraphData(StarLayout, _Batches):
    """Fixed train/test splits of G(d, l) over n_nodes labels that never share a graph.

    The test set is drawn first (distinct graphs), then train rows holding a test graph (the same
    edge set in any order, with any goal) are dropped and redrawn. test_tokens are (n_test, L) int64;
    train_tokens are (n_train, L) in the smallest integer dtype that holds the vocabulary (uint8 up
    to 256 ids, else int16 or int32): the paper's 8M rows of G(2, 20) take 1.1 GB, not 8.9 GB of
    int64, on every DDP rank. batch() gives int64 rows.
    """

    def __init__(self, d: int, l: int, n_nodes: int, n_train: int, n_test: int, seed: int = 0):
        _check_params(d, l, n_nodes)
        super().__init__(int(d), int(l))
        self.n_nodes = int(n_nodes)
        self.tokenizer = StarGraphTokenizer(n_nodes)
        seed = check_int("seed", seed, 0)
        test = _draw_rows(n_test, self, [seed, _TAG_TEST], exclude=None, unique=True, what="n_test")
        self._test_keys = np.sort(graph_keys(test, self.d, self.l))
        train = _draw_rows(n_train, self, [seed, _TAG_TRAIN], exclude=self._test_keys, unique=False,
                           what="n_train", dtype=_row_dtype(self.tokenizer.vocab_size))
        self.train_tokens = torch.from_numpy(train)  # (n_train, L), compact (docstring)
        self.test_tokens = torch.from_numpy(test)    # (n_test, L) int64
        self._perm_cache = (None, None)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def test_keys(self) -> np.ndarray:
        """Sorted uint64 keys of the test rows (see graph_keys), for StarGraphStream(exclude=...)."""
        return self._test_keys

    def batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Rows of training batch `step`: (batch_size, L) int64 (train_tokens widened).

        Epoch e = step // (n_train // batch_size) uses its own seeded permutation; the last
        n_train % batch_size rows of an epoch's order are skipped so every batch is full. Pure in
        (step, batch_size, seed), so a resumed run only needs the step number.
        """
        return self.train_tokens[_epoch_indices(self, len(self.train_tokens), step, batch_size, seed)].long()


def _epoch_indices(owner, n: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    step, seed = check_int("step", step, 0), check_int("seed", seed, 0)
    if check_int("batch_size", batch_size, 1) > n:
        raise ValueError(f"batch_size must be in 1..{n} (the training rows), got {batch_size}")
    per_epoch = n // batch_size
    epoch, k = divmod(int(step), per_epoch)
    key, perm = owner._perm_cache
    if key != (epoch, n, seed):  # one permutation per epoch, cached: consecutive steps reuse it
        perm = torch.from_numpy(np.random.default_rng([seed, _TAG_PERM, epoch]).permutation(n))
        owner._perm_cache = ((epoch, n, seed), perm)
    return perm[k * batch_size:(k + 1) * batch_size]


def _row_dtype(vocab_size: int) -> np.dtype:
    """The smallest integer dtype that holds ids 0..vocab_size - 1 (torch has uint8, int16, int32)."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.int16 if vocab_size <= 2**15 else np.int32)


def _draw_rows(n: int, layout: StarLayout, entropy, exclude, unique: bool, what: str,
               dtype=np.int64) -> np.ndarray:
    """n rows from one rng; drops rows whose key is in `exclude` (sorted) and, if `unique`,
    repeats; redraws until there are n.

    Rows are drawn in blocks of at most _BLOCK and copied straight into the (n, L) result, so
    building a set of the paper's size (8M rows) needs the result plus one block's scratch, not
    several copies of it. Up to _BLOCK rows, one block is one draw: the same rows as a single draw.
    """
    n = check_int(what, n, 0)
    rng = np.random.default_rng(entropy)
    out = np.empty((n, layout.row_length), dtype=dtype)  # the blocks' int64 ids fit: _row_dtype
    have = 0
    seen = np.empty(0, dtype=np.uint64)
    for _ in range(_MAX_ROUNDS):
        if have >= n:
            break
        want = n - have
        # draw a little extra so one round nearly always suffices
        to_draw = want + want // 16 + 16
        while to_draw > 0 and have < n:
            size = min(to_draw, _BLOCK)
            to_draw -= size
            block = generate_star_graphs(size, layout.d, layout.l, layout.n_nodes, rng)
            k = graph_keys(block, layout.d, layout.l)
            keep = np.ones(len(k), dtype=bool)
            if exclude is not None and len(exclude):
                keep &= ~_sorted_contains(exclude, k)
            if unique:
                first = np.zeros(len(k), dtype=bool)
                first[np.unique(k, return_index=True)[1]] = True  # the first of each repeated key
                keep &= first & ~np.isin(k, seen)
            idx = np.flatnonzero(keep)[:n - have]
            out[have:have + len(idx)] = block[idx]
            have += len(idx)
            if unique:
                seen = np.concatenate([seen, k[idx]])
    if have < n:
        # distinct graphs: a start, then the arms' labels in order, the d arms unordered
        k = 1 + layout.d * (layout.l - 1)
        graphs = math.perm(layout.n_nodes, k) // math.factorial(layout.d)
        raise ValueError(f"{what}={n}: {_MAX_ROUNDS} rounds of draws did not find enough graphs"
                         + (" not held out for testing" if exclude is not None and len(exclude) else "")
                         + f"; G({layout.d}, {layout.l}) over {layout.n_nodes} nodes has {graphs} distinct graphs"
                         + (" (a test set draws each at most once)" if unique else ""))
    return out


def _sorted_contains(sorted_keys: np.ndarray, k: np.ndarray) -> np.ndarray:
    pos = np.searchsorted(sorted_keys, k).clip(max=len(sorted_keys) - 1)
    return sorted_keys[pos] == k


class StarGraphStream(StarLayout, _Batches):
    """An unlimited stream of fresh G(d, l) graphs; batch `step` is a pure function of (seed, step).

    `exclude`: rows never to emit (a StarGraphData, whose test split is used; a (n, L) token
    tensor/array; or sorted uint64 keys from graph_keys), so a stream can train against a fixed
    test set.
    """

    def __init__(self, d: int, l: int, n_nodes: int, seed: int = 0, exclude=None):
        _check_params(d, l, n_nodes)
        super().__init__(int(d), int(l))
        self.n_nodes, self.seed = int(n_nodes), check_int("seed", seed, 0)
        self.tokenizer = StarGraphTokenizer(n_nodes)
        if isinstance(exclude, StarGraphData):
            if (exclude.d, exclude.l, exclude.n_nodes) != (self.d, self.l, self.n_nodes):
                raise ValueError(f"exclude holds G({exclude.d}, {exclude.l}) over {exclude.n_nodes} nodes, "
                                 f"the stream G({self.d}, {self.l}) over {self.n_nodes}")
            keys = exclude.test_keys
        elif exclude is None:
            keys = np.empty(0, dtype=np.uint64)
        elif isinstance(exclude, np.ndarray) and exclude.dtype == np.uint64:
            keys = np.sort(exclude)
        else:
            keys = np.sort(graph_keys(exclude, self.d, self.l))
        self._exclude = keys

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def batch(self, step: int, batch_size: int, seed: int | None = None) -> torch.Tensor:
        """Fresh rows (batch_size, L) int64 for step `step`, none of them an excluded graph.
        `seed` (default: the stream's) lets a stream stand in for StarGraphData.batch."""
        seed = self.seed if seed is None else check_int("seed", seed, 0)
        check_int("batch_size", batch_size, 1)
        rows = _draw_rows(batch_size, self, [seed, _TAG_STREAM, check_int("step", step, 0)], self._exclude,
                          unique=False, what="batch_size")
        return torch.from_numpy(rows)


@torch.no_grad()
def path_accuracy(generate: Callable[[torch.Tensor, int], torch.Tensor], tokens: torch.Tensor,
                  prefix_start: int, path_len: int, batch_size: int = 512,
                  per_position: bool = False, device=None):
    """Fraction of rows whose whole path (all path_len nodes) greedy decoding gets right.

    generate(prefix (B, prefix_start+1) int64, n_new) -> (B, n_new) int64: the model's batched
    greedy decoder (with the empty suffix). The prefix is each row up to and including "=".
    With per_position=True also returns a (path_len,) float tensor: accuracy at each path node.
    `device`: where the prefixes are sent (default: tokens' device).
    """
    tokens = torch.as_tensor(tokens)
    prefix_start = check_int("prefix_start", prefix_start, 0)
    path_len, batch_size = check_int("path_len", path_len, 1), check_int("batch_size", batch_size, 1)
    # the shape first: len() of a 0-d tensor is a TypeError that names nothing
    if tokens.dim() != 2 or prefix_start + path_len >= tokens.shape[1]:
        raise ValueError(f"tokens must be (n, L) rows holding prefix_start + 1 + path_len = "
                         f"{prefix_start + 1 + path_len} tokens, got shape {tuple(tokens.shape)}")
    n = len(tokens)
    if n == 0:
        raise ValueError("tokens is empty")
    right_rows = 0
    right_pos = torch.zeros(path_len, dtype=torch.float64)
    for lo in range(0, n, batch_size):
        rows = tokens[lo:lo + batch_size]
        prefix = rows[:, :prefix_start + 1]                              # (B, P)
        target = rows[:, prefix_start + 1:prefix_start + 1 + path_len]  # (B, l)
        out = generate(prefix if device is None else prefix.to(device), path_len)
        out = torch.as_tensor(out).to(target.device)
        if out.shape != target.shape:
            raise ValueError(f"generate returned {tuple(out.shape)}, expected {tuple(target.shape)}")
        ok = out == target                                               # (B, l)
        right_rows += int(ok.all(dim=1).sum())
        right_pos += ok.sum(dim=0).double()
    acc = right_rows / n
    return (acc, (right_pos / n).float()) if per_position else acc
