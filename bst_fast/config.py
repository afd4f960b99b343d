"""bst_fast.config: the training config (TrainConfig), how it is loaded, overridden and checked.

A config comes from a YAML/JSON file, a mapping or a TrainConfig; overrides (keyword arguments of
`bst_fast.train`, `--set` on the command line) use the same field names and the same type rules.
Every error names the field and quotes the value it got, cut to a bounded length.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import json
import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Union

from ._checks import MAX_VOCAB, is_int, plain_number, short
from .model import ModelConfig

METHODS = ("bst", "forward", "augment", "fim", "teacherless")
STAR_ONLY = ("augment", "fim", "teacherless")  # their data transforms are defined on star graphs
# Fields only one kind of data reads: a non-default value on the other kind is refused (the run would
# ignore it), and on resume they are no difference there (older versions let a config set them).
STAR_FIELDS = ("star_degree", "star_path_len", "star_nodes", "n_train", "n_test", "augment_prob")
TEXT_FIELDS = ("text_vocab", "max_len", "eval_batches")  # tokenizer, pack and max_doc_tokens have their own checks
# The BST's objective: the other methods read none of these (reduction and augment_prob are left to
# every method, as their comments say), so a non-default value is refused there, and is no
# difference on resume.
BST_FIELDS = ("pairs", "next_weight", "gamma", "min_gap", "max_gap", "meet_token")


def bundled_configs() -> Path:
    """The folder of configs shipped with bst_fast: bst_fast/configs in an installed package
    (setup.py maps the repository's configs/ there), the repository's configs/ in a clone or an
    editable install."""
    here = Path(__file__).resolve().parent
    return here / "configs" if (here / "configs").is_dir() else here.parent / "configs"


def config_path(path: Union[str, Path]) -> Path:
    """`path` itself when it exists, else the shipped config it names (see TrainConfig.load);
    FileNotFoundError naming the shipped ones otherwise."""
    path = Path(path)
    if path.is_file():
        return path
    if path.exists():
        raise FileNotFoundError(f"config {str(path)!r} is not a file")
    shipped = bundled_configs()
    name = path.name if path.suffix else path.name + ".yaml"
    if path.parent in (Path("."), Path("configs")) and (shipped / name).is_file():
        return shipped / name
    names = ", ".join(sorted(p.stem for p in shipped.glob("*.yaml")))
    raise FileNotFoundError(f"config file {str(path)!r} does not exist (the shipped configs, loadable by "
                            f"name: {names or 'none found'})")


@dataclass
class TrainConfig:
    # --- what to train ---
    method: str = "bst"  # one of METHODS (bst_fast/trainer.py's docstring says what each trains)
    # "star" for star graphs; else a text file or folder, a prepared corpus (a folder `bst-fast tokenize`
    # wrote), or a list of prepared corpora, each a path or a [path, weight] pair: a weighted mixture
    # (a list is stored as [[path, weight], ...]; docs/data.md)
    data: Union[str, List[Any]] = "star"
    star_degree: int = 2  # d of G(d, l): arms from the start node
    star_path_len: int = 5  # l of G(d, l): nodes on the path, start and goal included
    star_nodes: int = 50  # N: node labels to draw from
    n_train: int = 0  # fixed set of training graphs; 0 streams fresh graphs every step
    n_test: int = 500  # held-out graphs for path accuracy (never trained on)
    # method "augment": share of training rows whose goal becomes an intermediate node (other methods
    # leave it unused: `star` and `table` train every method from one config)
    augment_prob: float = 0.5
    text_vocab: int = 1000  # BPE vocabulary for text data (the paper: 1000)
    tokenizer: str = ""  # raw text: a tokenizer.json to tokenise it with (its vocabulary sets the model's); "": train a BPE of text_vocab
    max_len: int = 256  # text rows hold at most this many tokens, BOS and EOS included; longer documents are cut
    max_doc_tokens: int = 0  # text: drop documents longer than this many tokens (the paper's TinyStories: 256); 0 keeps all
    # text: true packs whole documents (each BOS .. EOS) back to back into rows of max_len, padded; "split"
    # joins them all into one stream cut into full rows of max_len, documents cut across rows (docs/data.md)
    pack: Union[bool, str] = False
    model: ModelConfig = field(default_factory=ModelConfig)  # vocab_size / max_len are set from the data
    # --- objective ---
    pairs: Optional[float] = None  # None: all prefix/suffix pairs; a fraction in (0, 1]: subsample
    next_weight: float = 0.5  # lambda: Next vs Prev weight of the belief loss
    gamma: float = 0.0  # weight of the plain next-token head on f (adds that head when > 0)
    backend: str = "auto"  # belief_state_loss backend
    min_gap: int = 2  # smallest j - i of a pair; 1 adds the adjacent ("meeting") pairs, labelled meet_token
    max_gap: Optional[int] = None  # largest j - i, inclusive (None: no bound); the official max_gap G is our G - 1
    meet_token: Optional[Union[int, str]] = None  # the gap-1 pairs' label: "eos" or an id (min_gap 1 needs it)
    # "mean" over all pairs of the batch, or "row_mean" (each row's mean, then the mean over rows): the
    # BST's pair loss; a forward-only model's loss and the GPT head's (gamma) are token means either way
    reduction: str = "mean"
    # --- optimisation ---
    steps: int = 2000  # optimizer steps
    batch_size: int = 64  # global batch (split over DDP ranks)
    # micro-batches a rank's share is split into (their gradients add up to the batch's): batch_size must
    # divide by the number of ranks times grad_accum; a resume may change it
    grad_accum: int = 1
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # end of the cosine decay
    warmup: int = 100  # linear warmup steps, then the cosine to min_lr (a run shorter than this never reaches lr)
    weight_decay: float = 0.1  # AdamW, on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables
    # --- runtime ---
    device: str = "auto"  # "auto", "cpu" or "cuda"
    compile: bool = False  # torch.compile the encoders
    # DDP: seconds a rank waits in a collective for the others before the run fails (a frozen rank holds
    # the rest that long); 0: torch's default (30 min on gloo). Rank 0 saves checkpoints while the others
    # wait: keep it above what a save takes. A resume in a new process may change it (a process's group,
    # once made, keeps its timeout)
    ddp_timeout: float = 0.0
    seed: int = 0  # data order, pair samples and dropout are all functions of (seed, step)
    out_dir: str = "runs/star"  # checkpoints, metrics.csv, tensorboard (the default for text runs too: set it)
    eval_every: int = 250  # steps between evaluations (and at the end); 0: only at the end
    eval_batches: int = 0  # text: an evaluation scores the first N held-out batches (of batch_size rows); 0: all
    ckpt_every: int = 500  # steps between checkpoints (and at the end); 0: only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept (0: all); a step-N folder is the run's, deleted whole
    keep_best: str = ""  # also keep the best checkpoint by this evaluation figure: "held_out_loss" or "path_accuracy"
    log_every: int = 10  # steps between progress-bar / CSV updates
    progress: bool = True  # tqdm progress bar

    # ---- loading ----
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        """A config from a mapping of fields, the model's as a mapping or as dotted keys
        (`model.n_layer`), as `apply_overrides` takes them: a file, a dict config and `--set` alike.
        One field given both ways (`model: {n_layer: 4}` and `model.n_layer: 2`) is refused: which
        one won depended on the keys' order."""
        if not isinstance(d, Mapping):
            raise ValueError(f"a config is a mapping of fields, got {type(d).__name__}")
        _given_once(d)
        return apply_overrides(TrainConfig(), d)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "TrainConfig":
        """A config from a .yaml/.yml or .json file. A path that does not exist but names a
        config shipped with bst_fast (`configs/star_cpu.yaml`, `star_cpu.yaml` or `star_cpu`)
        loads the shipped one, so the README's paths work outside a clone of the repository."""
        path = config_path(path)
        yaml_file = path.suffix.lower() in (".yaml", ".yml")  # config.YAML too
        try:
            text = path.read_text(encoding="utf-8-sig")  # a byte-order mark, which some editors write, is dropped
        except UnicodeDecodeError as e:
            raise ValueError(f"config {path} is not UTF-8 text: {e}") from None
        try:
            d = load_yaml(text) if yaml_file else load_json(text)
        except Exception as e:  # yaml's and json's parse errors alike
            raise ValueError(f"config {path} is not valid {'YAML' if yaml_file else 'JSON'}: {short(str(e), 500)}") from None
        if d is None:  # an empty (or cut) file trained the whole default config, silently
            raise ValueError(f"config {path} holds no fields: give them, or no config for the defaults")
        if not isinstance(d, dict):
            raise ValueError(f"config {path} must hold a mapping of fields, got {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self):
        def bad(name, want):
            raise ValueError(f"config field {short(name)} must be {want}, got {short(getattr(self, name))}")

        def unread(names, why):  # fields this run would silently ignore: at their defaults, or refused
            for name in names:
                default = TrainConfig.__dataclass_fields__[name].default
                if getattr(self, name) != default:
                    bad(name, f"its default {default!r} for {why}, which this run does not read)")

        if not isinstance(self.model, ModelConfig):
            bad("model", "a ModelConfig (a mapping of its fields goes through TrainConfig.from_dict)")
        # Every field's type, as a config file's are checked; the values as checked (a numpy scalar as
        # the Python number, a Path as its str) are this config's from here on: the run saves them
        # (json refused np.float32 at the first checkpoint, after the whole training).
        checked = TrainConfig.from_dict(self.to_dict())
        for obj, new in ((self, checked), (self.model, checked.model)):
            for f in fields(obj):
                if f.name != "model":
                    setattr(obj, f.name, getattr(new, f.name))
        _check_bounds(self)
        if self.method not in METHODS:
            bad("method", f"one of {METHODS}")
        if self.method in STAR_ONLY and self.data != "star":
            bad("method", f"'bst' or 'forward' for text data ({STAR_ONLY} are star-graph baselines)")
        if self.method != "bst":
            unread(BST_FIELDS, f"method {self.method!r} (it is a field of the BST's objective")
        if self.method == "augment" and self.star_path_len < 3:
            bad("method", "not 'augment' when star_path_len < 3 (no intermediate node to ask for)")
        if not 0.0 <= self.augment_prob <= 1.0:
            bad("augment_prob", "in [0, 1]")
        for name in ("steps", "batch_size", "grad_accum", "star_degree", "star_nodes", "n_test", "text_vocab", "log_every"):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        for name in ("data", "out_dir"):  # Path("") is the current folder: every *.txt there was read, or written into
            if getattr(self, name) == "":
                bad(name, "a non-empty path ('' is the current folder)")
        if not isinstance(self.data, str):
            self.data = _data_list(self.data, "data")
            if not self.data:
                bad("data", "'star', a path or a non-empty list of prepared corpora")
            for path, weight in self.data:
                if not path or path == "star":
                    bad("data", "a list of prepared corpora (folders; star graphs are not mixed)")
                if not math.isfinite(weight) or weight <= 0:
                    raise ValueError(f"config field 'data': the weight of {short(path)} must be a finite number > 0, "
                                     f"got {short(weight)}")
        if self.tokenizer and self.data == "star":
            bad("tokenizer", "'' for star-graph data")
        if self.pack and self.data == "star":
            bad("pack", "false for star-graph data (a star graph fills its row: packing is for text documents)")
        if self.max_doc_tokens and self.data == "star":
            bad("max_doc_tokens", "0 for star-graph data (it drops long text documents)")
        if self.data == "star":  # fields of the other kind of data
            unread(TEXT_FIELDS, "star-graph data (it is a text field")
        else:
            unread(STAR_FIELDS, "text data (it is a star-graph field")
        if self.data != "star" and not 259 <= self.text_vocab <= MAX_VOCAB:
            bad("text_vocab", f"from 259 (256 byte tokens and PAD, BOS, EOS) to {MAX_VOCAB} for text data")
        if self.star_path_len < 2:
            bad("star_path_len", ">= 2")
        need = 1 + self.star_degree * (self.star_path_len - 1)  # G(d, l) has 1 + d (l - 1) nodes
        if self.data == "star" and self.star_nodes < need:
            bad("star_nodes", f">= 1 + star_degree * (star_path_len - 1) = {need} for G({self.star_degree}, "
                f"{self.star_path_len})")
        if self.max_len < 4:
            bad("max_len", ">= 4")
        for name in ("n_train", "warmup", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints", "grad_clip",
                     "weight_decay", "max_doc_tokens"):
            if getattr(self, name) < 0:
                bad(name, ">= 0")
        if self.pairs is not None and not 0.0 < self.pairs <= 1.0:
            bad("pairs", "None or a fraction in (0, 1]")
        if self.min_gap < 1:
            bad("min_gap", ">= 1")
        if self.max_gap is not None and self.max_gap < self.min_gap:
            bad("max_gap", f"None or >= min_gap ({self.min_gap})")
        # A star-graph BST's evaluation decodes each path node from the pair of its prefix (from "=" on)
        # and the empty suffix (EOS): gaps l + 1 down to 2. A pair set without some of them leaves that
        # decoding untrained.
        if self.data == "star" and self.method == "bst" and self.max_gap is not None and self.max_gap <= self.star_path_len:
            bad("max_gap", f"None or >= star_path_len + 1 = {self.star_path_len + 1} for a star-graph BST (its "
                "evaluation reads pairs of a path prefix and the empty suffix, up to l + 1 apart)")
        if self.data == "star" and self.method == "bst" and self.min_gap > 2:
            bad("min_gap", "1 or 2 for a star-graph BST (its evaluation reads the last path node's pair, 2 apart)")
        if isinstance(self.meet_token, str) and self.meet_token != "eos":
            bad("meet_token", "None, 'eos' or a token id")
        if isinstance(self.meet_token, int) and self.meet_token < 0:
            bad("meet_token", "a token id >= 0")
        if self.min_gap == 1 and self.meet_token is None:
            bad("meet_token", "'eos' or a token id when min_gap is 1 (the adjacent pairs' label: "
                "nothing lies between their prefix and suffix)")
        if self.keep_best not in ("", "held_out_loss", "path_accuracy"):
            bad("keep_best", "'', 'held_out_loss' or 'path_accuracy'")
        if self.keep_best and (self.keep_best == "path_accuracy") != (self.data == "star"):
            bad("keep_best", f"the figure this data's evaluation gives ({'path_accuracy' if self.data == 'star' else 'held_out_loss'})")
        if self.reduction not in ("mean", "row_mean"):
            bad("reduction", "'mean' or 'row_mean'")
        if not 0.0 <= self.next_weight <= 1.0:
            bad("next_weight", "in [0, 1]")
        if not 0.0 <= self.gamma <= 1.0:
            bad("gamma", "in [0, 1]")
        # A star-graph BST's evaluation decodes paths with the Next head on (f, B(EOS)), or with the
        # GPT head when the Next head gets no gradient (next_weight 0, gamma 1): a run that trains
        # neither would report (and keep_best pick by) an untrained head's accuracy.
        if self.data == "star" and self.method == "bst" and self.next_weight == 0 and self.gamma == 0:
            bad("next_weight", "> 0, or gamma > 0, for a star-graph BST (its evaluation decodes paths with the "
                "Next head, or the GPT head when next_weight is 0: with both 0 neither is trained)")
        # timedelta takes up to about 2.7e12 s (a billion is 30 years); under a second the group's own
        # rendezvous times out (0.0005 s failed at start with a C++ stack dump)
        if not (self.ddp_timeout == 0 or 1 <= self.ddp_timeout < 1e9):
            bad("ddp_timeout", "0 (torch's default) or a number of seconds from 1 to below 1e9")
        for name in ("lr", "grad_clip", "weight_decay"):  # the other floats' ranges refuse nan and inf
            if not math.isfinite(getattr(self, name)):
                bad(name, "a finite number")
        if not 0 < self.lr < 2.0**128:  # AdamW's float32 arithmetic: a larger lr overflows at its first step
            bad("lr", "> 0 and < 2**128 (float32's range)")
        if not 0 <= self.min_lr <= self.lr:
            bad("min_lr", f"in [0, lr={self.lr}]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, "in [0, 1)")
        if not 0 <= self.seed < 2**40:  # the seeds drawn from it (seed * 1_000_003 + ...) stay in torch's 64 bits
            bad("seed", "in [0, 2**40)")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "'auto', 'cpu' or 'cuda'")
        from .loss import BACKENDS

        if self.backend not in BACKENDS:
            bad("backend", f"one of {BACKENDS}")
        self.model.check()
        if self.model.gpt_head and self.gamma == 0:  # the trainer sets the head from gamma
            raise ValueError("config field 'model.gpt_head' is true, but gamma is 0: a run trains the GPT head only "
                             "with gamma > 0, which adds it (leave model.gpt_head false and set gamma)")
        return self


def _given_once(d: Mapping) -> None:
    """Refuse a nested field given both as a dotted key and in its parent's mapping (or a whole
    ModelConfig): which one won depended on the keys' order."""
    for key in d:
        parent, _, leaf = key.partition(".") if isinstance(key, str) else ("", "", "")
        whole = d.get(parent)  # a mapping names some fields, a whole ModelConfig every one
        if leaf and "." not in leaf and (isinstance(whole, Mapping) and leaf in whole
                                         or dataclasses.is_dataclass(whole) and not isinstance(whole, type)):
            raise ValueError(f"config field {short(key)} is given twice: as {key!r} and in {parent!r}; give it once")


def _as_float(name: str, value) -> float:
    """float(value) of an int or float field's value, a ValueError naming the field where it is too
    large for a float (float(10**400) raises OverflowError, which named nothing)."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"config field {short(name)} must be a number a float holds, got {short(value)}") from None


def _unknown_field(key: str, bad: str, known) -> ValueError:
    """The error for an unknown config field: it names the key as given, the closest known field
    (a nested config's field of that exact name first: `n_layer` is 'model.n_layer') and every
    known field at that level."""
    *parents, leaf = bad.split(".")
    prefix = "".join(p + "." for p in parents)
    nested = [f"{p}.{leaf}" for p, f in known.items() if dataclasses.is_dataclass(field_default(f))
              and leaf in {g.name for g in fields(type(field_default(f)))}]
    # else the closest name one level down or up as well: n_layers is 'model.n_layer', dmodel
    # 'model.d_model', model.steps 'steps'
    pool = {prefix + c: c for c in known}
    for p, f in known.items():
        if dataclasses.is_dataclass(field_default(f)):
            pool.update({f"{prefix}{p}.{g.name}": g.name for g in fields(type(field_default(f)))})
    if prefix:
        pool.update({g.name: g.name for g in fields(TrainConfig) if g.name not in pool.values()})
    ratio = {name: difflib.SequenceMatcher(None, leaf, written).ratio() for name, written in pool.items()}
    best = max(ratio, key=ratio.get) if ratio else None
    close = nested or ([best] if best is not None and ratio[best] >= 0.6 else [])
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f" of {prefix[:-1]!r}" if prefix else ""
    what = "" if key == bad else f": {short(bad)} is not a field"
    return ValueError(f"config field {short(key)} is unknown{what}{hint}; known fields{where}: {sorted(known)}")


def field_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# TrainConfig's fields that name files or folders: an os.PathLike is taken (stored as its str).
PATH_FIELDS = ("data", "out_dir", "tokenizer")
# The int fields' upper bound, checked here for every one (the model's too): past it a size reached
# numpy, torch or C longs as an OverflowError, a MemoryError or a C++ frame dump naming no field.
MAX_INT, MAX_INT_TEXT = 2**31 - 1, "2**31 - 1"
# Tighter bounds where the code needs them: the MLP width round(mlp_ratio * d_model) is at most
# 2**24 (ModelConfig.check), so a d_model past it was blamed on mlp_ratio.
INT_BOUNDS = {"model.d_model": (2**24, "2**24")}
# Ints with a range of their own: seed's (TrainConfig.check), max_gap's (any size is no limit) and
# meet_token's (an id of the data's vocabulary).
UNBOUNDED_INTS = ("seed", "max_gap", "meet_token")


def _check_bound(name: str, value: int):
    bound, text = INT_BOUNDS.get(name, (MAX_INT, MAX_INT_TEXT))
    if value > bound:
        raise ValueError(f"config field {short(name)} must be at most {text} = {bound}, got {short(value)}")


def _check_bounds(cfg: "TrainConfig"):
    """Every int field at most its bound (INT_BOUNDS, else MAX_INT), checked where a run is about to
    start (TrainConfig.check), not where a saved config.json is read: a run an older version saved
    with a larger value (eval_every: 10**12 for 'never') still loads, and resumes with a resumable
    field lowered (another field past its bound cannot be resumed: its value may not change)."""
    for obj, prefix in ((cfg, ""), (cfg.model, "model.")):
        for f in fields(obj):
            value = getattr(obj, f.name)
            for v in value if isinstance(value, list) and f.name == "head_hidden" else [value]:
                if is_int(v) and prefix + f.name not in UNBOUNDED_INTS:
                    _check_bound(prefix + f.name, v)


def _data_list(value, name: str) -> list:
    """TrainConfig.data given as a list: each entry a path or a [path, weight] pair, returned as
    [[path, weight], ...] (weight 1.0 where none is given); a ValueError naming the field otherwise.
    The weights' values are checked by TrainConfig.check."""
    out = []
    for entry in value:
        if isinstance(entry, (str, os.PathLike)):
            out.append([os.fspath(entry), 1.0])
            continue
        if isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], (str, os.PathLike)):
            weight = plain_number(entry[1])
            if isinstance(weight, (int, float)) and not isinstance(weight, bool):
                out.append([os.fspath(entry[0]), _as_float(name, weight)])
                continue
        raise ValueError(f"config field {short(name)} must be a path, or a list of prepared corpora each a path or "
                         f"a [path, weight] pair; got the entry {short(entry)}")
    if any(not isinstance(path, str) for path, _ in out):  # a bytes path (os.fspath of a bytes PathLike)
        raise ValueError(f"config field {short(name)} must hold str paths, got {short(value)}")
    return out


def _from_dict(cls, d, prefix):
    """cls (TrainConfig or a nested config) from a mapping of its own fields, each value's type checked."""
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in d.items():
        name = prefix + str(key)
        if key not in known:
            raise _unknown_field(name, name, known)
        default = field_default(known[key])
        value = plain_number(value)
        if cls is TrainConfig and key in PATH_FIELDS and isinstance(value, os.PathLike):
            value = os.fspath(value)  # a bytes path stays bytes, refused below
        if key == "data" and isinstance(value, (list, tuple)) and cls is TrainConfig:
            value = _data_list(value, name)
        elif key == "pack" and cls is TrainConfig:
            if not (isinstance(value, bool) or (isinstance(value, str) and value == "split")):
                raise ValueError(f"config field {short(name)} must be false, true or 'split', got {short(value)}")
        elif key == "head_hidden" and cls is ModelConfig:
            if isinstance(value, tuple):
                value = list(value)
            entries = [plain_number(v) for v in value] if isinstance(value, list) else [value]
            if not all(is_int(v) for v in entries):
                raise ValueError(f"config field {short(name)} must be an int or a list of ints, got {short(value)}")
            value = entries if isinstance(value, list) else value
        elif dataclasses.is_dataclass(default):
            if isinstance(value, type(default)):
                value = dataclasses.asdict(value)  # checked like a mapping, and copied
            if not isinstance(value, Mapping):
                raise ValueError(f"config field {short(name)} must be a mapping, got {short(value)}")
            value = _from_dict(type(default), value, name + ".")
        elif default is not None:
            want = type(default)
            if value is None:  # only a field whose default is None takes null
                raise ValueError(f"config field {short(name)} must be {want.__name__}, got None")
            if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = _as_float(name, value)  # an int, or a float subclass (np.float64), as the plain float
            if want is str and isinstance(value, (int, float, datetime.date)) and not isinstance(value, bool):
                # the text as written is lost (0.10 was stored as '0.1', 2024.10 as '2024.1'; YAML
                # reads 2024-01-01 as a date)
                what = f"the date {value.isoformat()}" if isinstance(value, datetime.date) else f"the number {short(value)}"
                raise ValueError(f"config field {short(name)} must be str, got {what} (quote it in a YAML file to keep "
                                 f"the name as written)")
            if not (isinstance(value, want) and not (want is not bool and isinstance(value, bool))):
                raise ValueError(f"config field {short(name)} must be {want.__name__}, got {short(value)}")
            if name in INT_BOUNDS:  # before ModelConfig's own checks, which blamed mlp_ratio for d_model
                _check_bound(name, value)
        elif key == "max_gap" and value is not None:
            if not is_int(value):
                raise ValueError(f"config field {short(name)} must be None or an int, got {short(value)}")
        elif key == "meet_token" and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise ValueError(f"config field {short(name)} must be None, 'eos' or a token id, got {short(value)}")
        elif key == "pairs" and value is not None:
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"config field {short(name)} must be None or a fraction, got {short(value)}")
            fraction = _as_float(name, value)
            if is_int(value) and value != 1:  # belief_state_loss reads an int as pairs per row: not here
                raise ValueError(f"config field {short(name)} must be None or a fraction in (0, 1] of each row's "
                                 f"pairs, got {short(value)} (a count of pairs per row is belief_state_loss's "
                                 "pairs=k, not the config's)")
            value = fraction
        kwargs[key] = value
    return cls(**kwargs)


def apply_overrides(cfg: TrainConfig, overrides: Mapping[str, Any]) -> TrainConfig:
    """A new TrainConfig: `cfg` with `overrides` applied, in order; `cfg` is left as it was.

    Keys are field names. A nested config's fields are given as a mapping, which changes only the
    fields it names (`{"model": {"n_layer": 6}}`), as dotted keys (`{"model.n_layer": 6}`, the
    form `--set` takes), or as a whole `ModelConfig`. Values are checked as `from_dict` checks them;
    an unknown field raises a ValueError naming it and listing the known fields."""
    d = cfg.to_dict()
    for key, value in overrides.items():
        if not isinstance(key, str) or not key or "" in key.split("."):
            raise ValueError(f"config field {short(key)} is not a field name (name, or parent.name for a nested field)")
        *parents, leaf = key.split(".")
        node, cls, path = d, TrainConfig, ""
        for p in parents:
            known = {f.name: f for f in fields(cls)}
            if p not in known:
                raise _unknown_field(key, path + p, known)
            sub = field_default(known[p])
            if not dataclasses.is_dataclass(sub):
                raise ValueError(f"config field {short(key)} is unknown: {path + p!r} is a field of type "
                                 f"{type(sub).__name__}, not a config with fields")
            if isinstance(node[p], type(sub)):  # a whole ModelConfig given before: its fields, to change one
                node[p] = dataclasses.asdict(node[p])
            if not isinstance(node[p], Mapping):  # `model: null` then `model.n_layer: 2`
                raise ValueError(f"config field {short(path + p)} must be a mapping, got {short(node[p])}")
            node, cls, path = node[p], type(sub), path + p + "."
        known = {f.name: f for f in fields(cls)}
        if leaf not in known:
            raise _unknown_field(key, path + leaf, known)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(field_default(known[leaf])):
            node[leaf] = {**node[leaf], **value}  # a partial mapping changes only the fields it names
        else:
            node[leaf] = value
    return _from_dict(TrainConfig, d, "")


# Fields a resumed run may change: they do not touch the parameters' trajectory (steps does, through
# the schedule's length, but extending a run is a deliberate choice).
# Not n_test: the star-graph test set, and so what training excludes, depends on it.
RESUMABLE_CHANGES = ("steps", "eval_every", "eval_batches", "ckpt_every", "keep_checkpoints", "keep_best", "log_every",
                     "progress", "device", "compile", "out_dir", "backend", "model.activation_checkpointing",
                     "ddp_timeout",
                     # the same batch in other micro-batches (a resume that runs out of memory): the same
                     # numbers up to rounding, or with pairs < 1 or dropout another draw, as another number of ranks is
                     "grad_accum")
# Of those, the ones that leave even the numbers of the trajectory as they were (evaluation draws no
# randomness: every step's seeds are functions of (seed, step)): a resumed run retraces its steps.
SAME_TRAJECTORY_CHANGES = ("eval_every", "ckpt_every", "keep_checkpoints", "keep_best", "log_every", "progress",
                           "out_dir", "model.activation_checkpointing", "ddp_timeout")  # its numbers are the same (eager mode)
# Of those, the ones that change what an evaluation scores: a figure made under other values (a best
# checkpoint's) is not comparable, whatever the trajectory.
EVALUATION_CHANGES = ("eval_batches",)


def config_changes(then: dict, now: dict, allowed=()) -> dict:
    """The fields in which two TrainConfig dicts differ, but for `allowed`: {field: (then, now)}, the
    model's named model.<field> (in `allowed` too). Fields the run never reads (TrainConfig.check refuses them now; older
    versions let a config set them) are no difference: the other kind of data's, and the BST's
    objective (with the GPT head gamma added) for another method."""
    unread = TEXT_FIELDS if now["data"] == "star" else STAR_FIELDS
    unread_model = ()
    if now["method"] != "bst":
        unread, unread_model = unread + BST_FIELDS, ("gpt_head",)
    diff = {k: (then.get(k), v) for k, v in now.items()
            if k not in allowed and k != "model" and k not in unread and then.get(k) != v}
    diff.update({f"model.{k}": (then["model"].get(k), v) for k, v in now["model"].items()
                 if k not in unread_model and f"model.{k}" not in allowed and then["model"].get(k) != v})
    return diff


# A config is a handful of fields: a few aliases are a convenience, thousands are a YAML bomb (nested
# aliases expand exponentially when anything walks the result, e.g. an error message's repr).
MAX_YAML_ALIASES = 100


def load_yaml(text: str):
    """yaml.safe_load, refusing a document with more than MAX_YAML_ALIASES aliases (`*name`) or a key
    written twice in one mapping, with numbers in decimal only (below)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases = getattr(self, "aliases", 0) + 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise ValueError(f"more than {MAX_YAML_ALIASES} aliases (*name): refused, as a YAML bomb would be")
            return super().compose_node(parent, index)

        def compose_mapping_node(self, anchor):
            # a key written twice: safe_load keeps the last silently (`steps: 5000` ... `steps: 50`).
            # Checked as written, before any merge (`<<: *base`, whose keys a mapping may override).
            node = super().compose_mapping_node(anchor)
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise ValueError(f"the key {short(key_node.value)} appears twice in one mapping "
                                         f"(line {key_node.start_mark.line + 1})")
                    seen.add(key)
            return node

    # Scalars as a reader of the file means them, YAML 1.2's core schema: YAML 1.1 reads 010 as octal
    # 8, 0x1f as 31, 1:04 as 64 (base 60) and yes/no/on/off as booleans, silently. Here an integer
    # is decimal (underscores allowed, no leading zero), a float has a dot or an exponent and no
    # base-60 form, and a boolean is true or false; those other spellings stay text, which a
    # numeric or boolean field refuses.
    int_tag, float_tag, bool_tag = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float", "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {first: [(tag, rx) for tag, rx in resolvers
                                              if tag not in (int_tag, float_tag, bool_tag)]
                                      for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    Loader.add_implicit_resolver(int_tag, re.compile(r"^[-+]?(?:0|[1-9][0-9_]*)$"), list("-+0123456789"))
    Loader.add_implicit_resolver(float_tag, re.compile(r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                                                        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
                                                        |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
                                                        |[-+]?\.(?:inf|Inf|INF)
                                                        |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
    Loader.add_constructor(int_tag, lambda loader, node: int(loader.construct_scalar(node).replace("_", ""), 10))
    return yaml.load(text, Loader=Loader)


def load_json(text: str):
    """json.loads, refusing an object that names a key twice (json keeps the last silently)."""
    def unique(pairs):
        d = dict(pairs)
        if len(d) < len(pairs):
            seen = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ValueError(f"the key {short(twice)} appears twice in one object")
        return d
    return json.loads(text, object_pairs_hook=unique)


ConfigLike = Union[TrainConfig, Mapping[str, Any], str, os.PathLike, None]


def resolve_config(config: ConfigLike = None, **overrides: Any) -> TrainConfig:
    """A TrainConfig from what `train` accepts: None (the defaults), a TrainConfig (copied, never
    changed), a mapping of fields (nested mappings or dotted keys for the model's fields) or the
    path of a YAML/JSON config; then keyword overrides as in `apply_overrides`."""
    if config is None:
        cfg = TrainConfig()
    elif isinstance(config, TrainConfig):
        cfg = copy.deepcopy(config)
    elif isinstance(config, Mapping):
        cfg = TrainConfig.from_dict(config)  # a field given twice refused, as in a file
    elif isinstance(config, (str, os.PathLike)):
        cfg = TrainConfig.load(config)
    else:
        raise TypeError(f"config must be a TrainConfig, a dict of fields or the path of a YAML/JSON file, "
                        f"got {type(config).__name__}")
    _given_once(overrides)  # model={...} and model.n_layer=... together (apply_overrides takes them in order)
    return apply_overrides(cfg, overrides) if overrides else cfg




def _is_text_field(key: str) -> bool:
    """Whether the config field `key` (dotted for the model's) holds a string: its --set value is
    the text as written, so data=2024 or out_dir=on name a file, not a number or a bool."""
    cls = TrainConfig
    *parents, leaf = key.split(".")
    for name in parents:
        f = {f.name: f for f in fields(cls)}.get(name)
        if f is None or not dataclasses.is_dataclass(field_default(f)):
            return False
        cls = type(field_default(f))
    f = {f.name: f for f in fields(cls)}.get(leaf)
    return f is not None and isinstance(field_default(f), str)


def apply_sets(cfg: TrainConfig, sets: Iterable[str]) -> TrainConfig:
    """`cfg` with `--set key=value` overrides, values parsed as YAML (so 6, 3e-4, true, null, [1, 2]
    work), except that a string field takes the text as written ('#', '~' and 'null' included;
    quotes are removed, and a double-quoted value's YAML escapes such as \t read) and an integer is
    decimal (010 is 10); then the rules of `apply_overrides`.
    A field named twice takes the last value."""
    import yaml

    overrides = []
    for item in sets:
        if "=" not in item:
            raise ValueError(f"--set takes key=value, got {short(item)}")
        key, value = item.split("=", 1)
        key, text = key.strip(), value.strip()
        quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
        if _is_text_field(key) and not quoted:
            parsed = text  # as written: YAML would cut "runs/exp #2" at the '#', or read '~' as null
        elif re.fullmatch(r"[+-]?[0-9]+", text):
            try:
                parsed = int(text, 10)  # decimal: YAML 1.1 reads 010 as octal 8
            except ValueError:  # over Python's 4300 digits: its message named neither --set nor the field
                raise ValueError(f"--set {short(key)}: the number {short(text)} has too many digits") from None
        elif text in ("none", "None"):
            parsed = None  # Python's spelling, as the fields' comments write it (YAML's is null or ~)
        else:
            try:
                parsed = load_yaml(value)
            except RecursionError:  # nested past the parser's depth: bad input, as a nested config file is
                raise ValueError(f"--set {short(key)}: the value is nested too deeply") from None
            except (yaml.YAMLError, ValueError) as e:
                raise ValueError(f"--set {short(key)}: {short(value)} is not a YAML value ({short(str(e))})") from None
        overrides.append((key, parsed))
    cfg = apply_overrides(cfg, {})  # a copy even without overrides
    for key, value in overrides:  # one at a time: --set may name a field twice, the last one wins
        cfg = apply_overrides(cfg, {key: value})
    return cfg
