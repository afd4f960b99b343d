"""The Belief State Transformer: GPT-2-style forward and backward encoders, a TextHead, an optional GPT head."""
from __future__ import annotations

import copy
import functools
import numbers
from dataclasses import dataclass
from typing import List, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .head import ResidualSwiGLUHead, TextHead, text_head_problem
from ._checks import TokenIdError, check_int, plain_number, short
from ._pairs import _as_row_vector, _raise_start, check_documents, full_lengths, host_known, id_dtype_ok
from .backends import under_torch_func
from .loss import belief_state_loss

HEAD_TYPES = ("mlp", "swiglu")  # ModelConfig.head_type: TextHead, ResidualSwiGLUHead


ATTENTIONS = ("sdpa", "flex")
FLEX_ON_CPU = ("model.attention 'flex' trains on a CUDA GPU only (torch's flex_attention has no backward on the "
               "CPU): use 'sdpa' there")


def inference(fn):
    """A decoder run under torch.no_grad with the model (its first argument) in eval mode, so that
    dropout does not make greedy decoding or beam search random; every submodule's own mode is
    restored afterwards (a model handed over in training mode keeps training)."""
    @functools.wraps(fn)
    def run(model, *args, **kwargs):
        module = model if isinstance(model, nn.Module) else getattr(model, "model", None)  # or a searcher's
        modes = [(m, m.training) for m in module.modules()] if isinstance(module, nn.Module) else []
        if modes:
            module.eval()
        try:
            with torch.no_grad():
                return fn(model, *args, **kwargs)
        finally:
            # train(mode), not the attribute: a module's own train() may do more; parents first, so
            # each submodule ends in its own mode
            for m, training in modes:
                m.train(training)
    return run


@dataclass
class ModelConfig:
    vocab_size: int = 56  # tokens, specials included
    max_len: int = 64  # positions the encoders can read (learned position embeddings)
    n_layer: int = 4  # transformer blocks per encoder
    d_model: int = 128  # width m of the residual stream and of f, b
    n_head: int = 4  # attention heads; d_model must divide by it
    mlp_ratio: float = 4.0  # MLP width = round(mlp_ratio * d_model), at least 1 (the paper's star-graph model uses 1)
    dropout: float = 0.0  # on the encoders' attention, MLP and embeddings (not in the text head: docs/results.md#heads)
    # one encoder for both directions, told apart by a segment embedding added once to the input
    # (the paper: "in each transformer residual block"; the official code has no shared variant)
    shared_encoders: bool = False  # with backward_encoder false there is nothing to share: no effect
    head_type: str = "mlp"  # "mlp": TextHead (the paper's); "swiglu": ResidualSwiGLUHead (the official code's)
    # the 'mlp' TextHead's shape; the 'swiglu' head is the official one, of its own width
    # (8 * 2m / 3 rounded to the nearest multiple of 128, at least 128) and form, and does not read these three
    head_hidden: Union[int, List[int]] = 256  # TextHead hidden width(s)
    head_layers: int = 2  # TextHead Linear layers
    head_activation: str = "gelu"  # TextHead activation
    head_tie_embedding: bool = False  # swiglu: its lm_head shares the forward encoder's token embedding
    gpt_head: bool = False  # add the plain next-token head on f (the paper's "improved BST"); the trainer sets it from gamma > 0
    backward_encoder: bool = True  # False: the "w/o backward" ablation, b is one learned vector for every suffix
    # packed rows' block-diagonal attention (docs/contract.md §10): "sdpa", a dense (B, T, T) mask, or
    # "flex", torch's flex_attention with a block mask (compiled; skips the blocks no document spans);
    # rows of one document each (star graphs, unpacked text) take causal SDPA under either
    attention: str = "sdpa"
    # recompute each encoder block's activations in the backward instead of keeping them: an encoder
    # keeps one (B, T, m) input a block, for about one more forward of the encoders a step (the
    # numbers are the same in eager mode; a block's pre-hooks and state run twice: docs/results.md,
    # Training). A resume may change it.
    activation_checkpointing: bool = False

    def check(self, prefix: str = "model."):
        """Raise a ValueError naming the first field out of range (`prefix` + its name). The head's
        fields are checked whichever head (and method) uses them, so that one config can switch heads
        and methods (`star` and `table` train several from one): head_hidden, head_layers and
        head_activation shape the 'mlp' TextHead only. shared_encoders is taken without a backward
        encoder too, where it has no effect."""
        def bad(name, want):
            raise ValueError(f"config field {prefix + name!r} must be {want}, got {getattr(self, name)!r}")

        # types first (a config file's loader checks them too; a ModelConfig built in Python may not)
        for name in ("vocab_size", "max_len", "n_layer", "d_model", "n_head"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                bad(name, "an int")
        for name in ("mlp_ratio", "dropout"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                bad(name, "a number")
        for name in ("shared_encoders", "head_tie_embedding", "gpt_head", "backward_encoder", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        for name in ("vocab_size", "max_len", "d_model", "n_head"):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        if self.n_layer < 0:
            bad("n_layer", ">= 0")
        if self.d_model % self.n_head:
            bad("n_head", f"a divisor of d_model ({self.d_model})")
        width = self.mlp_ratio * self.d_model if self.d_model <= 2**24 else float("inf")  # no float overflow
        # a finite MLP width, at most 16M units; Block rounds it, and a width rounded to 0 is refused, not clamped
        if not 0 < width <= 2**24 or round(width) < 1:
            bad("mlp_ratio", f"a number > 0 with round(mlp_ratio * d_model) in [1, 2**24] (d_model {self.d_model})")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", "in [0, 1)")
        if self.attention not in ATTENTIONS:
            bad("attention", f"one of {ATTENTIONS}")
        if self.attention == "flex" and self.dropout:
            bad("attention", "'sdpa' with dropout > 0 (flex_attention has no attention dropout)")
        if self.head_type not in HEAD_TYPES:
            bad("head_type", f"one of {HEAD_TYPES}")
        problem = text_head_problem(self.head_hidden, self.head_layers, self.head_activation)
        if problem is not None:  # TextHead's own check, named by field
            bad({"hidden": "head_hidden", "n_layers": "head_layers", "activation": "head_activation"}[problem[0]],
                problem[1])
        if self.head_tie_embedding and self.head_type != "swiglu":
            bad("head_tie_embedding", "false unless head_type is 'swiglu' (a TextHead has no lm_head to tie)")
        return self


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal SDPA attention."""

    def __init__(self, d: int, n_head: int, mlp_ratio: float, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        hidden = int(round(mlp_ratio * d))  # ModelConfig.check refuses a width that rounds to 0
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d), nn.Dropout(dropout))

    def attend(self, x, cache=None, mask=None):
        """mask: None (causal), a (B, 1, T, T) bool mask for SDPA, or a flex_attention BlockMask."""
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)  # (B, nh, T, hs)
        if cache is not None:  # incremental decoding: (k, v) of the positions already read
            if cache.get("k") is not None:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        causal = cache is None or T > 1
        if cache is not None and T > 1 and k.shape[2] != T:
            raise ValueError("a cached encoder reads a prompt once, then one token at a time")
        if mask is not None and not torch.is_tensor(mask):  # a BlockMask (ModelConfig.attention "flex")
            if x.device.type == "cpu" and torch.is_grad_enabled() and x.requires_grad:
                raise ValueError(FLEX_ON_CPU)
            # the mask covers whole blocks (document_mask): q, k and v padded to its length, the
            # padded queries' rows dropped; the real queries never see the padded keys (k <= q)
            pad = mask.seq_lengths[0] - T
            if pad:
                q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            y = _flex_attention()(q, k, v, block_mask=mask)[:, :, :T]
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))

    def forward(self, x, cache=None, mask=None):
        x = x + self.attend(self.ln1(x), cache, mask)
        return x + self.mlp(self.ln2(x))


class Encoder(nn.Module):
    """GPT-2-style causal encoder: token + learned position (+ segment) embeddings, blocks, final LayerNorm."""

    def __init__(self, cfg: ModelConfig, segments: int = 0):
        super().__init__()
        self.max_len, self.attention = cfg.max_len, cfg.attention
        self.activation_checkpointing = cfg.activation_checkpointing
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.seg = nn.Embedding(segments, cfg.d_model) if segments else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head, cfg.mlp_ratio, cfg.dropout)
                                    for _ in range(cfg.n_layer))
        self.ln = nn.LayerNorm(cfg.d_model)

    def forward(self, tokens, segment: Union[int, torch.Tensor] = 0, caches=None, offset: int = 0, documents=None):
        """(B, T) token ids -> (B, T, m) states; position t has read tokens[:, :t+1], or with
        `documents` ((B, T) document ids of packed rows) only its own document's tokens up to t,
        at positions counted from the document's start. `segment` (an encoder with segments): one
        id for every row, or a (B,) long tensor of each row's own (both directions in one call)."""
        if id_dtype_ok(tokens.dtype):  # int8..int64, uint8 as int64 (the embedding reads int64, int32);
            tokens = tokens.long()       # a float or bool is left for the embedding to refuse
        T = tokens.shape[1]
        if caches:  # the positions the caches hold: a new token's position is the next one
            held = caches[0].get("k")
            read = 0 if held is None else held.shape[2]
            if offset != read:
                raise ValueError(f"offset must be the number of positions the caches hold ({read}), got {offset}")
        if offset + T > self.max_len:
            raise ValueError(f"tokens of {offset + T} positions (padding included) exceed the encoder's max_len "
                             f"{self.max_len}: a batch's width must fit it (drop padding columns past the longest row)")
        mask = None
        if documents is None:
            x = self.tok(tokens) + self.pos(torch.arange(offset, offset + T, device=tokens.device))[None]
        else:
            if caches is not None or offset:
                raise ValueError("packed documents are encoded whole, not decoded incrementally")
            x = self.tok(tokens) + self.pos(document_positions(documents))
            # block-diagonal causal attention: a position reads its own document's earlier positions
            mask = document_mask(documents, self.attention)
        if self.seg is not None:
            if torch.is_tensor(segment):  # one segment per row
                x = x + self.seg.weight[segment][:, None]
            else:
                x = x + self.seg.weight[segment]
        x = self.drop(x)
        # (not inside a torch.func transform, whose grad and vjp refuse checkpoint's saved-tensor hooks:
        # the same numbers, without the memory saved)
        if self.activation_checkpointing and caches is None and torch.is_grad_enabled() and not under_torch_func():
            # each block's input alone is kept; the backward runs the block again, with the dropout
            # masks of its forward (the RNG state is restored) and the parameters it read then (a
            # functional_call's, which are no longer the module's by the backward), before its gradients
            for block in self.blocks:
                params = dict(block.named_parameters())
                x = checkpoint(lambda x, block=block, params=params: functional_call(block, params, (x, None, mask)),
                               x, use_reentrant=False)
        else:
            for k, block in enumerate(self.blocks):
                x = block(x, None if caches is None else caches[k], mask)
        return self.ln(x)


def document_mask(documents, attention: str = "sdpa"):
    """Causal attention within each document of packed rows ((B, T) ids): for "sdpa" a (B, 1, T, T)
    bool mask, for "flex" a BlockMask (flex_attention then skips every block no document spans)."""
    B, T = documents.shape
    if attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        # Made for a whole number of blocks (Block.attend pads q, k and v to it): torch 2.13's
        # compiled CPU flex_attention read past a partial last block (T = 40: errors of order 1 and
        # NaNs, varying run to run), as torch has done on the GPU before. A padded position takes
        # the row's last document id; padded queries' rows are dropped.
        n = -(-T // _FLEX_BLOCK) * _FLEX_BLOCK
        padded = torch.cat([documents, documents[:, -1:].expand(B, n - T)], 1)

        def within(b, h, q, k):
            return (k <= q) & (padded[b, q] == padded[b, k])
        return create_block_mask(within, B, None, n, n, device=documents.device, BLOCK_SIZE=_FLEX_BLOCK)
    t = torch.arange(T, device=documents.device)
    return ((t[None, :] <= t[:, None])[None] & (documents[:, :, None] == documents[:, None, :]))[:, None]


_FLEX = []
_FLEX_BLOCK = 128  # flex_attention's default block (create_block_mask's BLOCK_SIZE)


def _flex_attention():
    """flex_attention compiled once per process (uncompiled it is a slow reference implementation)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def document_positions(documents):
    """(B, T) positions counted from each document's first position (a packed row's documents are
    runs of one id)."""
    t = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    start = torch.ones_like(documents, dtype=torch.bool)
    start[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return t - torch.where(start, t, torch.zeros_like(t)).cummax(1).values


def reverse_valid(tokens, lengths):
    """Each row's valid part reversed, padding kept at the end: out[r, t] = tokens[r, len_r - 1 - t]."""
    L = tokens.shape[1]
    t = torch.arange(L, device=tokens.device)[None]
    idx = (lengths[:, None] - 1 - t).clamp(0, L - 1)
    out = tokens.gather(1, idx)
    return torch.where(t < lengths[:, None], out, tokens), idx


def _suffix_input(tokens, lengths, documents=None):
    """(rev, idx, rev_docs): the backward encoder's input (reverse_valid's rows and gather index)
    and the suffix side's document ids reversed alike (None without documents)."""
    rev, idx = reverse_valid(tokens, lengths)
    # Reversed, a packed row's documents each read from their own end (the mask and positions
    # follow the reversed ids); the order of the documents does not matter.
    documents = document_sides(documents)[1]
    return rev, idx, None if documents is None else documents.gather(1, idx)


def _gather_back(states, idx):
    """The backward encoder's (B, L, m) states aligned with the tokens: the state at reversed
    position len-1-j has read the suffix from j, gathered back to j."""
    return states.gather(1, idx[..., None].expand_as(states))


def document_sides(documents):
    """(prefix_ids, suffix_ids) of belief_state_loss's `documents` (docs/contract.md §10): one
    (B, L) tensor serves both encoders, a pair gives the forward and the backward encoder their own."""
    if documents is None or not isinstance(documents, (tuple, list)):
        return documents, documents
    return tuple(documents)


def next_token_mask(lengths, prefix_start, L, documents=None):
    """(B, L-1) bool: the positions i whose target tokens[i+1] is trained, prefix_start <= i <= len - 2
    (packed rows: where i and i + 1 are in one document, the pair (i, i + 1) of §10)."""
    i = torch.arange(max(L - 1, 0), device=lengths.device)[None]  # L = 0: no position
    ps = torch.as_tensor(prefix_start, device=lengths.device).reshape(-1, 1)
    mask = (i >= ps) & (i <= lengths[:, None] - 2)
    if documents is not None:
        prefix_ids, suffix_ids = document_sides(documents)
        mask = mask & (prefix_ids[:, :-1] == suffix_ids[:, 1:])
    return mask


def next_token_loss(lm_head, f, tokens, lengths, prefix_start=0, total=None, documents=None):
    """Plain next-token CE of lm_head(f_i) against tokens[i+1] over next_token_mask's positions."""
    mask = next_token_mask(lengths, prefix_start, tokens.shape[1], documents)  # (B, L-1)
    logits = lm_head(f[:, :-1])  # 16-bit logits upcast to float32; a float64 model's kept
    targets = tokens[:, 1:].masked_fill(~mask, 0)  # the untrained ones not read: padding may hold any id
    ce = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).transpose(1, 2), targets,
                         reduction="none")
    if total is None:
        total = mask.sum()
        if not torch.compiler.is_compiling() and int(total) == 0:  # the trainer passes its total: no sync
            raise ValueError("the batch has no next-token position: every row is too short for prefix_start and lengths")
    return (ce * mask).sum() / total


def checked_batch(tokens, lengths, documents, vocab_size, values: bool = True):
    """(tokens, lengths) of a batch checked as forward checks it, naming the argument (full_lengths,
    check_documents; `values` as check_documents takes it): the tokens as int64 (any id dtype
    full_lengths takes, int8..int64 and uint8: the embedding and the cross-entropy read int64), with
    the padding set to 0. Padding is never read (docs/contract.md §1) and may hold any id, -1 or V
    too, which the embedding would index all the same."""
    lengths = full_lengths(tokens, lengths, vocab_size)
    if documents is not None:
        check_documents(documents, lengths, *tokens.shape, tokens.device, values=values)
    padding = torch.arange(tokens.shape[1], device=tokens.device)[None] >= lengths[:, None]
    return tokens.long().masked_fill(padding, 0), lengths


# what forward's totals must be (the pair_total wording is the one the trainer's tests have long matched)
TOTALS = {"pair_total": "> 0, a finite number (the whole batch's pair count divided by the number of DDP ranks, "
                        "|P| / world; 0: it has no valid pair at all)",
          "token_total": "a finite number > 0 (the whole batch's next-token target count divided by the number of "
                         "DDP ranks)",
          "row_total": "a finite number > 0 (the whole batch's row count divided by the number of DDP ranks)"}


def check_total(name: str, value):
    """A trainer's count that replaces the batch's own as a mean's divisor (TOTALS), as the divisor:
    None or a finite number > 0, never a bool (0 divided by zero, a negative count flipped the loss's
    sign, inf made it 0). A one-element real tensor (an all-reduced count) is taken too: on the host
    as its number; elsewhere as a 0-d tensor out of autograd, its value unchecked (reading it would
    cost a sync a step), so that the loss keeps its 0-d shape."""
    if torch.is_tensor(value) and value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
        if value.device.type != "cpu":
            return value.detach().reshape(())
        value = value.item()
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not 0 < value < float("inf")):  # nan too
        raise ValueError(f"{name} must be {TOTALS[name]}, got {short(value)}")
    return value


def check_prefix_start(prefix_start, B: int):
    """prefix_start as belief_state_loss checks it (an int or a (B,) integer tensor, >= 0), for the
    models whose loss does not: its values where they are on the host (a GPU tensor's are not read
    back, which would cost a sync a step; the tokens' are left alike, full_lengths)."""
    ps = _as_row_vector(prefix_start, "prefix_start", B, prefix_start.device if torch.is_tensor(prefix_start) else "cpu")
    if ps.device.type == "cpu" and bool((ps < 0).any()):
        _raise_start(ps, ps < 0)


# The keywords Objective passes every model (tasks.Objective.__call__) that only the belief loss reads:
# the next-token models take them and ignore them, and refuse any other (a typo's `document=` trained
# packed rows as one document).
BELIEF_ONLY = ("pairs", "next_weight", "gamma", "backend", "min_gap", "max_gap", "meet_token", "reduction",
               "generator", "pair_total", "row_total")


def check_reduction(reduction):
    """A model's loss is a mean (over pairs, or of rows' means): "sum" is the loss function's alone."""
    if reduction not in ("mean", "row_mean"):
        raise ValueError(f"reduction must be 'mean' or 'row_mean' for a model's loss, got {reduction!r}")


def check_belief_only(model, options):
    """`options` (a next-token model's other keywords) are all BELIEF_ONLY; reduction as the BST's."""
    unknown = sorted(set(options) - set(BELIEF_ONLY))
    if unknown:
        raise TypeError(f"{type(model).__name__}.forward got an unexpected keyword argument {unknown[0]!r} (it "
                        f"takes lengths, prefix_start, token_total and documents, and ignores {', '.join(BELIEF_ONLY)})")
    check_reduction(options.get("reduction", "mean"))


def _init_weights(module):
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)


class BeliefStateTransformer(nn.Module):
    """Forward encoder F, backward encoder B (separate or shared), a text head (TextHead or
    ResidualSwiGLUHead, cfg.head_type), optional GPT head (docs/contract.md §1-§4)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # a copy: the caller's config changed later would no longer describe these layers
        self.cfg = cfg = copy.deepcopy(cfg).check()
        shared = cfg.shared_encoders and cfg.backward_encoder
        self.forward_encoder = Encoder(cfg, segments=2 if shared else 0)
        self.backward_encoder = Encoder(cfg) if cfg.backward_encoder and not shared else None
        # Without a backward encoder the head still sees [f ; b], with b a learned constant: it keeps
        # both heads and every pair, but no suffix information reaches them.
        self.suffix_constant = None if cfg.backward_encoder else nn.Parameter(torch.zeros(cfg.d_model))
        if cfg.head_type == "swiglu":
            self.head = ResidualSwiGLUHead(cfg.d_model, cfg.vocab_size)
        else:
            self.head = TextHead(cfg.d_model, cfg.vocab_size, cfg.head_hidden, cfg.head_layers, cfg.head_activation)
        self.gpt = nn.Linear(cfg.d_model, cfg.vocab_size) if cfg.gpt_head else None
        _init_weights(self)
        if cfg.head_tie_embedding:
            self.head.tie(self.forward_encoder.tok)

    def prefix_states(self, tokens, documents=None, *, lengths=None):
        """f: (B, L, m); f[r, i] has read tokens[r, 0..i] (packed rows: from its document's start;
        `documents` as belief_state_loss takes them). The batch is checked as forward checks it,
        every position valid unless `lengths` (as forward takes them) says where the padding is."""
        tokens, _ = checked_batch(tokens, lengths, documents, self.cfg.vocab_size)
        return self._prefix_states(tokens, documents)

    def _prefix_states(self, tokens, documents=None):
        """prefix_states of a batch forward has checked."""
        return self.forward_encoder(tokens, segment=0, documents=document_sides(documents)[0])

    def suffix_states(self, tokens, lengths=None, documents=None):
        """b: (B, L, m) aligned with tokens; b[r, j] has read tokens[r, j..len_r-1] (read backwards;
        packed rows: to its document's end). The batch is checked as forward checks it."""
        tokens, lengths = checked_batch(tokens, lengths, documents, self.cfg.vocab_size)
        return self._suffix_states(tokens, lengths, documents)

    def _suffix_states(self, tokens, lengths, documents=None):
        """suffix_states of a batch forward has checked: (B,) lengths."""
        if self.suffix_constant is not None:
            return self.suffix_constant.expand(*tokens.shape, -1).contiguous()
        rev, idx, rev_docs = _suffix_input(tokens, lengths, documents)
        if self.backward_encoder is None:
            states = self.forward_encoder(rev, segment=1, documents=rev_docs)
        else:
            states = self.backward_encoder(rev, documents=rev_docs)
        return _gather_back(states, idx)

    def _states(self, tokens, lengths, documents=None):
        """(f, b) of a batch forward has checked. Shared encoders: one encoder call over 2B rows,
        the tokens (segment 0) stacked on their reversals (segment 1), so that each layer runs one
        set of kernels with twice the rows (the same f and b as prefix_states and _suffix_states)."""
        if self.suffix_constant is not None or self.backward_encoder is not None:
            return self._prefix_states(tokens, documents), self._suffix_states(tokens, lengths, documents)
        B = tokens.shape[0]
        rev, idx, rev_docs = _suffix_input(tokens, lengths, documents)
        prefix_docs = document_sides(documents)[0]
        docs = None if prefix_docs is None else torch.cat([prefix_docs, rev_docs])
        segment = torch.arange(2 * B, device=tokens.device) // B  # rows 0..B-1: 0, rows B..2B-1: 1
        states = self.forward_encoder(torch.cat([tokens, rev]), segment=segment, documents=docs)
        return states[:B], _gather_back(states[B:], idx)

    def empty_suffix(self, eos_id: int):
        """B(∅): the backward state of a sequence holding EOS alone, (m,)."""
        eos_id = check_int("eos_id", eos_id, 0)
        if eos_id >= self.cfg.vocab_size:
            raise ValueError(f"eos_id must lie in [0, vocab_size={self.cfg.vocab_size}), got {eos_id}")
        eos = torch.full((1, 1), eos_id, dtype=torch.long, device=self.forward_encoder.tok.weight.device)
        return self.suffix_states(eos)[0, 0]

    def logits(self, f, b):
        """Next and Prev logits, each (..., V), for prefix states f and suffix states b (broadcast)."""
        f, b = torch.broadcast_tensors(f, b)
        out = self.head(torch.cat([f, b], dim=-1))
        V = self.cfg.vocab_size
        return out[..., :V], out[..., V:]

    def forward(self, tokens, lengths=None, *, prefix_start=0, pairs=None, next_weight=0.5, gamma=0.0,
                generator=None, pair_total=None, token_total=None, backend="auto", min_gap=2, max_gap=None,
                meet_token=None, reduction="mean", row_total=None, documents=None):
        """Losses of a batch: dict(total, belief, gpt). The belief loss's options (pairs, min_gap,
        max_gap, meet_token, documents, next_weight, reduction "mean" or "row_mean") are
        belief_state_loss's; with `documents` (packed rows) the encoders read each document alone.
        pair_total / token_total / row_total replace the batch's own pair, token and row counts as
        the mean's divisor (set by the trainer, so that ranks and micro-batches average exactly): the
        whole global batch's count divided by the number of ranks DDP averages the gradients over
        (|P| / world; a loop that sums micro-batches on one rank divides by the batch's whole |P|)."""
        check_reduction(reduction)
        gamma = plain_number(gamma)  # np.float32 from a config read through numpy, as the loss's options
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
        if gamma > 0 and self.gpt is None:
            raise ValueError("gamma > 0 weighs the GPT head's loss, but the model has none (ModelConfig.gpt_head)")
        pair_total, token_total, row_total = (check_total(name, total) for name, total in (
            ("pair_total", pair_total), ("token_total", token_total), ("row_total", row_total)))
        # lengths given on the host (the trainer's, or None, or an int) reach the loss as given: it
        # draws and lists a subsample there without reading the GPU (prepare's host_pairs), while the
        # encoders run; the encoders take them on the tokens' device
        given = lengths
        # the documents' kinds and shapes before the masks; their order with the loss's checks
        tokens, lengths = checked_batch(tokens, lengths, documents, self.cfg.vocab_size, values=False)
        loss_lengths = given if host_known(given) else lengths
        # Ranges named for profilers (bench/paper_speed.py); record_function costs nothing unprofiled.
        with record_function("encoders"):
            f, b = self._states(tokens, lengths, documents)
        # this part of the batch may have no pair (its loss is then 0), the whole batch must not (pair_total > 0)
        red = "sum" if reduction == "mean" and pair_total is not None else reduction
        with record_function("pair_loss"):
            belief = belief_state_loss(f, b, tokens, self.head, lengths=loss_lengths,
                                       prefix_start=prefix_start, min_gap=min_gap, max_gap=max_gap,
                                       meet_token=meet_token, documents=documents, pairs=pairs,
                                       next_weight=next_weight, reduction=red, generator=generator, backend=backend)
        if red == "sum":
            belief = belief / pair_total
        elif reduction == "row_mean" and row_total is not None:  # this batch's mean of row means, re-weighed
            belief = belief * (tokens.shape[0] / row_total)
        out = {"belief": belief, "gpt": None, "total": belief}
        if self.gpt is not None and gamma > 0:
            out["gpt"] = next_token_loss(self.gpt, f, tokens, lengths, prefix_start, token_total, documents)
            out["total"] = gamma * out["gpt"] + (1 - gamma) * belief
        return out


class ForwardOnly(nn.Module):
    """The forward-only (GPT) baseline: the same Encoder with a next-token head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg = copy.deepcopy(cfg).check()  # a copy, as BeliefStateTransformer's
        self.forward_encoder = Encoder(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)
        _init_weights(self)

    def forward(self, tokens, lengths=None, *, prefix_start=0, token_total=None, documents=None, **belief_only):
        """Losses of a batch: dict(total = gpt = the next-token loss, belief None). `belief_only`:
        the BST's loss options (BELIEF_ONLY), taken and ignored."""
        check_belief_only(self, belief_only)
        token_total = check_total("token_total", token_total)
        tokens, lengths = checked_batch(tokens, lengths, documents, self.cfg.vocab_size)
        check_prefix_start(prefix_start, tokens.shape[0])
        f = self.forward_encoder(tokens, documents=document_sides(documents)[0])
        loss = next_token_loss(self.lm_head, f, tokens, lengths, prefix_start, token_total, documents)
        return {"total": loss, "gpt": loss, "belief": None}


class Teacherless(ForwardOnly):
    """Teacherless multi-token prediction (Bachmann & Nagarajan): the answer's input tokens are all
    replaced by one dummy token (id vocab_size - 1, never in the data), so every answer token is
    predicted in one forward pass from the question alone."""

    @property
    def dummy_id(self):
        return self.cfg.vocab_size - 1

    def _check_no_dummy(self, name, ids):
        """The dummy stands for an answer token and is never one of the data's: one in the input
        would read as a blinded answer position."""
        if bool((ids == self.dummy_id).any()):
            raise TokenIdError(f"{name} must not hold the teacherless dummy id {self.dummy_id} (vocab_size - 1; the "
                             f"data's ids are [0, {self.dummy_id}))")

    def _blind(self, tokens, lengths, prefix_start):
        i = torch.arange(tokens.shape[1], device=tokens.device)[None]
        ps = torch.as_tensor(prefix_start, device=tokens.device).reshape(-1, 1)
        return tokens.masked_fill((i > ps) & (i < lengths[:, None]), self.dummy_id)

    def forward(self, tokens, lengths=None, *, prefix_start=0, token_total=None, documents=None, **belief_only):
        if documents is not None:
            raise ValueError("documents (packed rows) are not supported by the teacherless model: "
                             "its answer spans one row")
        check_belief_only(self, belief_only)
        token_total = check_total("token_total", token_total)
        tokens, lengths = checked_batch(tokens, lengths, None, self.cfg.vocab_size)
        self._check_no_dummy("tokens", tokens)  # padding is 0 now
        check_prefix_start(prefix_start, tokens.shape[0])
        f = self.forward_encoder(self._blind(tokens, lengths, prefix_start))
        loss = next_token_loss(self.lm_head, f, tokens, lengths, prefix_start, token_total)
        return {"total": loss, "gpt": loss, "belief": None}

    @inference
    def generate(self, prefix, n_new: int):
        """One forward pass over the prompt and n_new - 1 dummies: (B, P) or (P,) -> (B, n_new), the
        model in eval mode as every decoder runs it (no EOS: the answer is n_new tokens long)."""
        n_new = check_int("n_new", n_new, 0)
        if torch.is_tensor(prefix) and prefix.dim() == 1:  # one prompt, as sample takes it
            prefix = prefix[None]
        if not torch.is_tensor(prefix) or prefix.dim() != 2 or prefix.shape[1] == 0:
            raise ValueError(f"prefix must be a (B, P) or (P,) tensor of ids with P >= 1, got "
                             f"{tuple(prefix.shape) if torch.is_tensor(prefix) else type(prefix).__name__}")
        full_lengths(prefix, None, self.cfg.vocab_size)
        self._check_no_dummy("prefix", prefix)
        B, P = prefix.shape
        blind = torch.cat([prefix, prefix.new_full((B, max(n_new - 1, 0)), self.dummy_id)], 1)
        return self.lm_head(self.forward_encoder(blind)[:, P - 1:P - 1 + n_new]).argmax(-1)
