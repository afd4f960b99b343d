"""bst_fast.tasks: what a run trains on and how it is scored, and the objective it optimises.

A task (StarTask: star graphs and path accuracy, docs/contract.md §7; TextTask: BPE text and the
held-out loss) gives the rows of each step (`rows`: a Rows) as pure functions of (seed, step), the
vocabulary and row length the model needs (`model_config`), and an evaluation. `Objective` is the loss's
settings from the config, the one place both model calls (training, held-out loss) take them.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any, List, NamedTuple, Optional, Union

import torch

from ._pairs import pair_counts, sample_counts
from .config import TrainConfig
from .decode import sample, searcher
from .files import CORPUS, TOKENIZER, atomic_write
from .model import BeliefStateTransformer, ForwardOnly, Teacherless, next_token_mask


class Rows(NamedTuple):
    """A step's global batch: (B, L) tokens, (B,) lengths, the first prefix position trained on
    (None: the task's `prefix_start` for every row; else (B,)), and packed rows' (B, L) document
    ids (None: a row is one document; docs/contract.md §10)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    prefix_start: Optional[torch.Tensor]
    documents: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class Objective:
    """The loss's settings (docs/contract.md §2-§5, §8, §9): what `model.forward` takes besides the
    batch, and the pair count a batch's mean divides by."""

    pairs: Optional[float]
    next_weight: float
    gamma: float
    backend: str
    min_gap: int = 2
    max_gap: Optional[int] = None
    meet_token: Optional[int] = None
    reduction: str = "mean"

    @classmethod
    def from_config(cls, cfg: TrainConfig, eos_id: Optional[int] = None) -> "Objective":
        """The config's objective; meet_token "eos" becomes the data's EOS id (`eos_id`)."""
        meet = cfg.meet_token
        if meet == "eos":
            if eos_id is None:
                raise ValueError("config field 'meet_token' is 'eos', but the data has no EOS id")
            meet = eos_id
        # the config's pairs is a fraction: a TrainConfig built in code may hold the int 1, which the
        # loss would read as one pair a row (a config file's is read as the float 1.0: all pairs)
        pairs = None if cfg.pairs is None else float(cfg.pairs)
        return cls(pairs=pairs, next_weight=cfg.next_weight, gamma=cfg.gamma, backend=cfg.backend,
                   min_gap=cfg.min_gap, max_gap=cfg.max_gap, meet_token=meet, reduction=cfg.reduction)

    def totals(self, lengths, start_pos, L, documents=None):
        """(pairs, next-token targets, pairs drawn) of rows of `lengths` (at most L) with starts
        `start_pos` and, packed, (B, L) `documents`: the counts a mean over a batch split across
        ranks or micro-batches divides by (a target is a position i with i + 1 in its document),
        and the pairs the loss reads (all, or the subsample's k_r, docs/contract.md §5)."""
        pairs = pair_counts(lengths, start_pos, self.min_gap, L if self.max_gap is None else self.max_gap, L,
                            documents=documents)
        targets = next_token_mask(lengths, start_pos, L, documents)
        drawn = pairs if self.pairs is None else sample_counts(self.pairs, pairs)
        return pairs.sum().item(), targets.sum().item(), drawn.sum().item()

    def nothing_to_learn(self, method: str, pair_total: float, token_total: float) -> Optional[str]:
        """Why the loss of a batch with these totals (a whole step's, or the held-out set's) is
        undefined for `method` (its mean would divide by zero), or None when it is defined: a BST
        needs a pair (and a next-token target where gamma weighs its GPT head), the other methods a
        next-token target. Such a batch (a split stream's last row drawn alone, short documents
        under a large min_gap) has nothing to learn from."""
        if method == "bst" and not pair_total > 0:
            return f"no pair (min_gap {self.min_gap}, max_gap {self.max_gap})"
        if (method != "bst" or self.gamma > 0) and not token_total > 0:
            return "no next-token target"
        return None

    def __call__(self, model, tokens, lengths, *, prefix_start, generator, pair_total, token_total, row_total,
                 documents=None):
        """model(batch) with these settings: {"total", "belief", "gpt"} as the models return."""
        return model(tokens, lengths, prefix_start=prefix_start, generator=generator, pair_total=pair_total,
                     token_total=token_total, row_total=row_total, documents=documents, **dataclasses.asdict(self))


class StarTask:
    """Star-graph batches and path-accuracy evaluation (docs/contract.md §7)."""

    def __init__(self, cfg: TrainConfig):
        from .data import StarGraphData, StarGraphStream, StarGraphTokenizer

        self.tok = StarGraphTokenizer(cfg.star_nodes)
        self.data = StarGraphData(cfg.star_degree, cfg.star_path_len, cfg.star_nodes,
                                  n_train=cfg.n_train, n_test=cfg.n_test, seed=cfg.seed)
        self.stream = None if cfg.n_train else StarGraphStream(
            cfg.star_degree, cfg.star_path_len, cfg.star_nodes, seed=cfg.seed, exclude=self.data)
        self.vocab_size, self.max_len, self.eos_id = self.tok.vocab_size, self.data.row_length, self.tok.eos_id
        self.prefix_start = self.data.prefix_start
        self.seed, self.method, self.augment_prob = cfg.seed, cfg.method, cfg.augment_prob
        # the head the evaluation decodes with: a BST's Next head, or its GPT head when the Next head
        # got no gradient (next_weight 0 or gamma 1; the config refuses a run that trains neither)
        self.decode_head = "gpt" if cfg.method == "bst" and (cfg.next_weight == 0 or cfg.gamma == 1) else "next"
        l = self.data.path_len
        if self.method == "fim":  # rows grow by "|" and a suffix of at most l - 1 path nodes
            self.max_len += l
        # Test prompts: FIM is given the shortest suffix, the goal alone ([... / s g | g =]).
        self.test_rows, self.test_start = self.data.test_tokens, self.prefix_start
        if self.method == "fim":
            self.test_rows, _, starts = self.fim_rows(self.data.test_tokens, torch.full((len(self.test_rows),), l))
            self.test_start = int(starts[0])

    files = ()  # nothing is written: the graphs are functions of the seed

    def save(self, folder: Path):
        """Nothing of star-graph data is written to a run (its graphs are functions of the seed)."""

    def rows(self, step, batch_size) -> Rows:
        """The training rows of step `step` (no documents: a star graph is one row)."""
        return Rows(*self.batch(step, batch_size))

    def batch(self, step, batch_size):
        """(tokens, lengths, prefix_start (B,) or None): the method's training rows of step `step`."""
        rows = self.stream.batch(step, batch_size) if self.stream else self.data.batch(step, batch_size, self.seed)
        lengths = torch.full((rows.shape[0],), rows.shape[1], dtype=torch.long)
        # The transforms draw from their own (seed, step) generator: resume stays exact.
        gen = torch.Generator().manual_seed(self.seed * 1_000_033 + step)
        l, ps = self.data.path_len, self.prefix_start
        if self.method == "augment":
            # [E / s g = path] -> [E / s n' = path], n' uniform among the intermediate nodes n_2..n_{l-1}
            rows = rows.clone()
            which = torch.rand(len(rows), generator=gen) < self.augment_prob
            mid = torch.randint(2, l, (len(rows),), generator=gen)  # 1-based path index of n'
            node = rows.gather(1, (ps + mid)[:, None])[:, 0]
            rows[:, ps - 1] = torch.where(which, node, rows[:, ps - 1])
        if self.method == "fim":
            j = torch.randint(2, l + 1, (len(rows),), generator=gen)  # suffix n_j..n_l, 1 to l-1 nodes
            rows, lengths, starts = self.fim_rows(rows, j)
            return rows, lengths, starts
        return rows, lengths, None

    def fim_rows(self, rows, j):
        """The paper's FIM rows [BOS E / s g | n_j .. n_l = n_1 .. n_l EOS], right-padded: (rows, lengths,
        prefix_start (B,)) with j (B,) the 1-based first suffix node."""
        ps, l = self.prefix_start, self.data.path_len
        out = torch.full((len(rows), rows.shape[1] + l), self.tok.pad_id, dtype=torch.long)
        lengths, starts = torch.empty(len(rows), dtype=torch.long), torch.empty(len(rows), dtype=torch.long)
        for r in range(len(rows)):
            jr = int(j[r])
            suffix = rows[r, ps + jr:ps + l + 1]  # path node k sits at ps + k
            row = torch.cat([rows[r, :ps], rows.new_tensor([self.tok.edge_sep_id]), suffix, rows[r, ps:]])
            out[r, :len(row)] = row
            lengths[r], starts[r] = len(row), ps + 1 + len(suffix)
        return out, lengths, starts

    @torch.no_grad()
    def evaluate(self, model, device, world: int = 1, rank: int = 0):
        """Path accuracy over the test graphs; under DDP each rank decodes its share (rows rank::world)
        and the counts are summed, so no rank waits on another's whole evaluation."""
        from .data import path_accuracy

        rows = self.test_rows[rank::world]
        was = model.training
        model.eval()
        eos = self.tok.eos_id

        def generate(prefix, n_new):
            if isinstance(model, Teacherless):  # one pass, not a search
                return model.generate(prefix.to(device), n_new).cpu()
            gpt = self.decode_head == "gpt"
            return sample(searcher(model, eos, head="gpt") if gpt else model, prefix.to(device), n_new, eos,
                          temperature=0).cpu()

        right, failure = 0, None
        try:
            acc = path_accuracy(generate, rows, self.test_start, self.data.path_len) if len(rows) else 0.0
            right = round(float(acc) * len(rows))  # path_accuracy's fraction is right rows / rows
        except Exception as e:  # every rank learns of it in the sum below
            failure = e
        finally:
            model.train(was)
        right, n = sum_over_ranks([right, len(rows)], device, world, failure)
        return {"path_accuracy": right / n}


class TextTask:
    """BPE-tokenised text batches and held-out loss."""

    def __init__(self, cfg: TrainConfig, resume_from: Optional[Path] = None, rank: int = 0):
        from .data import TextData, load_tokenizer, train_bpe
        from .data.text import bpe_shortfall, vocabulary_size
        from .data.prepared import data_identity, is_prepared, open_data, weights_alone_differ

        # A prepared corpus (a folder `bst-fast tokenize` wrote), or a list of them with weights,
        # brings its tokenizer and its memory-mapped ids: nothing is trained or tokenised. Raw text
        # is tokenised here, by the tokenizer config field `tokenizer` names or, if empty, by a BPE
        # tokenizer trained on it. A resumed run reads the tokenizer its checkpoint carries (verified
        # with the checkpoint; a prepared corpus's must equal it); a new one writes its tokenizer with
        # save() once the run is known to start.
        resume = resume_from is not None
        progress = None if cfg.progress and rank == 0 else False  # bars for large corpora, rank 0 only
        saved = given = None
        trained = False  # a BPE trained here, on the raw text
        if resume:
            path = Path(resume_from) / TOKENIZER
            if not path.is_file():
                raise ValueError(f"--resume: checkpoint {resume_from} holds no {TOKENIZER} (the run's tokenizer)")
            saved = load_tokenizer(path)
            # the field may name the run's tokenizer by another path (a moved corpus), or a file gone
            # since (the checkpoint carries it): another tokenizer is refused, not silently ignored
            if cfg.tokenizer and os.path.exists(cfg.tokenizer):
                try:
                    named = load_tokenizer(cfg.tokenizer)
                except (ValueError, FileNotFoundError) as e:
                    raise ValueError(f"config field 'tokenizer': {e}") from None
                if named.to_str() != saved.to_str():
                    raise ValueError(f"--resume: config field 'tokenizer' ({cfg.tokenizer}) is not the tokenizer "
                                     f"checkpoint {resume_from} was trained with (it carries its own): leave the "
                                     f"field as the run had it, or empty")
        if cfg.tokenizer and not resume:
            try:
                given = load_tokenizer(cfg.tokenizer)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"config field 'tokenizer': {e}") from None
        # pack: documents back to back in rows of max_len, whole (true) or cut across rows ("split";
        # data/packing.py); max_doc_tokens: drop longer ones
        rows = dict(pack=cfg.pack, max_doc_tokens=cfg.max_doc_tokens or None)
        if not isinstance(cfg.data, str) or is_prepared(cfg.data):
            self.data = open_data(cfg.data, cfg.max_len, seed=cfg.seed, **rows)
            self.tokenizer = self.data.tokenizer
            if given is not None and given.to_str() != self.tokenizer.to_str():
                raise ValueError(f"config field 'tokenizer' ({cfg.tokenizer}) is not the tokenizer the prepared corpus "
                                 f"{cfg.data} was written with; leave it empty (a prepared corpus carries its tokenizer)")
            if saved is not None and saved.to_str() != self.tokenizer.to_str():
                raise ValueError(f"--resume: the prepared corpus {cfg.data} was written with another tokenizer than "
                                 f"checkpoint {resume_from}'s")
        else:
            if saved is not None or given is not None:
                self.tokenizer = saved if saved is not None else given
            else:
                self.tokenizer, trained = train_bpe(cfg.data, vocab_size=cfg.text_vocab, progress=progress), True
            self.data = TextData(cfg.data, self.tokenizer, cfg.max_len, seed=cfg.seed, progress=progress, **rows)
        self.vocab_size, self.max_len, self.prefix_start = vocabulary_size(self.tokenizer), cfg.max_len, 0
        shortfall = bpe_shortfall(cfg.text_vocab, self.vocab_size, field="text_vocab") if trained else ""
        if rank == 0 and shortfall:  # as `bst-fast tokenize` says it
            print(shortfall, file=sys.stderr, flush=True)
        self.eos_id = self.data.eos_id
        self.seed, self.batch_size, self.objective = cfg.seed, cfg.batch_size, Objective.from_config(cfg, self.eos_id)
        self.eval_batches = cfg.eval_batches
        # The held-out figure's divisors, counted once: a set with no pair (or target) has no loss,
        # known now rather than at the first evaluation, eval_every steps into the run.
        counts = [(*self.objective.totals(r.lengths, torch.zeros_like(r.lengths), r.tokens.shape[1], r.documents)[:2],
                   r.tokens.shape[0]) for r in self.held_out()]
        self.held_out_totals = tuple(sum(c[k] for c in counts) for k in (0, 1))
        self.held_out_rows = sum(c[2] for c in counts)  # the rows an evaluation scores (row_mean's divisor)
        empty = self.objective.nothing_to_learn(cfg.method, *self.held_out_totals) if counts else None
        self.held_out_empty = empty or not counts
        scored = (f"the first {cfg.eval_batches} held-out batches (eval_batches; 0 scores them all)" if cfg.eval_batches
                  else "the corpus's held-out rows")
        if cfg.keep_best == "held_out_loss" and self.held_out_empty:
            why = (f"hold {empty}" if counts else "are none (a single document of a single row has none)")
            raise ValueError(f"config field 'keep_best' is 'held_out_loss', but {scored} {why}: "
                             "no held-out loss, so no best checkpoint could be kept")
        if rank == 0 and empty:
            print(f"{scored} hold {empty}: the run reports no held_out_loss", file=sys.stderr, flush=True)
        if rank == 0 and (cfg.pack or cfg.max_doc_tokens or self.data.dropped_when_tokenised):
            print(self.summary(cfg), file=sys.stderr, flush=True)
        # The config holds the corpus's path only: a resumed run must also find the same corpus
        # there, or its split (and so every batch and the held-out loss) would silently change.
        if resume:
            try:
                then = json.loads((Path(resume_from) / CORPUS).read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"--resume: checkpoint {resume_from} has no readable {CORPUS} (the corpus's "
                                 f"fingerprint): {e}") from None
            now = self.data.fingerprint()
            if data_identity(then) != data_identity(now):  # a mixture's corpora by their content, not their paths
                weights = weights_alone_differ(then, now)
                if weights is not None:
                    raise ValueError(f"--resume: the mixture's corpora are this run's, but not its weights, normalised: "
                                     f"then {weights[0]}, now {weights[1]}; give the run's weights to resume it exactly")
                forms = [{"prepared": "a prepared corpus"}.get(x.get("format"), x.get("format", "raw text"))
                         if isinstance(x, dict) and "mixture" not in x else None for x in (then, now)]
                if forms[0] != forms[1] and None not in forms:  # fingerprints of two kinds: never equal
                    raise ValueError(f"--resume: this run was trained on {forms[0]} and data now names {forms[1]} "
                                     f"({cfg.data}): a resume reads its corpus in the form it was trained on "
                                     f"(the two forms' fingerprints cannot be compared); give the run's own data")
                raise ValueError(f"--resume: the corpus at {cfg.data} is not the one this run was trained on "
                                 f"(then {then}, now {now}); give the run's own data, or start over (--overwrite)")

    files = (TOKENIZER, CORPUS)

    def save(self, folder: Path):
        """The tokenizer and the corpus's fingerprint, into the run folder at its start and into every
        checkpoint, so that a checkpoint decodes and resumes with what it was trained with."""
        from .data import save_tokenizer

        atomic_write(folder / TOKENIZER, lambda p: save_tokenizer(self.tokenizer, p))
        atomic_write(folder / CORPUS, lambda p: Path(p).write_text(json.dumps(self.data.fingerprint(), indent=1)))

    def summary(self, cfg: TrainConfig) -> str:
        """The start-up line of max_doc_tokens and packing: documents dropped, padding saved."""
        parts, earlier = [], self.data.dropped_when_tokenised
        earlier_text = f"{earlier} documents were dropped when the corpus was tokenised (its max_doc_tokens)"
        if cfg.max_doc_tokens:
            parts.append(f"max_doc_tokens: dropped {self.data.dropped_documents} of "
                         f"{self.data.dropped_documents + self.data.n_documents} documents longer than "
                         f"{cfg.max_doc_tokens} tokens" + (f" ({earlier_text})" if earlier else ""))
        elif earlier:
            parts.append(earlier_text)
        if cfg.pack:
            before, after = self.data.padding(cfg.batch_size)
            rows = (f"{self.data.n_train} training rows of {cfg.max_len} tokens cut from one stream of documents"
                    if cfg.pack == "split" else f"{self.data.n_train} packed training rows of at most {cfg.max_len}")
            parts.append(f"packing: {before:.0%} of positions were padding, now {after:.0%} ({rows})")
        return "; ".join(parts)

    def rows(self, step, batch_size) -> Rows:
        tokens, lengths, *documents = self.data.batch(step, batch_size, self.seed)  # documents: packed only
        return Rows(tokens, lengths, None, *documents)

    def held_out(self):
        """The held-out rows an evaluation scores as Rows batches of batch_size, in order: every one,
        or the first eval_batches (a held-out set of a large corpus took minutes an evaluation)."""
        batches = self.data.held_out_batches(self.batch_size)
        for tokens, lengths, *documents in itertools.islice(batches, self.eval_batches or None):
            yield Rows(tokens, lengths, None, *documents)

    @torch.no_grad()
    def evaluate(self, model, device, world: int = 1, rank: int = 0):
        """The held-out loss over every pair of the held-out batches scored (all, or the first
        eval_batches); under DDP each rank takes every world-th batch and the losses (each
        normalised by the scored set's counts) are summed."""
        if self.held_out_empty:  # no held-out rows (one document of one row, or held_out 0), or none
            return {}            # with a pair (or target, __init__): no figure
        # Every batch is normalised by the whole held-out set's pair and token counts, so the
        # figure is the mean over all held-out pairs (and tokens), whatever the batch size.
        pair_total, token_total = self.held_out_totals
        # Every pair, whatever `pairs` subsamples in training: the figure keep_best compares is the
        # held-out loss itself, not an estimate of it from one draw of pairs.
        objective = dataclasses.replace(self.objective, pairs=None)
        was = model.training
        model.eval()
        loss, failure = 0.0, None
        try:
            for k, r in enumerate(self.held_out()):
                if k % world != rank:
                    continue
                documents = None if r.documents is None else r.documents.to(device)
                out = objective(model, r.tokens.to(device), r.lengths.to(device), prefix_start=0,
                                generator=torch.Generator().manual_seed(k), pair_total=pair_total,
                                token_total=token_total, row_total=self.held_out_rows, documents=documents)
                loss += float(out["total"])
        except Exception as e:  # every rank learns of it in the sum below
            failure = e
        finally:
            model.train(was)
        return {"held_out_loss": sum_over_ranks([loss], device, world, failure)[0]}


Task = Union[StarTask, TextTask]


# The exception types a rank's failure keeps on the other ranks (the nearest one in its class's MRO);
# any other becomes a RuntimeError naming it.
RANK_ERRORS = (FileNotFoundError, ValueError, OSError, FloatingPointError)


def failure_summary(error: BaseException, known=RANK_ERRORS):
    """What other ranks learn of a rank's exception: (nearest known type's name, its type's name, message)."""
    return (next((c.__name__ for c in type(error).__mro__ if c in known), None), type(error).__name__, str(error))


def rank_failure(rank: int, summary, known=RANK_ERRORS) -> BaseException:
    """The exception another rank raises for rank `rank`'s failure_summary."""
    kind, name, message = summary
    where = f"rank {rank} stopped the run: "
    kind = {c.__name__: c for c in known}.get(kind)
    return kind(where + message) if kind else RuntimeError(f"{where}{name}: {message}")


def sum_over_ranks(values: List[float], device, world: int, failure: Optional[BaseException] = None) -> List[float]:
    """Each value summed over the DDP ranks (float64, on `device`: NCCL's tensors are the GPU's).
    `failure`: this rank's exception, if its share failed; it is counted in the same sum, so every
    rank raises (this one its own exception, the others the first failed rank's type and message)
    and none is left waiting in a collective the failed rank never reaches."""
    if world == 1:
        if failure is not None:
            raise failure
        return [float(v) for v in values]
    import torch.distributed as dist

    t = torch.tensor([*values, failure is not None], dtype=torch.float64, device=device)
    try:
        dist.all_reduce(t)
    except Exception as err:  # a peer is gone: this rank's own cause comes first
        if failure is not None:
            raise failure from err
        raise
    if t[-1] == 0:
        return t[:-1].tolist()
    # only after a failure (every rank sees the same flag sum): what the failed ranks raised
    errors: List[Any] = [None] * world
    try:
        dist.all_gather_object(errors, None if failure is None else failure_summary(failure))
    except Exception as err:
        if failure is not None:
            raise failure from err
        raise
    if failure is not None:
        raise failure
    raise next(rank_failure(k, e) for k, e in enumerate(errors) if e is not None)


def build_task(cfg: TrainConfig, resume_from: Optional[Path] = None, rank: int = 0) -> Task:
    """The task of `cfg`; `resume_from`: the checkpoint a resumed run continues from (a text run
    reads its tokenizer there); `rank`: only rank 0 shows progress."""
    return StarTask(cfg) if cfg.data == "star" else TextTask(cfg, resume_from, rank)


# the model fields a run's data sets (model_config); a config leaves them at their defaults
DATA_SET_FIELDS = ("vocab_size", "max_len")


def model_config(cfg: TrainConfig, task: Task) -> TrainConfig:
    """A copy of `cfg` whose model fields the data decides are set: the vocabulary (teacherless: one
    extra id, the dummy answer token), the row length, and the plain next-token head when gamma > 0.
    `cfg` itself is left as it was checked."""
    decided = dict(zip(DATA_SET_FIELDS, (task.vocab_size + (cfg.method == "teacherless"), task.max_len)))
    for name, value in decided.items():
        # a value the user set that the data overrides would be dropped silently (a saved config's,
        # equal to the data's, passes)
        given, default = getattr(cfg.model, name), type(cfg.model).__dataclass_fields__[name].default
        if given not in (default, value):
            raise ValueError(f"config field 'model.{name}' is set by the data ({value} here), got {given}: leave it "
                             f"out (text takes max_len and the tokenizer or text_vocab; star graphs their star_ fields); "
                             f"a config saved by a run holds its data's value: set model.{name}={default} (unset) "
                             f"to let this data set it")
    model = dataclasses.replace(cfg.model, **decided, gpt_head=cfg.gamma > 0)
    return dataclasses.replace(cfg, model=model.check())


def build_model(cfg: TrainConfig):
    if cfg.method == "bst":
        return BeliefStateTransformer(cfg.model)
    return Teacherless(cfg.model) if cfg.method == "teacherless" else ForwardOnly(cfg.model)
