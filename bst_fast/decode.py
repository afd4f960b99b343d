"""Decoding with a trained model: sampling, goal-conditioned and unconditional planning, beam search,
belief-state embeddings and probes.

Sequences are 1-D or (B, L) int64 ids that start with BOS (the rows the models were trained on).
The search algorithms talk to a model only through a "search interface" of four methods:

    start(prefix (B, P), goal (G,)) -> Next logits (B, V) for the token after each prefix, given
                                       the goal as suffix (B(goal + EOS); an empty goal is B(∅))
    step(tokens (B,))              -> Next logits (B, V) after appending one token per row
    reorder(index (B',))           -> keep / repeat rows of the running state (beam search)
    score(seqs (n, L), first, head) -> (n,) sum over positions p = first..L-2 of
                                       log head(seqs[p] | F(seqs[:p]), B(seqs[p+1:]));
                                       seqs end with EOS, which is never scored

`BSTSearch` and `ForwardSearch` implement it with a KV cache (so n new tokens cost n cached
encoder steps); tests implement it with hand-set probability tables.
"""
from __future__ import annotations

import heapq
import numbers
from typing import Iterable, List, NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import ArgumentTypeError, TokenIdError, check_int, short
from ._pairs import ID_DTYPES, check_rows, full_lengths, id_dtype_ok
from .model import inference


def _tensor(x, name) -> torch.Tensor:
    """torch.as_tensor(x), or a ValueError naming the argument: None (no goal is (), the default)
    and a string hold no ids, and torch's errors for them do not say which argument it was."""
    if x is None or isinstance(x, (str, bytes)):
        raise ValueError(f"{name} must hold integer token ids, got {short(x)}")
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must hold integer token ids, got {short(x)}") from None


def _ids(x, name="ids") -> torch.Tensor:
    """One sequence of ids, (n,) or (1, n), as (n,): a batch of several is refused, not glued."""
    t = _tensor(x, name).long()
    if t.dim() > 2 or t.dim() == 2 and t.shape[0] != 1:
        raise ValueError(f"{name} must be one sequence of ids, (n,) or (1, n), got shape {tuple(t.shape)}")
    return t.reshape(-1)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _check_ids(model, values: bool = True, **named):
    """Each named argument (a prompt, a goal, eos_id; None skipped) holds integer token ids of the
    model's vocabulary (known from its cfg; else only >= 0 is checked; not checked unless `values`).
    eos_id and stop_token are one id each: an int, as the model's own eos_id arguments take it."""
    module = model if isinstance(model, nn.Module) else getattr(model, "model", model)  # or a searcher's
    V = getattr(getattr(module, "cfg", None), "vocab_size", None)
    for name, x in named.items():
        if name in ("eos_id", "stop_token") and x is not None:
            x = check_int(name, x, 0)
        t = None if x is None else _tensor(x, name)
        if t is None or t.numel() == 0:
            continue
        if t.dtype in (torch.uint16, torch.uint32):  # lossless in int64: a prepared corpus's ids, say
            t = t.long()
        if not id_dtype_ok(t.dtype):
            raise ValueError(f"{name} must hold integer token ids ({ID_DTYPES}, uint16 or uint32), got {t.dtype}")
        if not values:
            continue
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or V is not None and hi >= V:
            bad = lo if lo < 0 else hi
            raise TokenIdError(f"{name} must hold token ids in 0..{'' if V is None else V - 1}, got {bad}")


class _Cache:
    """A KV-cached causal Encoder: read a prompt once, then one token per row at a time."""

    def __init__(self, encoder, segment: int = 0):
        self.encoder, self.segment = encoder, segment
        self.caches, self.length = None, 0

    def start(self, prefix):
        self.caches = [dict() for _ in self.encoder.blocks]
        self.length = prefix.shape[1]
        return self.encoder(prefix, self.segment, self.caches)[:, -1]  # (B, m)

    def step(self, tokens):
        f = self.encoder(tokens[:, None], self.segment, self.caches, offset=self.length)[:, -1]
        self.length += 1
        return f

    def reorder(self, index):
        # torch.cat in Block.attend makes fresh tensors, so indexing never aliases another row's cache.
        for c in self.caches:
            c["k"], c["v"] = c["k"][index], c["v"][index]


class ForwardSearch:
    """The search interface for a forward-only model (e.g. a FIM model: its goal is in the prompt),
    or for a BST's GPT head on its forward encoder (`head`: model.gpt; searcher(model, head="gpt")):
    the paper's improved BST (gamma 0.9, next_weight 0) decodes forward with it."""

    def __init__(self, model, head: Optional[nn.Module] = None):
        self.model, self.cache = model, _Cache(model.forward_encoder)
        self.head = model.lm_head if head is None else head

    @torch.no_grad()
    def start(self, prefix, goal=()):
        if len(_ids(goal, "goal")):
            raise ValueError("a forward-only model (or a BST's GPT head) takes no goal; put it in the prompt "
                             "(FIM format)")
        return self.head(self.cache.start(prefix.to(_device(self.model))))

    @torch.no_grad()
    def step(self, tokens):
        return self.head(self.cache.step(tokens.to(_device(self.model))))

    def reorder(self, index):
        self.cache.reorder(index)

    def score(self, seqs, first, head="next"):
        raise ValueError("scoring candidates needs a Belief State Transformer (the Next/Prev heads)")


class BSTSearch:
    """The search interface for a BeliefStateTransformer: Next head on (F(prefix), B(goal))."""

    def __init__(self, model, eos_id: int):
        self.model, self.eos_id = model, int(eos_id)
        self.cache = _Cache(model.forward_encoder, segment=0)
        self.b = None

    @torch.no_grad()
    def goal_state(self, goal):
        """B(goal + EOS) at the goal's first token; B(∅) for an empty goal. (m,)"""
        goal = _ids(goal, "goal").to(_device(self.model))
        if len(goal) == 0:
            return self.model.empty_suffix(self.eos_id)
        if not self.model.cfg.backward_encoder:
            raise ValueError("this BST has no backward encoder (model.backward_encoder false, the 'w/o backward' "
                             "ablation): its suffix state is one learned vector that no goal reaches; decode it "
                             "without a goal")
        row = torch.cat([goal, goal.new_tensor([self.eos_id])])[None]
        return self.model.suffix_states(row)[0, 0]

    def _next(self, f):
        return self.model.logits(f, self.b)[0]

    @torch.no_grad()
    def start(self, prefix, goal=()):
        self.b = self.goal_state(goal)
        return self._next(self.cache.start(prefix.to(_device(self.model))))

    @torch.no_grad()
    def step(self, tokens):
        return self._next(self.cache.step(tokens.to(_device(self.model))))

    def reorder(self, index):
        self.cache.reorder(index)

    @torch.no_grad()
    def score(self, seqs, first: int, head: str = "next"):
        """All candidates in one batched pass of both encoders (see the module docstring)."""
        if head not in ("next", "prev"):
            raise ValueError(f"head must be 'next' or 'prev', got {head!r}")
        seqs = seqs.to(_device(self.model))
        L = seqs.shape[1]
        if not 1 <= first <= L - 2:
            return torch.zeros(len(seqs), device=seqs.device)
        f = self.model.prefix_states(seqs)   # f[:, p-1] has read seqs[:, :p]
        b = self.model.suffix_states(seqs)   # b[:, p+1] has read seqs[:, p+1:]
        p = torch.arange(first, L - 1, device=seqs.device)
        nxt, prv = self.model.logits(f[:, p - 1], b[:, p + 1])  # (n, |p|, V)
        logp = F.log_softmax(_score_dtype(nxt if head == "next" else prv), -1)
        return logp.gather(-1, seqs[:, p, None]).squeeze(-1).sum(-1)


def _score_dtype(logits):
    """Logits in float32 at least (a half-precision model's log-softmax and sums lose too much), and
    in the model's own precision when it is higher: a float64 model's scores stay float64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def searcher(model, eos_id: Optional[int] = None, head: str = "next"):
    """The search interface for a model; an object that already has one is returned as it is.
    head: "next" (a BST's Next head on (F(prefix), B(goal))) or "gpt" (a BST's GPT head on
    F(prefix) alone, forward only: no goal, no scoring; for a BST trained with next_weight 0)."""
    if head not in ("next", "gpt"):
        raise ValueError(f"head must be 'next' or 'gpt', got {short(head)}")
    if all(hasattr(model, name) for name in ("start", "step", "score")):
        if eos_id is not None and getattr(model, "eos_id", eos_id) != eos_id:  # B(goal + EOS) is the interface's
            raise ValueError(f"eos_id {short(eos_id)} differs from the search interface's own ({model.eos_id}): "
                             "give the same one, or none")
        if head == "gpt" and not (isinstance(model, ForwardSearch) and model.head is getattr(model.model, "gpt", None)):
            raise ValueError("head='gpt' picks the search interface of a model: pass the model, not a search "
                             f"interface ({type(model).__name__})")
        return model
    if hasattr(model, "dummy_id"):
        raise ValueError("a Teacherless model predicts its whole answer in one pass: use model.generate")
    if head == "gpt":
        if getattr(model, "gpt", None) is None:
            raise ValueError("head='gpt' needs a Belief State Transformer with a GPT head (ModelConfig.gpt_head)")
        return ForwardSearch(model, head=model.gpt)
    if hasattr(model, "head"):
        if eos_id is None:
            raise ValueError("a Belief State Transformer needs eos_id (its empty suffix is B(EOS))")
        return BSTSearch(model, eos_id)
    if hasattr(model, "lm_head"):
        return ForwardSearch(model)
    raise ValueError(f"cannot decode with a {type(model).__name__}")


def _check_room(model, what, n_positions):
    """The positions an encoder reads (`what` names them) fit the model's max_len."""
    module = model if isinstance(model, nn.Module) else getattr(model, "model", None)  # or a searcher's
    limit = getattr(getattr(module, "cfg", None), "max_len", None) if isinstance(module, nn.Module) else None
    if limit is not None and n_positions > limit:
        raise ValueError(f"{what} ({n_positions} positions) exceed the model's max_len {limit}")


def _check_goal_room(model, goal):
    """A BST reads the goal + EOS in its backward encoder (a forward-only model refuses a goal)."""
    n = len(_ids(goal, "goal"))
    if n:
        _check_room(model, "the goal and EOS", n + 1)


# ---------------------------------------------------------------- sampling

@inference
def sample(model, prefix, n_new: int, eos_id: Optional[int] = None, *, temperature: float = 1.0,
           top_k: Optional[int] = None, goal=(), generator: Optional[torch.Generator] = None,
           stop_token: Optional[int] = None):
    """(B, P) prompts -> (B, n_new) tokens, KV-cached, the model in eval mode (as every decoder
    here runs it). temperature=0 is greedy (a temperature > 0 too small for the scores' precision,
    below 1e-45 in float32, draws the limit: the most likely token, tied ones evenly); top_k keeps the k most likely tokens (exactly k: ties
    at the k-th broken by index) before sampling. A BST reads the goal as suffix (default: the empty suffix,
    B(EOS): a BST needs eos_id; a forward-only model takes none).

    stop_token: a row that draws it is finished; its later positions hold stop_token, and sampling
    ends once every row is. For a BST trained with meet pairs (docs/contract.md §8) this is the
    meet token: its Next head predicts it with the goal as suffix once the prefix has reached the
    goal (nothing is missing between them), and with the empty suffix at the end of a text."""
    if stop_token is not None:
        stop_token = check_int("stop_token", stop_token, 0)
    _check_ids(model, prefix=prefix, goal=goal, eos_id=eos_id, stop_token=stop_token)
    prefix = torch.as_tensor(prefix, dtype=torch.long)
    if prefix.dim() == 1:
        prefix = prefix[None]
    if prefix.dim() != 2 or prefix.numel() == 0:
        raise ValueError(f"prefix must be a non-empty (P,) or (B, P) sequence of ids, got shape {tuple(prefix.shape)}")
    n_new = check_int("n_new", n_new, 0)
    if top_k is not None:
        top_k = check_int("top_k", top_k, 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ArgumentTypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    # a bool is no temperature (True would sample at 1); numpy's floats are Real numbers too
    if isinstance(temperature, bool) or not (isinstance(temperature, numbers.Real) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    _check_room(model, "the prompt and the generated tokens but the last", prefix.shape[1] + max(n_new - 1, 0))
    _check_goal_room(model, goal)
    search = searcher(model, eos_id)
    out = []
    logits = search.start(prefix, goal)
    if top_k is not None and top_k > logits.shape[-1]:  # "keep all" would silently not be top-k sampling
        raise ValueError(f"top_k must be at most the vocabulary size {logits.shape[-1]}, got {top_k}")
    done = torch.zeros(prefix.shape[0], dtype=torch.bool)
    for step in range(n_new):
        if temperature == 0:
            token = logits.argmax(-1)
        else:
            # Shifted by the row's maximum first, so a tiny temperature gives -inf, never inf - inf.
            # A temperature below the scores' smallest number (1e-46 in float32) is 0 in their
            # precision, and the maximum's 0 / 0 was NaN: the maximum (and a token tied with it)
            # stays 0, the rest go to -inf, which is the limit T -> 0: greedy, ties drawn evenly.
            z = _score_dtype(logits)
            z = z - z.max(-1, keepdim=True).values
            z = torch.where(z == 0, z, z / float(temperature))
            if top_k is not None and top_k < z.shape[-1]:
                # exactly k kept, ties by the lower index (a stable sort; a threshold at the k-th value
                # kept every token tied with it, and topk's choice among ties is its own)
                order = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., :top_k]
                keep = torch.zeros_like(z, dtype=torch.bool).scatter_(-1, order, True)
                z = z.masked_fill(~keep, float("-inf"))
            token = torch.multinomial(z.softmax(-1).cpu(), 1, generator=generator)[:, 0].to(z.device)
        if stop_token is not None:
            token = token.masked_fill(done.to(token.device), stop_token)
            done = done | (token == stop_token).cpu()
        out.append(token)
        if stop_token is not None and bool(done.all()):
            pad = token.new_full((token.shape[0], n_new - step - 1), stop_token)
            return torch.cat([torch.stack(out, 1), pad], 1)
        if step + 1 < n_new:
            logits = search.step(token)
    return torch.stack(out, 1) if out else prefix.new_zeros((prefix.shape[0], 0))


# ---------------------------------------------------------------- planning (Algorithm 1)

class Plan(NamedTuple):
    best: torch.Tensor              # (P + horizon + G,) prompt, generated tokens, goal
    candidates: List[torch.Tensor]  # in rollout order, each like `best`
    scores: torch.Tensor            # (n,) log of the goal score of each candidate


@inference
def plan(model, prompt, goal=(), horizon: int = 32, rollouts: int = 120, eos_id: Optional[int] = None,
         score_last: Optional[int] = None) -> Plan:
    """The paper's Algorithm 1 (goal-conditioned planning), or with an empty goal its unconditional
    variant.

    `horizon` is the number of tokens generated between prompt and goal (the paper's k - 1: its
    goal starts at x_{t+k}). Each of `rollouts` roll-outs pops the sequence of highest priority r
    (the prompt first, r = 1), extends it greedily with the Next head given B(goal), and pushes
    every non-greedy token x with priority r * p(x) / p(x_max). Candidates are scored in one batch:
    with a goal by the known-goal score (the product over goal tokens of the Next head's
    probability given the prefix before it and the rest of the goal as suffix), without one by the
    unknown-goal score (the Prev head over the last `score_last` tokens, default `horizon`).
    Note: the paper's unknown-goal score is a product over i = T-k..T, k + 1 factors; `score_last=k`
    scores k tokens (pass score_last=k + 1 for the paper's count).
    Ties in priority pop in push order, and one step pushes its tokens in vocabulary order.
    """
    _check_ids(model, prompt=prompt, goal=goal, eos_id=eos_id)
    prompt, goal = _ids(prompt, "prompt").tolist(), _ids(goal, "goal").tolist()
    if not prompt:
        raise ValueError("prompt must hold at least one token (BOS)")
    horizon = check_int("horizon", horizon, 0)
    rollouts = check_int("rollouts", rollouts, 1)
    if score_last is not None:
        score_last = check_int("score_last", score_last, 1)
        if goal:
            raise ValueError("score_last applies without a goal (the unknown-goal score); a goal is scored by its own tokens")
        if score_last > len(prompt) + horizon - 1:
            raise ValueError(f"score_last must be at most the {len(prompt) + horizon - 1} scorable tokens "
                             f"after BOS (prompt + horizon), got {score_last}")
    # candidates are scored whole: prompt, generated tokens, goal and EOS in both encoders
    _check_room(model, "the prompt, horizon, goal and EOS", len(prompt) + horizon + len(goal) + 1)
    search = searcher(model, eos_id)
    if isinstance(search, ForwardSearch):  # before the roll-outs, not after them
        raise ValueError("planning scores its candidates with the Next/Prev heads: it needs a Belief State Transformer")
    end = len(prompt) + horizon
    queue = [(-1.0, 0, prompt)]  # (-priority, push order, sequence): heapq pops the smallest
    pushed, candidates = 1, []
    for j in range(rollouts):
        if not queue:
            break
        neg_r, _, s = heapq.heappop(queue)
        r = -neg_r
        left = rollouts - j - 1  # pops still to come: an entry ranked below that can never be popped
        if len(s) < end:
            logits = search.start(torch.tensor([s]), goal)[0]
            while True:
                p = _score_dtype(logits).softmax(-1).cpu()
                x_max = int(p.argmax())
                if left:
                    # Only the `left` most likely alternatives can ever be popped: pushing the rest
                    # would change nothing but memory (V - 1 entries per step otherwise).
                    # A stable sort keeps ties in vocabulary order, as the full push would.
                    alt = p.clone()
                    alt[x_max] = -1.0
                    order = torch.sort(alt, descending=True, stable=True).indices
                    keep = order[:min(left, len(p) - 1)].sort().values.tolist()
                    for x in keep:
                        heapq.heappush(queue, (-(r * float(p[x] / p[x_max])), pushed, s + [x]))
                        pushed += 1
                s = s + [x_max]
                if len(s) >= end:
                    break
                logits = search.step(torch.tensor([x_max]))[0]
            if len(queue) > left:
                queue = heapq.nsmallest(left, queue)  # a sorted list is a valid heap
        candidates.append(torch.tensor(s + goal))
    eos = eos_id if eos_id is not None else getattr(search, "eos_id", 0)
    rows = torch.stack([torch.cat([c, torch.tensor([eos])]) for c in candidates])
    if goal:
        scores = search.score(rows, end, "next")
    else:
        k = horizon if score_last is None else score_last
        scores = search.score(rows, end - k, "prev")
    scores = _score_dtype(torch.as_tensor(scores)).cpu()
    return Plan(candidates[int(scores.argmax())], candidates, scores)


# ---------------------------------------------------------------- beam search

@inference
def beam_search(model, prompt, n_new: int, beams: int = 120, goal=(), eos_id: Optional[int] = None):
    """The paper's "Beam Search" algorithm: keep the `beams` most probable continuations at each
    depth, scored by the product of Next-head probabilities (a BST reads the goal as suffix; a FIM
    model gets the goal inside its prompt). Returns (sequences (n, n_new), log-probs (n,)), best first.
    """
    _check_ids(model, prompt=prompt, goal=goal, eos_id=eos_id)
    prompt = _ids(prompt, "prompt")
    if len(prompt) == 0:
        raise ValueError("prompt must hold at least one token (BOS)")
    n_new = check_int("n_new", n_new, 0)
    beams = check_int("beams", beams, 1)
    _check_room(model, "the prompt and the generated tokens but the last", len(prompt) + max(n_new - 1, 0))
    _check_goal_room(model, goal)
    search = searcher(model, eos_id)
    seqs = torch.zeros((1, 0), dtype=torch.long)
    logp = torch.zeros(1)
    if n_new == 0:
        return seqs, logp
    logits = search.start(prompt[None], goal)
    for depth in range(n_new):
        total = (F.log_softmax(_score_dtype(logits), -1).cpu() + logp[:, None]).reshape(-1)  # (beams * V,)
        V = logits.shape[-1]
        # ties by the lower (beam, token) index, as sample and plan break theirs (topk's order among
        # ties is its own): topk for the k-th value, then a stable sort of what reaches it alone (a
        # sort of all beams x V was 8x slower at V = 50257). A broken model's NaN, which the sort
        # puts first, reaches any threshold here (a NaN k-th value none).
        k = min(beams, total.numel())
        reach = ((total >= total.topk(k).values[-1]) | total.isnan()).nonzero()[:, 0]  # ascending index
        flat = reach[torch.sort(total[reach], descending=True, stable=True).indices[:k]]
        logp = total[flat]
        parent, token = flat // V, flat % V
        seqs = torch.cat([seqs[parent], token[:, None]], 1)
        if depth + 1 < n_new:
            search.reorder(parent.to(logits.device))
            logits = search.step(token)
    return seqs, logp


# ---------------------------------------------------------------- belief states and probes

@inference
def belief_states(model, tokens, lengths=None):
    """f at the end of each row's prefix: (B, L) tokens, (B,) lengths (default: full rows) -> (B, m).
    Works for a BST and a forward-only model (both have `forward_encoder`)."""
    # the dtype before the cast to int64, which would truncate 3.7 to 3; the values below, at the valid
    # positions only (padding past a row's length may hold any id, as the models take it)
    _check_ids(model, values=False, tokens=tokens)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    if tokens.dim() == 1:
        tokens = tokens[None]
    tokens = tokens.to(_device(model))
    lengths = full_lengths(tokens, lengths, getattr(getattr(model, "cfg", None), "vocab_size", None))
    bad = ((lengths < 1) | (lengths > tokens.shape[1])).nonzero()  # decoding: a sync is no cost here
    if len(bad):
        r = int(bad[0])
        raise ValueError(f"lengths must lie in [1, L={tokens.shape[1]}] (a state has read at least one token), "
                         f"got lengths[{r}] = {int(lengths[r])}")
    padding = torch.arange(tokens.shape[1], device=tokens.device)[None] >= lengths[:, None]
    if tokens.device.type != "cpu":  # full_lengths checked a CPU batch's ids; a GPU's the same way (a sync: decoding)
        check_rows(tokens, lengths, getattr(getattr(model, "cfg", None), "vocab_size", None))
    f = model.forward_encoder(tokens.masked_fill(padding, 0))  # causal: the padding's states are not read
    return f[torch.arange(len(f), device=f.device), torch.as_tensor(lengths, device=f.device) - 1]


def probe_accuracy(train_x, train_y, test_x, test_y, hidden: int = 64, steps: int = 300,
                   lr: float = 3e-3, seed: int = 0) -> float:
    """Trains a small MLP (x -> hidden -> class) on (train_x, train_y) with full-batch AdamW and
    returns its accuracy on (test_x, test_y)."""
    hidden, steps = check_int("hidden", hidden, 1), check_int("steps", steps, 1)
    for name, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        if not (torch.is_tensor(x) and torch.is_tensor(y)):
            raise ArgumentTypeError(f"{name}_x and {name}_y must be tensors, got {type(x).__name__} and {type(y).__name__}")
        if x.dim() != 2 or y.shape != x.shape[:1] or len(x) == 0:
            raise ValueError(f"{name}_x must be (n, m) with n >= 1 and {name}_y (n,), got shapes "
                             f"{tuple(x.shape)} and {tuple(y.shape)}")
        if not x.dtype.is_floating_point:
            raise ValueError(f"{name}_x must be floating point (states), got {x.dtype}")
        # classes: integers >= 0 (a float label 0.5 was truncated to class 0, silently; -1 was torch's IndexError)
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise ValueError(f"{name}_y must hold integer classes >= 0, got {y.dtype}")
        if int(y.min()) < 0:
            raise ValueError(f"{name}_y must hold integer classes >= 0, got {int(y.min())}")
    # Training needs autograd even when the caller evaluates under no_grad or inference_mode; a
    # tensor made in inference mode cannot be saved for backward, hence the copies (clone).
    with torch.inference_mode(False), torch.enable_grad():
        train_x, test_x = train_x.detach().float().cpu().clone(), test_x.detach().float().cpu().clone()
        train_y, test_y = train_y.long().cpu().clone(), test_y.long().cpu().clone()
        n_class = int(max(train_y.max(), test_y.max())) + 1
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            mlp = nn.Sequential(nn.Linear(train_x.shape[1], hidden), nn.GELU(), nn.Linear(hidden, n_class))
            opt = torch.optim.AdamW(mlp.parameters(), lr=lr)
            for _ in range(steps):
                loss = F.cross_entropy(mlp(train_x), train_y)
                opt.zero_grad()
                loss.backward()
                opt.step()
    with torch.no_grad():
        return float((mlp(test_x).argmax(-1) == test_y).float().mean())


def probe_future_tokens(model, train_tokens, test_tokens, position: int, ks: Sequence[int], **probe_kw):
    """Paper §"Understanding Belief States": from f at `position` (star graphs: the "=" before the
    path), probe the token k steps ahead for each k. Returns {k: test accuracy}."""
    _check_ids(model, train_tokens=train_tokens, test_tokens=test_tokens)  # before the cast (no truncation)
    rows = {"train": torch.as_tensor(train_tokens, dtype=torch.long),
            "test": torch.as_tensor(test_tokens, dtype=torch.long)}
    for name, t in rows.items():
        if t.dim() != 2 or len(t) == 0:
            raise ValueError(f"{name}_tokens must be (n, L) rows of ids with n >= 1, got shape {tuple(t.shape)}")
    L = rows["train"].shape[1]
    if rows["test"].shape[1] != L:  # positions are compared across the two: one L for both
        raise ValueError(f"train_tokens and test_tokens must have rows of one length, got {L} and {rows['test'].shape[1]}")
    position = check_int("position", position, 0)
    if position >= L - 1:  # no token after it to probe, whatever ks holds
        raise ValueError(f"position must be below L - 1 = {L - 1} (a token k >= 1 steps after it), got {position}")
    if isinstance(ks, (str, bytes)) or not isinstance(ks, Iterable) or torch.is_tensor(ks) and ks.dim() == 0:
        raise ArgumentTypeError(f"ks must be a sequence of steps ahead (ints >= 1), got {short(ks)}")
    ks = [check_int("ks", k, 1) for k in ks]
    if not ks or position + max(ks) >= L:
        raise ValueError(f"ks must be non-empty with position + k < L = {L} (position {position}), got {list(ks)}")
    states = {name: belief_states(model, t[:, :position + 1]) for name, t in rows.items()}
    return {k: probe_accuracy(states["train"], rows["train"][:, position + k],
                              states["test"], rows["test"][:, position + k], **probe_kw)
            for k in ks}
