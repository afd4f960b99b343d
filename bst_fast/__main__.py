"""Command line: `bst-fast train | star | table | generate | probe | tokenize ...` (or `python -m bst_fast ...`).

train: one model; star: BST vs forward-only; table: every star-graph method and ablation, the
paper's path-accuracy table; generate: decode from a checkpoint (sampling, Algorithm 1 planning,
beam search); probe: belief-state probes of star-graph checkpoints; tokenize: a text corpus into a
prepared corpus (docs/data.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ._checks import short
from .backends.runtime import check_environment
from .config import apply_sets, bundled_configs

CONFIGS = bundled_configs()
CONFIG_HELP = ("a YAML or JSON TrainConfig file, or a shipped config by name: "
               + ", ".join(sorted(p.stem for p in CONFIGS.glob("*.yaml"))))


def _positive(text):
    """An argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _count(text):
    """An argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _load(args):
    from .config import resolve_config

    return apply_sets(resolve_config(args.config), args.set or [])


def cmd_train(args):
    from .trainer import train

    cfg = _load(args)
    result = train(cfg, resume=args.resume, overwrite=args.overwrite)
    from .experiments import is_rank0

    if is_rank0():  # every rank returns the same figures: printed once
        print(json.dumps({k: round(v, 6) for k, v in result.items()}, indent=1))


def _load_refusing(args, fields, why):
    """_load, refusing a --set that changes a field the command chooses itself (in any form: a
    dotted key or a mapping) instead of replacing the value silently."""
    from .config import resolve_config

    base = resolve_config(args.config).to_dict()
    cfg = _load(args)
    now = cfg.to_dict()
    for field in fields:
        keys = field.split(".")
        old, new = base, now
        for key in keys:
            old, new = old[key], new[key]
        if old != new:
            raise ValueError(f"--set {field}: {args.command} {why}")
    return cfg


def cmd_star(args):
    from .experiments import star

    cfg = _load_refusing(args, ["method"], "trains each of --methods in turn (choose them with --methods)")
    star(cfg, args.methods, args.resume)


def cmd_table(args):
    from .experiments import TABLE_BASE, table

    cfg = _load_refusing(args, ["method", *TABLE_BASE], "sets it in each row (the rows are the paper's baselines "
                         "and ablations); train one setting with the train command")
    if args.note is not None and args.out is None:
        raise ValueError("--note is written above the table in --out: give --out too")
    table(cfg, args.resume, args.out, args.note)


_RESUME_EACH = ("continue an interrupted job: each run from its latest checkpoint, a finished one "
                "reported, one not started yet started")


def _resolve_checkpoint(path):
    """(checkpoint folder, model, config); any failure is a ValueError naming the path."""
    from .checkpoint import find_checkpoint, load_model

    try:
        ckpt = find_checkpoint(path)
        model, cfg = load_model(ckpt)
    except Exception as e:  # json, safetensors and shape errors alike: the file is not a usable checkpoint
        raise ValueError(f"cannot load checkpoint {short(str(path))}: {str(e)[:500]}") from e
    model.eval()
    return ckpt, model, cfg


class _StarCodec:
    """Star-graph text <-> ids: nodes as numbers, "|", "/", "=" as themselves (tokenizer.decode's format)."""

    def __init__(self, cfg):
        from .data import StarGraphTokenizer

        self.tok = StarGraphTokenizer(cfg.star_nodes)
        self.bos_id, self.eos_id = self.tok.bos_id, self.tok.eos_id
        self.specials = {self.tok.pad_id: "<pad>", self.bos_id: "<bos>", self.eos_id: "<eos>"}
        self.words = {w: self.tok.n_nodes + k for k, w in enumerate(self.tok.SPECIALS)}

    def encode(self, text, option):
        ids = []
        for w in text.split():
            # ASCII digits only: str.isdigit holds '١' (read as 1 by int) and '²' (which int refuses)
            if w.isascii() and w.isdigit() and int(w) < self.tok.n_nodes:
                ids.append(int(w))
            elif w in self.words:
                ids.append(self.words[w])
            else:
                raise ValueError(f"{option}: {short(w)} is out of the star-graph vocabulary: nodes 0..{self.tok.n_nodes - 1} "
                                 f"in ASCII digits, '|', '/', '=' (e.g. --prefix \"3 7 | 7 2 | 3 5 | 5 1 / 3 2 =\")")
        return ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special=True)

    def show(self, ids):
        """Every id by name, specials and PAD included: the generated tokens exactly as drawn (a
        model that ends a path early draws <eos> among them, which decode would drop)."""
        return " ".join(self.tok.decode([t]) or "<pad>" for t in ids)


class _TextCodec:
    """BPE text <-> ids with the tokenizer.json the checkpoint carries (checked with its checksums):
    never another folder's, which may belong to another corpus."""

    def __init__(self, ckpt):
        from .data import load_tokenizer
        from .data.text import SPECIAL_TOKENS
        from .tasks import TOKENIZER

        if not (ckpt / TOKENIZER).is_file():
            raise ValueError(f"checkpoint {ckpt} holds no {TOKENIZER}")
        self.tok = load_tokenizer(ckpt / TOKENIZER)  # '<eos>' written in a prompt is text, as in training
        self.bos_id, self.eos_id = self.tok.token_to_id("<bos>"), self.tok.token_to_id("<eos>")
        self.specials = {self.tok.token_to_id(name): name for name in SPECIAL_TOKENS}

    def encode(self, text, option):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids if i not in (self.bos_id, self.eos_id)])

    def show(self, ids):
        """The text of `ids` with every special named where it stands (<eos>, ...), which decode drops."""
        parts, run = [], []
        for i in list(ids) + [None]:
            if i is None or int(i) in self.specials:
                parts.append(self.tok.decode([int(t) for t in run]))
                run = []
                if i is not None:
                    parts.append(self.specials[int(i)])
            else:
                run.append(i)
        return "".join(parts)


def cmd_generate(args):
    import torch

    from . import decode

    ckpt, model, cfg = _resolve_checkpoint(args.checkpoint)
    star = cfg.data == "star"
    codec = _StarCodec(cfg) if star else _TextCodec(ckpt)
    prompt = codec.encode(args.prefix, "--prefix")
    goal = codec.encode(args.suffix, "--suffix") if args.suffix else []
    # the model never saw PAD, EOS or a second BOS inside a row: generate places BOS and EOS itself
    # (a prompt's own leading BOS is that BOS); k counts the option's tokens from 0
    for option, ids, start in (("--prefix", prompt, int(prompt[:1] == [codec.bos_id])), ("--suffix", goal, 0)):
        for k, t in enumerate(ids[start:], start):
            if t in codec.specials:
                raise ValueError(f"{option}: token {k} encodes as {codec.specials[t]} (id {t}); a row holds PAD, "
                                 f"BOS and EOS only where generate puts them (BOS first, EOS last)"
                                 + ("" if star else ": the checkpoint's tokenizer makes it from text"))
    if not prompt or prompt[0] != codec.bos_id:
        prompt = [codec.bos_id] + prompt
    bst = cfg.method == "bst"
    # a BST whose Next head got no gradient (the paper's improved BST: next_weight 0, gamma 0.9)
    # decodes forward with its GPT head, as the paper's does
    gpt = bst and (cfg.next_weight == 0 or cfg.gamma == 1)
    if gpt:
        untrained = "next_weight 0" if cfg.next_weight == 0 else "gamma 1"
        if cfg.gamma == 0:
            raise ValueError(f"this BST checkpoint trained neither its Next head ({untrained}) nor a GPT head "
                             f"(gamma 0): nothing decodes forward")
        if goal or args.search == "plan" or args.rollouts is not None:
            raise ValueError(f"this BST checkpoint's Next head was not trained ({untrained}): generate decodes "
                             f"with its GPT head, forward only (--search greedy, sample or beam, no --suffix)")
    if star and cfg.method != "fim":  # FIM's own layout is read below
        # the rows' form: [BOS, edges, '/', s, g, '='] then path nodes (a prompt without '/ s g =' or
        # with other tokens after it was decoded as if it were one, into something not a path)
        tok = codec.tok
        query = prompt.index(tok.query_id) if tok.query_id in prompt else len(prompt)
        node = lambda t: 0 <= t < tok.n_nodes  # noqa: E731
        if not (len(prompt) >= query + 4 and node(prompt[query + 1]) and node(prompt[query + 2])
                and prompt[query + 3] == tok.answer_id and all(map(node, prompt[query + 4:]))):
            raise ValueError("--prefix: a star-graph prefix is the graph's edges, '/', the start and goal nodes and '=' "
                             "(e.g. \"3 7 | 7 2 | 3 5 | 5 1 / 3 1 =\"), then the path nodes already known, if any")
    if cfg.method in ("fim", "teacherless") and prompt[-1] != codec.tok.answer_id:
        # FIM trained on [... / s g | n_j .. n_l =] then the whole path; teacherless on dummies after '='
        raise ValueError(f"a {cfg.method} star-graph prefix must end with '=' (the model was trained on no path "
                         f"nodes after it)")
    if cfg.method == "fim":
        # a prompt in FIM form already ([... / s g | n_j .. n_l =]: '|' after the query's '/') is
        # decoded as it is; otherwise FIM is given --suffix or, without one, the goal, as its
        # evaluation is ([... / s g | g =]): a prompt without '| suffix' never came in training
        tok = codec.tok
        query = len(prompt) - 1 - prompt[::-1].index(tok.query_id) if tok.query_id in prompt else None
        if query is not None and tok.edge_sep_id in prompt[query:]:
            if goal:
                raise ValueError("this fim prefix carries its suffix already ('| ... =' after '/'): leave out --suffix")
        elif not goal:
            if len(prompt) < 3 or not 0 <= prompt[-2] < tok.n_nodes:
                raise ValueError("a fim star-graph prefix ends with its goal node and '=' (... / s g =)")
            goal = [prompt[-2]]
    # a BST plans toward a goal; a FIM model reads it in its prompt and decodes greedily
    search = args.search or ("plan" if (goal and bst) or args.rollouts is not None else "greedy")
    if gpt:
        model = decode.searcher(model, head="gpt")
    if search == "plan" and not bst:
        raise ValueError(f"planning needs a BST checkpoint; this one is '{cfg.method}' (use --search greedy, sample or beam)")
    if goal and not bst and cfg.method != "fim":
        raise ValueError(f"a model of method '{cfg.method}' cannot read a --suffix (use a BST or a FIM checkpoint)")
    if goal and cfg.method == "fim":
        # FIM reads its goal in front of the answer: [... / s g | suffix =]
        prompt, goal = prompt[:-1] + [codec.tok.edge_sep_id] + goal + [prompt[-1]], []
    # star graphs: the rest of the path, which a goal (its last nodes) ends; text: 32 tokens, or
    # what the model's positions leave after the prompt, the goal and EOS
    for option, value, applies in (("--temperature", args.temperature, "sample"), ("--top-k", args.top_k, "sample"),
                                   ("--seed", args.seed, "sample"), ("--beams", args.beams, "beam"),
                                   ("--rollouts", args.rollouts, "plan")):
        if value is not None and search != applies:
            raise ValueError(f"{option} applies to --search {applies}, not {search}")
    # checked here, by the flag's name: the decoders' errors name their own arguments (n_new, top_k)
    V = cfg.model.vocab_size
    for option, value, lowest, highest in (("--horizon", args.horizon, 0, None), ("--top-k", args.top_k, 1, V),
                                           ("--rollouts", args.rollouts, 1, None), ("--beams", args.beams, 1, None)):
        if value is not None and not (lowest <= value and (highest is None or value <= highest)):
            raise ValueError(f"{option} must be an int >= {lowest}" + (f" and <= {highest} (the vocabulary size)"
                             if highest is not None else "") + f", got {value}")
    if args.temperature is not None and not 0 <= args.temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be in [0, 2**63), got {short(str(args.seed))}")
    if args.horizon is not None:
        horizon = args.horizon
        # the positions a forward encoder reads (decode's rule: planning scores the prompt, the
        # horizon, the goal and EOS in one row; the others read the generated tokens but the last)
        extra = len(goal) + 1 if search == "plan" else -1
        room = cfg.model.max_len - len(prompt) - extra
        if horizon > max(room, 0):
            raise ValueError(f"--horizon {horizon} does not fit the model's max_len {cfg.model.max_len} after the "
                             f"prompt ({len(prompt)} tokens)" + (f", the goal ({len(goal)}) and EOS" if search == "plan"
                                                                 else "") + f": at most {max(room, 0)}")
    elif star:
        # the path nodes a prefix already holds after its last "=" are not generated again
        given = prompt[::-1].index(codec.tok.answer_id) if codec.tok.answer_id in prompt else 0
        horizon = cfg.star_path_len - given - len(goal)
        if horizon < 0:
            raise ValueError(f"--prefix holds {given} path nodes after '=' and --suffix {len(goal)}: more than "
                             f"a path's {cfg.star_path_len} nodes")
    else:
        horizon = min(32, cfg.model.max_len - len(prompt) - len(goal) - 1)
        if horizon < 1:
            room = cfg.model.max_len - len(goal) - 2  # at least one new token
            raise ValueError(f"the prompt ({len(prompt)} tokens) and --suffix ({len(goal)}) leave no room for a "
                             f"new token within max_len {cfg.model.max_len}: shorten the prompt to at most "
                             f"{max(room, 0)} tokens" + (" or the suffix" if goal else ""))
    score = None
    if cfg.method == "teacherless":
        if search != "greedy":
            raise ValueError("a teacherless model decodes in one pass: use --search greedy")
        new = model.generate(torch.tensor([prompt]), horizon)[0].tolist()
    elif search == "plan":
        result = decode.plan(model, prompt, goal, horizon=horizon, rollouts=120 if args.rollouts is None else args.rollouts, eos_id=codec.eos_id)
        new = result.best[len(prompt):len(result.best) - len(goal)].tolist()
        score = float(result.scores.max())
    elif search == "beam":
        seqs, logp = decode.beam_search(model, prompt, horizon, beams=120 if args.beams is None else args.beams,
                                        goal=goal, eos_id=codec.eos_id)
        new, score = seqs[0].tolist(), float(logp[0])
    else:
        gen = torch.Generator().manual_seed(args.seed or 0)
        temperature = 1.0 if args.temperature is None else args.temperature
        new = decode.sample(model, torch.tensor([prompt]), horizon, codec.eos_id, goal=goal, generator=gen,
                            temperature=0 if search == "greedy" else temperature, top_k=args.top_k)[0].tolist()
    if not star and not goal and codec.eos_id in new:  # the text ended there
        new = new[:new.index(codec.eos_id)]
    print(f"prefix:    {codec.decode(prompt)}")
    # star graphs, and a middle before a suffix, are shown whole, specials named: the tokens scored
    # (a middle cut at an <eos> was not the candidate the score is of)
    print(f"generated: {codec.show(new) if star or goal else codec.decode(new)}")
    if goal:
        print(f"suffix:    {codec.decode(goal)}")
    if score is not None:
        print(f"search: {search}, log score {score:.4f}")


def cmd_tokenize(args):
    """Tokenise a text corpus once into a prepared corpus that `data: DIR` trains from."""
    import time

    from .data.prepared import check_workers, print_summary, tokenize_corpus
    from .data.text import check_vocab_size

    if args.tokenizer is not None and args.vocab is not None:
        raise ValueError("--vocab sets the size of a BPE tokenizer trained here; with --tokenizer the tokenizer's "
                         "own vocabulary is used: give one of them")
    if args.tokenizer is not None and args.bpe_sample_mb is not None:
        raise ValueError("--bpe-sample-mb applies to a BPE tokenizer trained here, not to --tokenizer")
    if args.workers is not None:
        check_workers("--workers", args.workers)
    sample = None
    if args.bpe_sample_mb is not None:  # bytes; less than one is no sample (it was raised to 1 byte, silently)
        sample = int(args.bpe_sample_mb * 1e6)
        if sample < 1:
            raise ValueError(f"--bpe-sample-mb must be at least 1e-6 (one byte), got {args.bpe_sample_mb}")
    vocab = None if args.vocab is None else check_vocab_size("--vocab", args.vocab)  # None: 1000, the paper's
    t = time.perf_counter()
    manifest = tokenize_corpus(args.data, args.out, vocab_size=vocab, tokenizer=args.tokenizer,
                               max_doc_tokens=args.max_doc_tokens, progress=not args.no_progress, workers=args.workers,
                               bpe_sample_bytes=sample)
    print_summary(manifest, args.out, time.perf_counter() - t)


def _positive_float(text):
    """An argparse type: a finite float > 0."""
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def cmd_probe(args):
    """Probe accuracy per k (f at "=" -> the path token k ahead) of star-graph checkpoints."""
    from .data import StarGraphData
    from .decode import probe_future_tokens

    loaded = []
    for path in args.checkpoint:  # every checkpoint checked before the first probe trains
        _, model, cfg = _resolve_checkpoint(path)
        if cfg.data != "star" or cfg.method not in ("bst", "forward"):
            raise ValueError(f"{short(str(path))}: probes read star-graph BST or forward-only checkpoints, not {cfg.method} on {cfg.data}")
        loaded.append((path, model, cfg))
    for path, model, cfg in loaded:
        # A seed the run never used, so probe graphs are fresh.
        data = StarGraphData(cfg.star_degree, cfg.star_path_len, cfg.star_nodes, args.n_train, args.n_test, seed=cfg.seed + 12345)
        ks = range(1, data.path_len + 1)
        acc = probe_future_tokens(model, data.train_tokens, data.test_tokens, data.prefix_start, ks, steps=args.steps)
        print(f"{cfg.method} ({path}): " + ", ".join(f"k={k}: {a:.3f}" for k, a in acc.items()))


def _prog() -> str:
    """The name the user typed: `bst-fast` for the console script, else `python -m bst_fast`."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "bst-fast" if name.startswith("bst-fast") else "python -m bst_fast"


def main(argv=None):

    # no abbreviations (every command's parser too): `--o` was `--overwrite`, which deletes a run's files
    ap = argparse.ArgumentParser(prog=_prog(), description="Belief State Transformer training: "
                                 "the Python API is bst_fast.train(config, **overrides)", allow_abbrev=False)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train one model"), ("star", "star-graph reproduction: BST vs forward-only")):
        p = sub.add_parser(name, allow_abbrev=False, help=helptext)
        default = str(CONFIGS / "star_cpu.yaml") if name == "star" else None
        p.add_argument("--config", default=default, help=CONFIG_HELP +
                       (f" (default {default})" if default else ""))
        p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field, e.g. model.n_layer=6")
        p.add_argument("--resume", action="store_true",
                       help="continue from the latest checkpoint in out_dir" if name == "train" else _RESUME_EACH)
        if name == "train":
            p.add_argument("--overwrite", action="store_true", help="start over in an out_dir that holds another run")
        if name == "star":
            p.add_argument("--methods", nargs="+", default=["bst", "forward"], choices=["bst", "forward"])
    p = sub.add_parser("table", allow_abbrev=False, help="star graphs: train every baseline and BST ablation, print path accuracy")
    p.add_argument("--config", default=str(CONFIGS / "star_cpu.yaml"),
                   help=CONFIG_HELP + f" (default {CONFIGS / 'star_cpu.yaml'})")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help=_RESUME_EACH)
    p.add_argument("--out", help="also write the table to this file")
    p.add_argument("--note", help="a line written above the table in --out")
    p = sub.add_parser("generate", allow_abbrev=False, help="decode from a checkpoint: greedy/sample, planning (Algorithm 1), beam search")
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder or a run folder (its latest checkpoint)")
    p.add_argument("--prefix", required=True, help="text (star graphs: '3 7 | 7 2 | 3 5 | 5 1 / 3 2 =')")
    p.add_argument("--suffix", help="the goal: planning / beam search write toward it")
    p.add_argument("--search", choices=["greedy", "sample", "plan", "beam"],
                   help="default: plan with --suffix or --rollouts, else greedy")
    p.add_argument("--rollouts", type=int, help="planning roll-outs (default 120, the paper's)")
    p.add_argument("--horizon", type=int, help="tokens to generate (default: the rest of the path on star graphs, "
                   "else 32 or what max_len leaves)")
    p.add_argument("--beams", type=int, help="--search beam: the beam width (default 120, the paper's)")
    p.add_argument("--temperature", type=float, help="--search sample (default 1)")
    p.add_argument("--top-k", type=int, help="--search sample: keep the k most likely tokens")
    p.add_argument("--seed", type=int, help="--search sample (default 0)")
    p = sub.add_parser("probe", allow_abbrev=False, help="belief-state probes of star-graph checkpoints: accuracy per k")
    p.add_argument("--checkpoint", action="append", required=True, help="repeat for several models")
    p.add_argument("--n-train", type=_positive, default=2000, help="probe training graphs")
    p.add_argument("--n-test", type=_positive, default=500, help="probe test graphs")
    p.add_argument("--steps", type=_positive, default=300, help="probe optimizer steps")
    p = sub.add_parser("tokenize", allow_abbrev=False, help="tokenise a text corpus once into a prepared corpus (memory-mapped ids, "
                       "its tokenizer, a manifest) that `--set data=DIR` trains from",
                       description="Tokenise the documents of DATA (.txt files or folders, documents split at blank "
                       "lines, as training reads them) into DIR: tokens.bin, offsets.bin, tokenizer.json, "
                       "manifest.json. Training from DIR tokenises nothing and memory-maps the ids.")
    p.add_argument("data", nargs="+", metavar="DATA", help="a .txt file or a folder of them (several: one corpus)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the prepared corpus to write (a new or empty folder, or a prepared corpus to replace)")
    p.add_argument("--vocab", type=int, metavar="N", help="BPE vocabulary of the tokenizer trained here "
                   "(default 1000, the paper's; 259 to 2**20)")
    p.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer.json instead of training one "
                   "(its vocabulary sets the model's)")
    p.add_argument("--max-doc-tokens", type=_count, metavar="N",
                   help="drop documents longer than N tokens (the paper's TinyStories setup: 256; 0 keeps all, as "
                        "the config's max_doc_tokens 0 does); reports how many")
    p.add_argument("--bpe-sample-mb", type=_positive_float, metavar="MB",
                   help="train the BPE tokenizer on about MB megabytes of documents spread over the corpus "
                   "(default: all of it, the tokenizer a text run trains)")
    p.add_argument("--workers", type=int, metavar="N", help="encoding processes (default: one per CPU for a corpus over "
                   "4 MiB, else none; 0: encode in this process); the ids are the same whatever N")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    try:
        check_environment()
        {"train": cmd_train, "star": cmd_star, "table": cmd_table, "generate": cmd_generate,
         "probe": cmd_probe, "tokenize": cmd_tokenize}[args.command](args)
    except (ValueError, FileNotFoundError) as e:  # bad input: a config, an argument, a folder
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (OSError, RuntimeError, MemoryError, TypeError, KeyError, IndexError, ArithmeticError) as e:
        # a fault of the machine or the run (a full disk, a read-only folder, a size that does not fit,
        # a non-finite loss): one line, and the traceback only when asked for
        if os.environ.get("BST_FAST_TRACEBACK", "0") not in ("", "0"):
            raise
        print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # no checkpoint is written on an interrupt: a run resumes from its last saved one
        training = args.command in ("train", "star", "table")
        print("interrupted" + (" (--resume continues from the latest checkpoint, if one was written; the steps "
                               "since it run again)" if training else ""), file=sys.stderr)
        return 130
    return 0


def cli() -> int:
    """The console script `bst-fast` and `python -m bst_fast`: main(), then the DDP group a train
    command started is ended at the process's real exit (not in main(): a second main() in the same
    torchrun process would start a new group, whose rendezvous can hang)."""
    try:
        rc = main()
    finally:
        trainer = sys.modules.get("bst_fast.trainer")
        ended = trainer is not None and trainer.end_process_group()
    if ended:
        # A DDP rank's work is done and its group ended, but gloo's threads could still abort the
        # interpreter's teardown (SIGABRT, 'terminate called without an active exception', about one
        # loaded run in ten), failing a finished run under torchrun: the process leaves without it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _one_line(error: BaseException, limit: int = 2000) -> str:
    """An error's message on one bounded line (torch's errors span several)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


if __name__ == "__main__":
    sys.exit(cli())
