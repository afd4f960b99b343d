"""Pair set, labels, weights and input checks of docs/contract.md §2, §4, §5, §8, §9 and §10: the shared math every backend calls."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from . import _ext  # noqa: F401  (the sampler op, bst_fast::sample_pairs)
from ._checks import ArgumentTypeError, TokenIdError, check_int, is_int
from ._device_sampler import sample_on_device

ACTIVATIONS = ("relu", "leaky_relu", "gelu", "gelu_tanh", "silu")
REDUCTIONS = ("mean", "sum", "row_mean")
# A mean over no pair is not 0 (docs/contract.md §2); a sum, or a mean of row means, over none is.
NO_PAIR = ("the batch has no valid pair at all: every row is too short for min_gap, prefix_start and lengths "
           "(reduction='sum' or 'row_mean' gives 0 for such a batch)")


@dataclass
class Pairs:
    """A batch's pair set after checking: every backend reads the same object.

    `row is None` means all pairs of docs/contract.md §2 (the implicit triangle), each weighted by `scale`
    (one scale for every pair, or each row's own with reduction="row_mean"). Otherwise `(row, i, j)`
    lists the pairs, each weighted by `weight` (subsampling estimator or the mean of explicit pairs).
    """

    lengths: torch.Tensor  # (B,) int64, on the tokens' device
    prefix_start: torch.Tensor  # (B,) int64
    min_gap: int
    max_gap: int  # already clipped to L: a pair never spans more than L - 1
    # the weight of every pair in the all-pairs case: () float64, or (B,) one per row (row_mean, §9)
    scale: torch.Tensor
    row: Optional[torch.Tensor] = None  # (n,) int64
    i: Optional[torch.Tensor] = None  # (n,) int64
    j: Optional[torch.Tensor] = None  # (n,) int64
    weight: Optional[torch.Tensor] = None  # (n,) float64; backends cast to their accumulation dtype
    # both labels of a pair with j - i = 1 (docs/contract.md §8); None whenever min_gap >= 2 (no such pair)
    meet_token: Optional[int] = None
    # packed rows (docs/contract.md §10): (first, last), each (B, L) int64, the lowest and highest j
    # the documents let prefix (r, i) pair with; None when a row is one document
    bounds: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    # resolved on the host (prepare's host_pairs): lengths, prefix_start, the pairs and weights are on
    # the CPU, and the tokens' values are left to the op to check
    host: bool = False


def j_range(lengths, prefix_start, min_gap, max_gap, L, bounds=None):
    """(lo, hi), each (B, L): prefix (r, i) pairs with every j in [lo, hi] (none when hi < lo or
    i < prefix_start[r], which leaves hi < lo): gaps, the row's length and its documents' bounds."""
    # gaps beyond L are no limit (max_gap) or no pair (min_gap): clamped, so that i + gap stays in
    # int64 (a config's max_gap of 10**20 overflowed here, 2**63 - 1 wrapped to negative ranges)
    min_gap, max_gap = min(min_gap, L), min(max_gap, L)
    i = torch.arange(L, device=lengths.device)[None]  # (1, L)
    lo = (i + min_gap).expand(lengths.shape[0], L)
    hi = torch.minimum(i + max_gap, lengths[:, None] - 1)  # (B, L)
    if bounds is not None:
        lo, hi = torch.maximum(lo, bounds[0]), torch.minimum(hi, bounds[1])
    # a prefix before prefix_start pairs with nothing: an empty range
    return lo, torch.where(i >= prefix_start[:, None], hi, lo - 1)


def prefix_counts(lengths, prefix_start, min_gap, max_gap, L, bounds=None):
    """(B, L): the number of valid j's of each prefix (r, i), the j's of j_range."""
    lo, hi = j_range(lengths, prefix_start, min_gap, max_gap, L, bounds)
    return (hi - lo + 1).clamp(min=0)


def sample_counts(pairs, counts):
    """k_r of docs/contract.md §5, the pairs a subsample draws from each row: for `pairs` a fraction,
    round(pairs * |P_r|) and at least 1; for a count per row, min(pairs, |P_r|); 0 for a row with no
    pair. `counts`: the rows' |P_r| (an int64 tensor)."""
    if isinstance(pairs, float):
        k = torch.round(pairs * counts.double()).long().clamp(min=1)
    else:
        k = torch.full_like(counts, min(pairs, 2**62))  # 2**62 fits int64
    return torch.minimum(k, counts)


def pair_counts(lengths, prefix_start, min_gap, max_gap, L, documents=None):
    """|P_r| for every row, without enumerating the pairs: sum over i of the valid j's (packed
    rows: `documents` as belief_state_loss takes them, docs/contract.md §10)."""
    bounds = None if documents is None else document_bounds(documents, lengths, L)
    return prefix_counts(lengths, prefix_start, min_gap, max_gap, L, bounds).sum(1)


def pair_mask(lengths, prefix_start, min_gap, max_gap, L, bounds=None):
    """(B, L, L) bool: mask[r, i, j] is True exactly for (i, j) in P_r (docs/contract.md §2, §10)."""
    lo, hi = j_range(lengths, prefix_start, min_gap, max_gap, L, bounds)
    j = torch.arange(L, device=lengths.device)[None, None, :]
    return (j >= lo[:, :, None]) & (j <= hi[:, :, None])


# Token and document ids: torch compares uint16/32/64 tensors on no device (`tokens < 0` raises
# NotImplementedError), so the checks cannot read them; they are refused by name instead
ID_DTYPES = "int8, int16, int32, int64 or uint8"


def id_dtype_ok(dtype) -> bool:
    return dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def separated_documents(tokens, separator: int):
    """(prefix_ids, suffix_ids) of rows packed the official way (docs/contract.md §10): documents
    joined by a separator token (the EOS), which ends one document for the suffix side and starts
    the next for the prefix side, so a pair never has a separator strictly between i and j."""
    if not torch.is_tensor(tokens) or tokens.dim() != 2:
        _fail(ValueError, f"tokens must be a (B, L) tensor of ids, got "
                          f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
    if not id_dtype_ok(tokens.dtype):
        _fail(ValueError, f"tokens must be an integer tensor ({ID_DTYPES}), got {tokens.dtype}")
    separator = check_int("separator", separator, 0)  # a float 2.5 matched no id: one document a row, silently
    prefix_ids = torch.cumsum(tokens == separator, dim=1)
    suffix_ids = torch.cat([torch.zeros_like(prefix_ids[:, :1]), prefix_ids[:, :-1]], dim=1)
    return prefix_ids, suffix_ids


def document_bounds(documents, lengths, L):
    """(first, last), each (B, L) int64: the j's whose suffix document is prefix (r, i)'s document
    (docs/contract.md §10). `documents` is one (B, L) tensor of ids (prefix and suffix sides alike)
    or a (prefix_ids, suffix_ids) pair; each side's ids are non-decreasing along a row's valid
    positions (checked by check_documents), so the j's of one id form one run, found by binary search."""
    prefix_ids, suffix_ids = documents if isinstance(documents, (tuple, list)) else (documents, documents)
    valid = torch.arange(L, device=lengths.device)[None] < lengths[:, None]
    # padding sorts last and matches no prefix (j <= lengths - 1 excludes it anyway)
    top = torch.iinfo(torch.int64).max
    suffix_ids = suffix_ids.long().masked_fill(~valid, top).contiguous()
    prefix_ids = prefix_ids.long().masked_fill(~valid, top - 1).contiguous()
    first = torch.searchsorted(suffix_ids, prefix_ids, right=False)
    last = torch.searchsorted(suffix_ids, prefix_ids, right=True) - 1
    return first, last


def labels(tokens, row, i, j, meet_token=None):
    """Next label tokens[r, i+1] and Prev label tokens[r, j-1] of each pair (docs/contract.md §2);
    with meet_token, both labels of a pair with j - i = 1 are meet_token (§8)."""
    y_next, y_prev = tokens[row, i + 1], tokens[row, j - 1]
    if meet_token is not None:
        meets = j - i == 1
        y_next, y_prev = y_next.masked_fill(meets, meet_token), y_prev.masked_fill(meets, meet_token)
    return y_next, y_prev


def flat_pairs(p: Pairs, L: int):
    """The pair set as flat positions on the device: (ia, ib, weight).

    ia = row * L + i indexes f (its Next label is tokens.flatten()[ia + 1]), ib = row * L + j
    indexes b (its Prev label is tokens.flatten()[ib - 1]). All pairs come ordered by (row, i, j),
    built without a loop over rows and with one host synchronisation (their count); weight is None
    then when every pair weighs the one p.scale, else each pair's row's scale (row_mean). Explicit
    or sampled pairs keep their order and weights."""
    if p.row is not None:
        return p.row * L + p.i, p.row * L + p.j, p.weight
    dev = p.lengths.device
    lo, hi = j_range(p.lengths, p.prefix_start, p.min_gap, p.max_gap, L, p.bounds)
    counts = (hi - lo + 1).clamp(min=0).reshape(-1)  # (B*L,)
    total = int(counts.sum())
    first = counts.cumsum(0) - counts  # slot of each prefix's first pair
    ia = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=total)
    # the k-th pair of prefix (r, i) has j = lo[r, i] + k; lo - i is min_gap without documents
    k = torch.arange(total, device=dev) - first[ia]
    if p.bounds is None:
        ib = ia + p.min_gap + k
    else:
        ib = ia + (lo - torch.arange(L, device=dev)).reshape(-1)[ia] + k
    return ia, ib, None if p.scale.dim() == 0 else p.scale[ia // L]


def listed(p: Pairs, L: int) -> Pairs:
    """The pair set as an explicit (row, i, j) list with one weight per pair: how the fused ops'
    shared schema (backends/pair_loss_op.py) takes the all-pairs set of packed rows."""
    if p.row is not None:
        return p
    ia, ib, weight = flat_pairs(p, L)
    if weight is None:
        weight = p.scale.expand(ia.shape)
    return Pairs(lengths=p.lengths, prefix_start=p.prefix_start, min_gap=p.min_gap, max_gap=p.max_gap,
                 scale=torch.ones((), dtype=torch.float64, device=ia.device), row=ia // L, i=ia % L,
                 j=ib % L, weight=weight, meet_token=p.meet_token)


class Chunk(NamedTuple):
    """One chunk of a PairList: its slots [s0, s0 + n), the prefix segments [pre_lo, pre_hi) and the
    suffix segments [suf_lo, suf_hi) they meet (host ints), and the sum, least and largest of its
    pairs' weights in wscale's units (host floats: a float16 chunk's gradient scale, half_scale)."""

    s0: int
    n: int
    pre_lo: int
    pre_hi: int
    suf_lo: int
    suf_hi: int
    wsum: float
    wmin: float
    wmax: float

    def half_scale(self, summed: bool) -> float:
        """The power of two by which a float16 chunk's per-pair gradients are scaled (the pair weights
        being w / wscale): rows of unequal weight (row_mean, §9) are pairs of unequal weight, and in
        their true units the light ones fall to subnormals, or with the heavy ones on top overflow.
        summed: the chunk's parameter gradients are float16 sums over its pairs (the torch backend's
        autograd), so the scale is sqrt(n) / wsum, the weights averaging 1 / sqrt(n) (a sum of the
        n per-pair terms within sqrt(n) times the largest), but at most 2**4 / wmax: the heaviest
        pair's term at most 16 times its size in wscale's units (one pair of a short row among n
        light ones was sqrt(n) times that alone, and overflowed a review's head at activations of
        220; a cap of 1 put the light rows' terms among the subnormals under a loss scale). Else
        (each pair's gradient apart, sums taken in float32: the triton backend) 1 / sqrt(wmin *
        wmax), the lightest and heaviest pairs' terms equally far below and above 1, the heaviest's
        at most 2**8 (a logit's gradient times the last layer's weights, summed over 2V, stays far
        below 65504). Equal weights: 1 / sqrt(n) and 1."""
        if self.wmax <= 0:  # no weight at all: nothing to scale
            return 1.0
        x = min(self.n ** 0.5 / self.wsum, 2.0**4 / self.wmax) if summed else 2.0**8 / self.wmax
        if not summed and self.wmin > 0:
            x = min(x, (self.wmin * self.wmax) ** -0.5)
        return 2.0 ** round(math.log2(x))


@dataclass
class PairList:
    """A batch's pairs as flat positions, sorted by (ia, ib), with their segments and chunk schedule.

    ia = row * L + i indexes A (and the Next label tokens[ia + 1]); ib = row * L + j indexes B (and
    the Prev label tokens[ib - 1]). Prefix segment a is the run of slots with ia = a (slots
    pre_off[a] .. pre_off[a + 1]); suffix segment c is perm[suf_off[c] .. suf_off[c + 1]], the slots
    with ib = c in increasing order.
    """

    ia: torch.Tensor  # (n,) int32 (int64 past 2**31 pairs or positions)
    ib: torch.Tensor  # (n,) int32 (likewise)
    w: torch.Tensor  # (n,) pair weights / wscale, or (1,) read with stride 0 (all pairs)
    w_stride: int
    wscale: float  # the largest pair weight (the scale of all pairs), in `dtype`; gradients are in its units
    perm: torch.Tensor  # (n,) int32 (likewise)
    pre_off: torch.Tensor  # (B*L + 1,) int64
    suf_off: torch.Tensor  # (B*L + 1,) int64
    chunks: List[Chunk]
    search_steps: int  # binary-search rounds that cover the longest suffix segment
    meet_token: Optional[int] = None  # both labels of a pair with ib - ia = 1 (docs/contract.md §8), as in Pairs
    # A structured list (all pairs of a row set, pair_list(structured=True)), else None: prefix a's
    # suffixes are jlo[a], jlo[a] + 1, ... and suffix c's prefixes alo[c], alo[c] + 1, ..., so that
    # the slot of (a, c) is pre_off[a] + c - jlo[a]: the segment sums walk both by arithmetic.
    jlo: Optional[torch.Tensor] = None  # (B*L,) like ia; meaningless where a prefix has no pair
    alo: Optional[torch.Tensor] = None  # (B*L,) like ia; meaningless where a suffix has no pair


def _exclusive_cumsum(counts):
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def pair_list(p: Pairs, B: int, L: int, chunk: int, dtype=torch.float32, structured: bool = False,
              device=None) -> PairList:
    """Sort the pair set into a PairList cut into chunks of `chunk` slots, its weights in `dtype`, on
    `device` (None: p's). Built on p's device: there, two host synchronisations (the pair count,
    then the chunk table with wscale). A pair set on the host bound for a GPU (prepare's host_pairs)
    is sorted, counted and cut on the host, then uploaded without blocking; only the order by
    suffix is sorted on the GPU: no synchronisation at all. With `structured`, an all-pairs set (no
    listed pairs) also gets jlo and alo: within one row (and one document, §10) the suffixes of a
    prefix and the prefixes of a suffix are runs of positions."""
    dev = p.lengths.device
    target = dev if device is None else torch.device(device)
    BL = B * L
    ia, ib, weight = flat_pairs(p, L)
    total = ia.numel()
    chunk = max(1, min(chunk, total))  # the last chunk is padded to `chunk` slots below
    if weight is None:  # all pairs: ordered by (row, i, j) already, one weight for all
        w = torch.ones(1, dtype=dtype, device=dev)
        w_stride, wscale = 0, p.scale.to(dtype)
    else:
        if p.row is not None:  # listed pairs: sorted here (all pairs come sorted, each weighing its row's scale)
            key = ia * BL + ib
            # the C++ sampler's pairs come sorted: on the host a linear check skips the sort
            if dev.type != "cpu" or total > 1 and not bool((key[1:] >= key[:-1]).all()):
                order = torch.sort(key, stable=True).indices
                ia, ib, weight = ia[order], ib[order], weight[order]
        wmax = weight.max()
        w, wscale = (weight / wmax).to(dtype), wmax.to(dtype)
        w_stride = 1
    pre_off = _exclusive_cumsum(torch.bincount(ia, minlength=BL))
    suf_off = _exclusive_cumsum(torch.bincount(ib, minlength=BL))

    n_chunks = -(-total // chunk)
    s0 = torch.arange(n_chunks, device=dev) * chunk
    s1 = torch.clamp(s0 + chunk, max=total)
    # prefix segments a with pre_off[a] < s1 and pre_off[a + 1] > s0 form one range
    pre_lo = torch.searchsorted(pre_off[1:], s0, right=True)
    pre_hi = torch.searchsorted(pre_off[:-1], s1, right=False)
    # suffix segments met by a chunk: between its smallest and largest ib
    pad = n_chunks * chunk - total
    ib_pad = torch.cat([ib, ib.new_full((pad,), BL)]).reshape(n_chunks, chunk)
    suf_lo = ib_pad.amin(1)
    suf_hi = torch.cat([ib, ib.new_full((pad,), -1)]).reshape(n_chunks, chunk).amax(1) + 1
    longest = (suf_off[1:] - suf_off[:-1]).max()  # explicit pairs may repeat: can exceed L
    columns = [s0, s1 - s0, pre_lo, pre_hi, suf_lo, suf_hi]
    if w_stride:  # each chunk's weights (in wscale's units): their sum, least and largest
        w_pad = torch.cat([w.double(), w.new_zeros(pad, dtype=torch.float64)]).reshape(n_chunks, chunk)
        last = w_pad[-1:, : chunk - pad].amin(1)  # the padded slots of the last chunk are left out below
        columns += [w_pad.sum(1), torch.cat([w_pad[:-1].amin(1), last]), w_pad.amax(1)]
    # one transfer, as float64 (the counts are far below 2**53): the chunk table (a row a Chunk),
    # longest, wscale
    table = torch.cat([torch.stack([c.double() for c in columns], 1).reshape(-1),
                       longest.reshape(1).double(), wscale.double().reshape(1)]).cpu().tolist()
    # int32 indices where they fit (half the bytes); int64 past 2**31 pairs or positions
    idx = torch.int32 if max(total, BL) < 2**31 else torch.int64
    ia, ib, w, pre_off, suf_off = (to_device(t, target) for t in (ia.to(idx), ib.to(idx), w, pre_off, suf_off))
    perm = torch.sort(ib.long() * BL + ia, stable=True).indices  # on the target: the host's costliest sort
    width = len(columns)
    jlo = alo = None
    if structured and p.row is None and total:
        jlo = ib[pre_off[:-1].clamp(max=total - 1)]
        alo = ia[perm[suf_off[:-1].clamp(max=total - 1)]]
    return PairList(ia=ia, ib=ib, w=w, w_stride=w_stride, wscale=table[-1],
                    perm=perm.to(idx), pre_off=pre_off, suf_off=suf_off,
                    chunks=[_chunk(table[k : k + width]) for k in range(0, width * n_chunks, width)],
                    search_steps=int(table[-2]).bit_length(), meet_token=p.meet_token, jlo=jlo, alo=alo)


def _chunk(row) -> Chunk:
    """A Chunk from its row of pair_list's table: one weight for all pairs leaves the weights out."""
    return Chunk(*map(int, row[:6]), *(row[6:] if len(row) > 6 else (float(row[1]), 1.0, 1.0)))


def sample_pairs(lengths, prefix_start, min_gap, max_gap, k, generator=None):
    """k[r] pairs of row r, uniform without replacement (docs/contract.md §5), drawn by the C++ sampler."""
    # One 63-bit seed from the caller's generator makes the draw reproducible and independent of
    # the global RNG; the C++ sampler derives one stream per row from it.
    dev = generator.device if generator is not None else "cpu"
    _ext.require("a pairs= subsample (the C++ sampler; BST_FAST_DEVICE_SAMPLER=1 draws on the device instead)")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=dev).item())
    row, i, j = torch.ops.bst_fast.sample_pairs(lengths.cpu(), prefix_start.cpu(), min_gap, max_gap, k.cpu(), seed)
    return to_device(row, lengths.device), to_device(i, lengths.device), to_device(j, lengths.device)


def sample_listed(p: Pairs, L: int, k, generator=None):
    """k[r] pairs of row r, uniform without replacement (docs/contract.md §5), from the enumerated
    pair set of `p` (packed rows, §10: the C++ sampler walks a row's triangle, not its documents).
    Every pair draws a uniform key; a row keeps its k[r] smallest keys. O(|P| log |P|) work and
    memory, on p's device."""
    ia, ib, _ = flat_pairs(p, L)
    dev = ia.device
    gen_dev = generator.device if generator is not None else "cpu"
    keys = torch.rand(ia.numel(), generator=generator, device=gen_dev, dtype=torch.float64).to(dev)
    row = ia // L
    # row + key sorts by row, then by key within the row (rows < 2**31 keep 21 bits of the key)
    order = torch.sort(row.double() + keys).indices
    row_sorted = row[order]
    start = _exclusive_cumsum(torch.bincount(row, minlength=p.lengths.numel()))[:-1]
    rank = torch.arange(ia.numel(), device=dev) - start[row_sorted]
    keep = order[rank < k[row_sorted]]
    keep = keep.sort().values  # back in (row, i, j) order
    return row[keep], ia[keep] % L, ib[keep] % L


def _fail(cls, msg):
    raise cls(msg)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """t on `device`. A host tensor bound for a GPU goes through pinned memory without blocking: a
    copy from pageable memory waits for the stream, so one small upload in the loss would stall the
    host until the encoders' queued work is done (pinned blocks are reused only after their copy)."""
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        # a fresh pinned block, even for a pinned t: the caller may reuse its own buffer at once
        staged = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        return staged.to(device, non_blocking=True)
    return t.to(device)


def host_known(x) -> bool:
    """`x` (lengths or prefix_start as belief_state_loss takes them) is read without a device sync:
    None, an int or a CPU tensor."""
    return x is None or isinstance(x, int) or (torch.is_tensor(x) and x.device.type == "cpu")


def _as_row_vector(x, name, B, device):
    """An int or (B,) integer tensor as a (B,) int64 tensor on `device`."""
    if isinstance(x, bool):
        _fail(ValueError, f"{name} must be an int or a (B,) integer tensor, got a bool")
    if isinstance(x, int):
        if not -2**63 <= x < 2**63:
            _fail(ValueError, f"{name} must fit in int64, got {x}")
        return torch.full((B,), x, dtype=torch.int64, device=device)
    if not torch.is_tensor(x) or x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex():
        _fail(ValueError if torch.is_tensor(x) else ArgumentTypeError,
              f"{name} must be an int or a (B,) integer tensor, got {type(x).__name__}"
              + (f" of dtype {x.dtype}" if torch.is_tensor(x) else ""))
    if tuple(x.shape) != (B,):
        _fail(ValueError, f"{name} must have shape ({B},), one value per row of the batch, got {tuple(x.shape)}")
    _check_not_meta(name, x, device)
    return to_device(x.to(dtype=torch.int64).contiguous(), device)  # kernels read it with stride 1


def _check_not_meta(name, x, device):
    """A meta tensor holds no values to copy to a batch elsewhere (torch's own error names nothing)."""
    if x.is_meta and torch.device(device).type != "meta":
        _fail(ValueError, f"{name} is on the meta device, which holds no values: give it on the CPU or on "
                          f"the batch's device ({device})")


def row_problems(tokens, lengths, vocab_size):
    """Two masks, no synchronisation: lengths outside [0, L] (on lengths' device), and ids outside
    [0, vocab_size) at valid positions (token_problems, on tokens' device)."""
    L = tokens.shape[1]
    return (lengths < 0) | (lengths > L), token_problems(tokens, lengths, vocab_size)


def token_problems(tokens, lengths, vocab_size):
    """The mask of ids outside [0, vocab_size) at valid positions (every token a row can use as a
    label; padding is not checked), no synchronisation; vocab_size None checks no id (all False)."""
    L = tokens.shape[1]
    if vocab_size is None:
        return torch.zeros_like(tokens, dtype=torch.bool)
    valid = torch.arange(L, device=tokens.device)[None] < to_device(lengths, tokens.device).clamp(0, L)[:, None]
    return valid & ((tokens < 0) | (tokens >= vocab_size))


def _raise_length(lengths, bad_len, L):
    r = int(bad_len.nonzero()[0])
    _fail(ValueError, f"lengths must lie in [0, L={L}], got lengths[{r}] = {int(lengths[r])}")


def _raise_start(prefix_start, bad_start):
    r = int(bad_start.nonzero()[0])
    _fail(ValueError, f"prefix_start must be >= 0, got prefix_start[{r}] = {int(prefix_start[r])}")


def _raise_token(tokens, bad_tok, vocab_size):
    r, t = (int(x) for x in bad_tok.nonzero()[0])
    _fail(TokenIdError, f"tokens must lie in [0, vocab_size={vocab_size}) at valid positions, got tokens[{r}, {t}] = {int(tokens[r, t])}")


def raise_on_bad_tokens(tokens, bad_tok, vocab_size):
    """token_problems' mask as the error naming the first bad token: one host read of its flag
    (the triton op's for a host pair set, once its kernels are queued)."""
    if bool(bad_tok.any()):
        _raise_token(tokens, bad_tok, vocab_size)


def check_rows(tokens, lengths, vocab_size):
    """row_problems as errors naming the argument (one host read of both flags)."""
    bad_len, bad_tok = row_problems(tokens, lengths, vocab_size)
    flags = torch.stack([bad_len.any(), bad_tok.any()]).tolist()
    if flags[0]:
        _raise_length(lengths, bad_len, tokens.shape[1])
    if flags[1]:
        _raise_token(tokens, bad_tok, vocab_size)


def check_f(f):
    """f is a floating-point (B, L, m) tensor: the first check of belief_state_loss (the head's
    checks read f's width and dtype) and of prepare."""
    if not torch.is_tensor(f) or f.dim() != 3:
        _fail(ValueError if torch.is_tensor(f) else ArgumentTypeError, f"f must be a (B, L, m) tensor, got {tuple(f.shape) if torch.is_tensor(f) else type(f).__name__}")
    if not f.dtype.is_floating_point:
        _fail(ValueError, f"f must be floating point (float32, float16, bfloat16 or float64), got {f.dtype}")


def check_documents(documents, lengths, B, L, device, values: bool = True):
    """`documents` (docs/contract.md §10) is a (B, L) integer tensor of document ids, or a
    (prefix_ids, suffix_ids) pair of them, on `device`; each non-decreasing along every row's valid
    positions (one run per document: a run never comes back). The kinds and shapes are checked
    here; the values (a host sync) here too with `values`, else returned for the caller's one sync:
    [(name, ids, (B, L-1) mask of the positions where the ids go down)]."""
    sides = documents if isinstance(documents, (tuple, list)) else (documents,)
    tensors = all(map(torch.is_tensor, sides))
    if isinstance(documents, (tuple, list)) and (len(documents) != 2 or not tensors):
        _fail(ValueError if len(documents) != 2 else ArgumentTypeError, f"documents must be a (B, L) tensor of ids or a (prefix_ids, suffix_ids) pair, "
                          f"got a {type(documents).__name__} of {len(documents)}"
                          + ("" if tensors else " that are not all tensors"))
    names = ["documents"] if len(sides) == 1 else ["documents[0] (prefix ids)", "documents[1] (suffix ids)"]
    downs = []
    for name, ids in zip(names, sides):
        if not torch.is_tensor(ids) or not id_dtype_ok(ids.dtype):
            _fail(ValueError if torch.is_tensor(ids) else ArgumentTypeError,
                  f"{name} must be a (B, L) integer tensor ({ID_DTYPES}) of document ids, got "
                              + (f"{ids.dtype}" if torch.is_tensor(ids) else type(ids).__name__))
        if tuple(ids.shape) != (B, L):
            _fail(ValueError, f"{name} must have shape (B, L) = ({B}, {L}), the batch's, got {tuple(ids.shape)}")
        if ids.device != device:
            _fail(ValueError, f"{name} must be on the batch's device ({device}), got {ids.device}")
        t = torch.arange(1, L, device=device)[None]
        downs.append((name, ids, (ids[:, 1:] < ids[:, :-1]) & (t < lengths[:, None])))
    if values:
        for down, bad in zip(downs, torch.stack([d.any() for _, _, d in downs]).tolist()):
            if bad:
                _raise_down(*down)
    return downs


def _raise_down(name, ids, down):
    r, t = (int(x) for x in down.nonzero()[0])
    _fail(ValueError, f"{name} must be non-decreasing along each row's valid positions (one run of ids "
                      f"per document, in order; documents never overlap or interleave), got "
                      f"{name}[{r}, {t + 1}] = {int(ids[r, t + 1])} after {int(ids[r, t])}")


def _no_pair(reduction, host, tokens, lengths, vocab_size, message):
    """prepare's answer for a batch without pairs: the error of a mean, else None (a sum over
    nothing, 0). A host pair set left its tokens to the op, which will not run: checked here."""
    if reduction == "mean":
        _fail(ValueError, message)
    if host:
        raise_on_bad_tokens(tokens, token_problems(tokens, lengths, vocab_size), vocab_size)
    return None


def prepare(f, b, tokens, vocab_size, *, lengths, prefix_start, min_gap, max_gap, pairs,
            next_weight, reduction, generator, meet_token=None, documents=None, op_checks=False,
            device_sampler=False, host_pairs=False) -> Optional[Pairs]:
    """Check every argument of belief_state_loss and resolve the pair set; raise naming the argument.

    op_checks: the backend's op repeats the checks of values (the cpp op does), so under
    torch.compile they are skipped here and the traced graph has no break. device_sampler: rows
    without documents are subsampled by _device_sampler.sample_on_device (Switches.device_sampler,
    which belief_state_loss passes), else by the C++ sampler.

    host_pairs: the backend's op takes a listed pair set on the host (the triton op builds its pair
    list there) and checks the tokens itself. A listed set (sampled by the C++ sampler without
    documents, or an explicit triple given on the CPU) is then resolved on the host whenever
    lengths and prefix_start are host-known (None, ints or CPU tensors): the returned Pairs holds
    them, the pairs and their weights on the CPU, and nothing here reads the device, so the host
    draws and checks the pairs while the GPU still runs the encoders.

    A batch with no valid pair raises for reduction "mean" (a mean over nothing) and returns None
    for "sum" and "row_mean", whose value is then 0 (belief_state_loss): a trainer's micro-batch of
    short rows, normalised by the whole batch's count, adds nothing. Skipped checks (compiled) leave
    it to the op, which raises."""
    check_f(f)
    if not torch.is_tensor(b) or tuple(b.shape) != tuple(f.shape):
        _fail(ValueError if torch.is_tensor(b) else ArgumentTypeError, f"b must have the shape of f {tuple(f.shape)}, got {tuple(b.shape) if torch.is_tensor(b) else type(b).__name__}")
    if b.dtype != f.dtype:
        _fail(ValueError, f"b must have the dtype of f ({f.dtype}), got {b.dtype}")
    if b.device != f.device:
        _fail(ValueError, f"b must be on the device of f ({f.device}), got {b.device}")
    B, L, _ = f.shape
    if not torch.is_tensor(tokens) or tuple(tokens.shape) != (B, L):
        _fail(ValueError if torch.is_tensor(tokens) else ArgumentTypeError, f"tokens must have shape (B, L) = ({B}, {L}) to match f, got {tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
    if not id_dtype_ok(tokens.dtype):
        _fail(ValueError, f"tokens must be an integer tensor ({ID_DTYPES}), got {tokens.dtype}")
    if tokens.device != f.device:
        _fail(ValueError, f"tokens must be on the device of f ({f.device}), got {tokens.device}")
    if meet_token is not None and not is_int(meet_token):
        _fail(ArgumentTypeError, f"meet_token must be None or an int token id, got {type(meet_token).__name__} {meet_token!r}")
    if meet_token is not None and not (0 <= meet_token and (vocab_size is None or meet_token < vocab_size)):
        _fail(ValueError, f"meet_token must lie in [0, vocab_size={vocab_size}), got {meet_token}")
    if not is_int(min_gap) or min_gap < 1:
        _fail(ValueError if is_int(min_gap) else ArgumentTypeError,
              f"min_gap must be an int >= 2 (or 1 with meet_token, docs/contract.md §8), got {min_gap!r}")
    if min_gap == 1 and meet_token is None:
        _fail(ValueError, "min_gap=1 needs meet_token: a pair with j - i = 1 has no token between prefix and suffix "
                          "(its Next label tokens[r, i+1] is the suffix's first token, its Prev label the prefix's "
                          "last), so both its labels are meet_token (docs/contract.md §8; the official "
                          "bst_single_gap_prediction_mode 'eos' is meet_token=<the EOS id>)")
    if max_gap is not None and (not is_int(max_gap) or max_gap < min_gap):
        _fail(ValueError if is_int(max_gap) else ArgumentTypeError,
              f"max_gap must be None or an int >= min_gap ({min_gap}), got {max_gap!r}")
    number = isinstance(next_weight, (int, float)) and not isinstance(next_weight, bool)
    if not number or not 0.0 <= next_weight <= 1.0:
        _fail(ValueError if number else ArgumentTypeError,
              f"next_weight must be a number in [0, 1], got {next_weight!r}")
    if reduction not in REDUCTIONS:
        _fail(ValueError, f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        _fail(ArgumentTypeError, f"generator must be None or a torch.Generator, got {type(generator).__name__}")
    # with the other arguments, before any early return: a batch of short rows (no pair, a loss of 0
    # under "sum" and "row_mean") hid a bad fraction or count
    if pairs is not None and not isinstance(pairs, (tuple, list)):
        if isinstance(pairs, bool) or not isinstance(pairs, (int, float)):
            _fail(ArgumentTypeError, f"pairs must be None, a float fraction in (0, 1], an int count per row or a (row, i, j) triple, got {type(pairs).__name__}")
        if isinstance(pairs, float) and not 0.0 < pairs <= 1.0:
            _fail(ValueError, f"pairs as a fraction must lie in (0, 1], got {pairs}")
        if isinstance(pairs, int) and pairs < 1:
            _fail(ValueError, f"pairs as a count per row must be >= 1, got {pairs}")

    dev = f.device
    sampled = isinstance(pairs, (int, float)) and not isinstance(pairs, bool)
    given_on_host = isinstance(pairs, (tuple, list)) and all(torch.is_tensor(x) and x.device.type == "cpu" for x in pairs)
    # (a generator on a GPU would be read there for the draw's seed: not on the host then)
    host = (host_pairs and documents is None and host_known(lengths) and host_known(prefix_start)
            and ((sampled and not device_sampler and (generator is None or generator.device.type == "cpu"))
                 or given_on_host))
    if host:
        dev = torch.device("cpu")  # the pair set's device from here on; the tokens stay where they are
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.int64, device=dev)
    else:
        lengths = _as_row_vector(lengths, "lengths", B, dev)
    prefix_start = _as_row_vector(prefix_start, "prefix_start", B, dev)
    # Clipping the gaps and prefix_start to L keeps the pair set and keeps every i + gap far from
    # int64 overflow, here and in the engines (a min_gap or prefix_start near 2**63 wrapped around).
    min_gap = min(min_gap, max(L, 2))
    gmax = L if max_gap is None else min(max_gap, L)
    gmax = max(gmax, min_gap)
    # A compiled graph skips these checks (the op repeats them), unless pairs are sampled: the
    # sampler runs first, here, its work growing with the lengths, and it synchronises anyway.
    checking = not (op_checks and torch.compiler.is_compiling()) or sampled
    bounds, downs = None, []
    if documents is not None:
        # the ops never see the documents, only the pairs they allow: their order is checked here,
        # with the other checks' one sync (or alone, under a compiled graph that skips those)
        downs = check_documents(documents, lengths, B, L, dev, values=not checking)
        bounds = document_bounds(documents, lengths, L)
    counts = prefix_counts(lengths, prefix_start.clamp(max=L), min_gap, gmax, L, bounds).sum(1)
    total = counts.sum()
    if checking:
        # resolved on the host, the tokens are left to the op (host_pairs): no flag here reads the device
        bad_len, bad_tok = row_problems(tokens, lengths, None if host else vocab_size)
        bad_start = prefix_start < 0
        no_pair = (total == 0) & (not isinstance(pairs, (tuple, list)))
        tok_flag = torch.zeros((), dtype=torch.bool) if host else bad_tok.any()
        flags = [bad_len.any(), bad_start.any(), tok_flag] + [d.any() for _, _, d in downs] + [no_pair]
        if any(x.device.type == "meta" for x in flags):  # a GPU stand-in can take host pair sets, no more
            _fail(ValueError, "the inputs are on the meta device, which holds no values, and the loss must read the "
                              "token ids and lengths to check them and build its pair set; use CPU or GPU tensors")
        any_bad = torch.stack(flags).tolist()  # one sync (none on the host)
        if any_bad[0]:
            _raise_length(lengths, bad_len, L)
        if any_bad[1]:
            _raise_start(prefix_start, bad_start)
        if any_bad[2]:
            _raise_token(tokens, bad_tok, vocab_size)
        for down, bad in zip(downs, any_bad[3:-1]):
            if bad:
                _raise_down(*down)
        if any_bad[-1]:
            return _no_pair(reduction, host, tokens, lengths, vocab_size, NO_PAIR)
    prefix_start = prefix_start.clamp(max=L)
    # only a pair set with gap-1 pairs carries the token: with min_gap >= 2 every backend runs as without it
    common = dict(lengths=lengths, prefix_start=prefix_start, min_gap=min_gap, max_gap=gmax,
                  meet_token=meet_token if min_gap == 1 else None, bounds=bounds, host=host)

    if pairs is None:
        if reduction == "row_mean":  # docs/contract.md §9: 1 / (|P_r| B); a row with no pair weighs nothing
            scale = (counts > 0) / (counts.clamp(min=1).double() * B)
        else:
            scale = 1.0 / total.double() if reduction == "mean" else torch.ones((), dtype=torch.float64, device=dev)
        return Pairs(scale=scale, **common)

    if isinstance(pairs, (tuple, list)):
        if len(pairs) != 3 or not all(torch.is_tensor(x) for x in pairs):
            _fail(ValueError if len(pairs) != 3 else ArgumentTypeError,
                  "pairs given explicitly must be a (row, i, j) triple of int64 tensors")
        row, i, j = pairs
        if any(x.dtype.is_floating_point or x.dtype == torch.bool or x.is_complex() or x.dim() != 1
               for x in (row, i, j)) \
                or not (row.shape == i.shape == j.shape):
            _fail(ValueError, "pairs (row, i, j) must be three 1-D integer tensors of one length, got "
                              + ", ".join(f"{x.dtype} {tuple(x.shape)}" for x in (row, i, j)))
        if row.numel() == 0:
            return _no_pair(reduction, host, tokens, lengths, vocab_size,
                            "pairs is an empty (row, i, j) triple: the batch has no valid pair at all")
        for name, x in zip(("pairs[0] (row)", "pairs[1] (i)", "pairs[2] (j)"), (row, i, j)):
            _check_not_meta(name, x, dev)
        row, i, j = (to_device(x.to(dtype=torch.int64), dev) for x in (row, i, j))
        if B == 0:
            _fail(ValueError, f"pairs[0] = (row={int(row[0])}, i={int(i[0])}, j={int(j[0])}) is not a valid pair: "
                              f"the batch has no rows")
        in_batch = (row >= 0) & (row < B)
        rc = row.clamp(0, B - 1)
        # With i and j checked to lie in [0, L), a j - i that overflowed (i near 2**63) is harmless.
        gap = j - i
        ok = in_batch & (i >= 0) & (i < L) & (j >= 0) & (j < L) & (i >= prefix_start[rc]) \
            & (gap >= min_gap) & (gap <= gmax) & (j <= lengths[rc] - 1)
        if bounds is not None:  # §10: j in the suffix run of prefix i's document
            ic = i.clamp(0, L - 1)
            ok = ok & (j >= bounds[0][rc, ic]) & (j <= bounds[1][rc, ic])
        # The op repeats the §2 check under a compiled graph, but it never sees the documents:
        # listed pairs across documents are checked here in either mode (one sync).
        if (checking or bounds is not None) and not bool(ok.all()):
            k = int((~ok).nonzero()[0])
            _fail(ValueError, f"pairs[{k}] = (row={int(row[k])}, i={int(i[k])}, j={int(j[k])}) is not a valid pair: "
                              f"docs/contract.md §2 needs 0 <= row < {B}, prefix_start <= i and "
                              f"i + min_gap <= j <= min(i + max_gap, lengths[row] - 1)"
                              + (", and §10 i and j in one document" if bounds is not None else ""))
        if reduction == "row_mean":  # docs/contract.md §9: 1 / (n_r B), n_r the pairs listed for row r
            listed = torch.bincount(rc, minlength=B)
            weight = 1.0 / (listed[rc].double() * B)
        else:
            w = 1.0 / row.numel() if reduction == "mean" else 1.0
            weight = torch.full((row.numel(),), w, dtype=torch.float64, device=dev)
        return Pairs(scale=torch.ones((), dtype=torch.float64, device=dev), row=row, i=i, j=j, weight=weight, **common)

    k = sample_counts(pairs, counts)
    if bounds is None:
        sampler = sample_on_device if device_sampler else sample_pairs
        row, i, j = sampler(lengths, prefix_start, min_gap, gmax, k, generator)
    else:
        row, i, j = sample_listed(Pairs(scale=torch.ones((), dtype=torch.float64, device=dev), **common), L, k, generator)
    # docs/contract.md §5 estimator: each sampled pair of row r stands for |P_r| / k_r pairs of
    # weight w_r: 1/|P| (mean), 1 (sum) or 1 / (|P_r| B) (row_mean, §9), which leaves 1 / (k_r B).
    if reduction == "row_mean":
        weight = 1.0 / (k[row].double() * B)
    else:
        weight = counts[row].double() / k[row].double()
        if reduction == "mean":
            weight = weight / total.double()
    return Pairs(scale=torch.ones((), dtype=torch.float64, device=dev), row=row, i=i, j=j, weight=weight, **common)


def full_lengths(tokens, lengths=None, vocab_size=None):
    """The (B,) int64 lengths of a (B, L) batch of ids: `lengths` (an int or a (B,) integer tensor),
    or every row's full L when it is None. Checks the batch first, naming the argument: its shape
    and dtype always; on the CPU also lengths in [0, L] and, given vocab_size, the ids at valid
    positions. On a GPU those values are left to the loss's own check, which costs the step's one
    host sync (reverse_valid clamps its index meanwhile)."""
    if not torch.is_tensor(tokens) or tokens.dim() != 2:
        raise ValueError(f"tokens must be a (B, L) tensor of ids, got "
                         f"{tuple(tokens.shape) if torch.is_tensor(tokens) else type(tokens).__name__}")
    if not id_dtype_ok(tokens.dtype):
        raise ValueError(f"tokens must be an integer tensor ({ID_DTYPES}), got {tokens.dtype}")
    B, L = tokens.shape
    given = lengths is not None
    lengths = _as_row_vector(L if lengths is None else lengths, "lengths", B, tokens.device)
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling() and (given or vocab_size is not None):
        check_rows(tokens, lengths, vocab_size)
    return lengths
