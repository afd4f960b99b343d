"""bst_fast.trainer: AdamW + warmup/cosine training of a BST (or a baseline) with exact resume and DDP.

Methods (TrainConfig.method): "bst"; the star-graph baselines of the paper's figure: "forward"
(next-token), "augment" (goal replaced by an intermediate node), "fim" (Fill-in-the-Middle: a path
suffix placed before the answer) and "teacherless" (multi-token prediction). The BST ablations are
"bst" with next_weight=1 ("w/o Prev") and with model.backward_encoder=false ("w/o backward").

The package exports `train` as `bst_fast.train`; this module is named `trainer` so that the name
`bst_fast.train` is that function, never a submodule.
"""
from __future__ import annotations

import atexit
import copy
import csv
import dataclasses
import difflib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ._pairs import pair_counts
from .model import BeliefStateTransformer, ForwardOnly, ModelConfig, Teacherless

METHODS = ("bst", "forward", "augment", "fim", "teacherless")
STAR_ONLY = ("augment", "fim", "teacherless")  # their data transforms are defined on star graphs


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
    method: str = "bst"  # one of METHODS (see the module docstring)
    data: str = "star"  # "star" for star graphs, else a text file or folder
    star_degree: int = 2  # d of G(d, l): arms from the start node
    star_path_len: int = 5  # l of G(d, l): nodes on the path, start and goal included
    star_nodes: int = 50  # N: node labels to draw from
    n_train: int = 0  # fixed set of training graphs; 0 streams fresh graphs every step
    n_test: int = 500  # held-out graphs for path accuracy (never trained on)
    augment_prob: float = 0.5  # method "augment": share of training rows whose goal becomes an intermediate node
    text_vocab: int = 1000  # BPE vocabulary for text data (the paper: 1000)
    max_len: int = 256  # text documents are cut to at most this many tokens
    model: ModelConfig = field(default_factory=ModelConfig)  # vocab_size / max_len are set from the data
    # --- objective ---
    pairs: Optional[float] = None  # None: all prefix/suffix pairs; a fraction in (0, 1]: subsample
    next_weight: float = 0.5  # lambda: Next vs Prev weight of the belief loss
    gamma: float = 0.0  # weight of the plain next-token head on f (adds that head when > 0)
    backend: str = "auto"  # belief_state_loss backend
    # --- optimisation ---
    steps: int = 2000  # optimizer steps
    batch_size: int = 64  # global batch (split over DDP ranks)
    lr: float = 3e-4  # peak learning rate
    min_lr: float = 3e-5  # end of the cosine decay
    warmup: int = 100  # linear warmup steps
    weight_decay: float = 0.1  # AdamW, on matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global gradient norm; 0 disables
    # --- runtime ---
    device: str = "auto"  # "auto", "cpu" or "cuda"
    compile: bool = False  # torch.compile the encoders
    seed: int = 0  # data order, pair samples and dropout are all functions of (seed, step)
    out_dir: str = "runs/star"  # checkpoints, metrics.csv, tensorboard
    eval_every: int = 250  # steps between evaluations (and at the end)
    ckpt_every: int = 500  # steps between checkpoints (and at the end); 0: only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept
    log_every: int = 10  # steps between progress-bar / CSV updates
    progress: bool = True  # tqdm progress bar

    # ---- loading ----
    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        return _from_dict(cls, d, "")

    @classmethod
    def load(cls, path: Union[str, Path]) -> "TrainConfig":
        """A config from a .yaml/.yml or .json file. A path that does not exist but names a
        config shipped with bst_fast (`configs/star_cpu.yaml`, `star_cpu.yaml` or `star_cpu`)
        loads the shipped one, so the README's paths work outside a clone of the repository."""
        path = config_path(path)
        text = path.read_text()
        try:
            if str(path).endswith((".yaml", ".yml")):
                import yaml

                d = yaml.safe_load(text) or {}
            else:
                d = json.loads(text)
        except Exception as e:  # yaml's and json's parse errors alike
            raise ValueError(f"config {path} is not valid {'YAML' if str(path).endswith(('.yaml', '.yml')) else 'JSON'}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"config {path} must hold a mapping of fields, got {type(d).__name__}")
        return cls.from_dict(d)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def check(self):
        def bad(name, want):
            raise ValueError(f"config field {name!r} must be {want}, got {getattr(self, name)!r}")

        if not isinstance(self.model, ModelConfig):
            bad("model", "a ModelConfig (a mapping of its fields goes through TrainConfig.from_dict)")
        TrainConfig.from_dict(self.to_dict())  # every field's type, as a config file's are checked
        if self.method not in METHODS:
            bad("method", f"one of {METHODS}")
        if self.method in STAR_ONLY and self.data != "star":
            bad("method", f"'bst' or 'forward' for text data ({STAR_ONLY} are star-graph baselines)")
        if self.method == "augment" and self.star_path_len < 3:
            bad("method", "not 'augment' when star_path_len < 3 (no intermediate node to ask for)")
        if not 0.0 <= self.augment_prob <= 1.0:
            bad("augment_prob", "in [0, 1]")
        for name in ("steps", "batch_size", "star_degree", "star_nodes", "n_test", "text_vocab", "log_every"):
            if getattr(self, name) < 1:
                bad(name, ">= 1")
        if self.data != "star" and self.text_vocab < 259:
            bad("text_vocab", ">= 259 for text data (256 byte tokens and PAD, BOS, EOS)")
        if self.star_path_len < 2:
            bad("star_path_len", ">= 2")
        if self.max_len < 4:
            bad("max_len", ">= 4")
        for name in ("n_train", "warmup", "eval_every", "ckpt_every", "keep_checkpoints", "grad_clip", "weight_decay"):
            if getattr(self, name) < 0:
                bad(name, ">= 0")
        if self.pairs is not None and not 0.0 < self.pairs <= 1.0:
            bad("pairs", "None or a fraction in (0, 1]")
        if not 0.0 <= self.next_weight <= 1.0:
            bad("next_weight", "in [0, 1]")
        if not 0.0 <= self.gamma <= 1.0:
            bad("gamma", "in [0, 1]")
        for name in ("lr", "grad_clip", "weight_decay"):  # the other floats' ranges refuse nan and inf
            if not math.isfinite(getattr(self, name)):
                bad(name, "a finite number")
        if not self.lr > 0:
            bad("lr", "> 0")
        if not 0 <= self.min_lr <= self.lr:
            bad("min_lr", f"in [0, lr={self.lr}]")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                bad(name, "in [0, 1)")
        if self.seed < 0:
            bad("seed", ">= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            bad("device", "'auto', 'cpu' or 'cuda'")
        from .loss import BACKENDS

        if self.backend not in BACKENDS:
            bad("backend", f"one of {BACKENDS}")
        self.model.check()
        return self


def _unknown_field(key: str, bad: str, known) -> ValueError:
    """The error for an unknown config field: it names the key as given, the closest known field
    and every known field at that level."""
    *parents, leaf = bad.split(".")
    prefix = "".join(p + "." for p in parents)
    close = difflib.get_close_matches(leaf, list(known), n=1)
    hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
    where = f" of {prefix[:-1]!r}" if prefix else ""
    what = "" if key == bad else f": {bad!r} is not a field"
    return ValueError(f"config field {key!r} is unknown{what}{hint}; known fields{where}: {sorted(known)}")


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _from_dict(cls, d, prefix):
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in d.items():
        name = prefix + str(key)
        if key not in known:
            raise _unknown_field(name, name, known)
        default = _default(known[key])
        if dataclasses.is_dataclass(default):
            if isinstance(value, type(default)):
                value = dataclasses.asdict(value)  # checked like a mapping, and copied
            if not isinstance(value, Mapping):
                raise ValueError(f"config field {name!r} must be a mapping, got {value!r}")
            value = _from_dict(type(default), value, name + ".")
        elif default is not None:
            want = type(default)
            if value is None:  # only a field whose default is None takes null
                raise ValueError(f"config field {name!r} must be {want.__name__}, got None")
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if want is float and isinstance(value, str):
                # YAML 1.1 reads 3e-4 (no dot) as a string: a number written as text is the number
                try:
                    value = float(value)
                except ValueError:
                    pass
            if want is str and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = str(value)  # data: 2024 names a file or folder called 2024
            ok = isinstance(value, want) and not (want is not bool and isinstance(value, bool))
            if key == "head_hidden" and isinstance(value, list):
                ok = all(isinstance(v, int) for v in value)
            if not ok:
                raise ValueError(f"config field {name!r} must be {want.__name__}, got {value!r}")
        elif key == "pairs" and value is not None:
            if isinstance(value, str):  # 5e-1 (YAML 1.1 text), as for the float fields above
                try:
                    value = float(value)
                except ValueError:
                    pass
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"config field {name!r} must be None or a fraction, got {value!r}")
            value = float(value)
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
            raise ValueError(f"config field {key!r} is not a field name (name, or parent.name for a nested field)")
        *parents, leaf = key.split(".")
        node, cls, path = d, TrainConfig, ""
        for p in parents:
            known = {f.name: f for f in fields(cls)}
            if p not in known:
                raise _unknown_field(key, path + p, known)
            sub = _default(known[p])
            if not dataclasses.is_dataclass(sub):
                raise ValueError(f"config field {key!r} is unknown: {path + p!r} is a field of type "
                                 f"{type(sub).__name__}, not a config with fields")
            node, cls, path = node[p], type(sub), path + p + "."
        known = {f.name: f for f in fields(cls)}
        if leaf not in known:
            raise _unknown_field(key, path + leaf, known)
        if isinstance(value, Mapping) and dataclasses.is_dataclass(_default(known[leaf])):
            node[leaf] = {**node[leaf], **value}  # a partial mapping changes only the fields it names
        else:
            node[leaf] = value
    return TrainConfig.from_dict(d)


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
        cfg = apply_overrides(TrainConfig(), config)
    elif isinstance(config, (str, os.PathLike)):
        cfg = TrainConfig.load(config)
    else:
        raise TypeError(f"config must be a TrainConfig, a dict of fields or the path of a YAML/JSON file, "
                        f"got {type(config).__name__}")
    return apply_overrides(cfg, overrides) if overrides else cfg


# ---------------------------------------------------------------- data

class _StarTask:
    """Star-graph batches and path-accuracy evaluation (docs/contract.md §7)."""

    def __init__(self, cfg: TrainConfig):
        from .data import StarGraphData, StarGraphStream, StarGraphTokenizer

        self.tok = StarGraphTokenizer(cfg.star_nodes)
        self.data = StarGraphData(cfg.star_degree, cfg.star_path_len, cfg.star_nodes,
                                  n_train=cfg.n_train, n_test=cfg.n_test, seed=cfg.seed)
        self.stream = None if cfg.n_train else StarGraphStream(
            cfg.star_degree, cfg.star_path_len, cfg.star_nodes, seed=cfg.seed, exclude=self.data)
        self.vocab_size, self.max_len = self.tok.vocab_size, self.data.row_length
        self.prefix_start = self.data.prefix_start
        self.seed, self.method, self.augment_prob = cfg.seed, cfg.method, cfg.augment_prob
        l = self.data.path_len
        if self.method == "fim":  # rows grow by "|" and a suffix of at most l - 1 path nodes
            self.max_len += l
        # Test prompts: FIM is given the shortest suffix, the goal alone ([... / s g | g =]).
        self.test_rows, self.test_start = self.data.test_tokens, self.prefix_start
        if self.method == "fim":
            self.test_rows, _, starts = self.fim_rows(self.data.test_tokens, torch.full((len(self.test_rows),), l))
            self.test_start = int(starts[0])

    def save(self, out_dir: Path):
        """Nothing of star-graph data is written to a run (its graphs are functions of the seed)."""

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
    def evaluate(self, model, device):
        from .data import path_accuracy

        was = model.training
        model.eval()
        eos = self.tok.eos_id

        def generate(prefix, n_new):
            return model.generate(prefix.to(device), n_new, eos_id=eos).cpu()

        acc = path_accuracy(generate, self.test_rows, self.test_start, self.data.path_len)
        model.train(was)
        return {"path_accuracy": float(acc[0] if isinstance(acc, tuple) else acc)}


def _batch_totals(lengths, start_pos, L):
    """(pairs, next-token targets) of rows of `lengths` (at most L): the counts the losses are
    normalised by."""
    pairs = pair_counts(lengths, start_pos, 2, L, L).sum().item()
    return pairs, ((lengths - 1 - start_pos).clamp(min=0)).sum().item()


class _TextTask:
    """BPE-tokenised text batches and held-out loss."""

    def __init__(self, cfg: TrainConfig, resume: bool):
        from .data import TextData, load_tokenizer, train_bpe

        # A resumed run reads the tokenizer its checkpoints were trained with; a new one trains its
        # own, written by save() once the run is known to start (a failed start leaves no file).
        path = Path(cfg.out_dir) / "tokenizer.json"
        if resume and not path.exists():
            raise ValueError(f"--resume: {path} is missing (the run's tokenizer, which its checkpoints need)")
        self.tokenizer = load_tokenizer(path) if resume else train_bpe(cfg.data, vocab_size=cfg.text_vocab)
        self.data = TextData(cfg.data, self.tokenizer, cfg.max_len, seed=cfg.seed)
        self.vocab_size, self.max_len, self.prefix_start = self.tokenizer.get_vocab_size(), cfg.max_len, 0
        self.seed, self.cfg = cfg.seed, cfg
        # The config holds the corpus's path only: a resumed run must also find the same corpus
        # there, or its split (and so every batch and the held-out loss) would silently change.
        saved = Path(cfg.out_dir) / "data.json"
        if resume and saved.exists():
            then, now = json.loads(saved.read_text()), self.data.fingerprint()
            if then != now:
                raise ValueError(f"--resume: the corpus at {cfg.data} is not the one this run was trained on "
                                 f"(then {then}, now {now})")

    def save(self, out_dir: Path):
        from .data import save_tokenizer

        path = out_dir / "tokenizer.json"
        if not path.exists():
            _atomic_write(path, lambda p: save_tokenizer(self.tokenizer, p))
        path = out_dir / "data.json"
        if not path.exists():
            _atomic_write(path, lambda p: Path(p).write_text(json.dumps(self.data.fingerprint(), indent=1)))

    def batch(self, step, batch_size):
        return (*self.data.batch(step, batch_size, self.seed), None)

    @torch.no_grad()
    def evaluate(self, model, device):
        held = self.data.held_out_lengths
        if not len(held):  # no held-out rows (one document of one row, or held_out 0): no figure
            return {}
        # Every batch is normalised by the whole held-out set's pair and token counts, so the
        # figure is the mean over all held-out pairs (and tokens), whatever the batch size.
        pair_total, token_total = _batch_totals(held, torch.zeros_like(held), int(held.max()))
        was = model.training
        model.eval()
        loss = 0.0
        for k, (tokens, lengths) in enumerate(self.data.held_out_batches(self.cfg.batch_size)):
            out = model(tokens.to(device), lengths.to(device), next_weight=self.cfg.next_weight,
                        gamma=self.cfg.gamma, pairs=self.cfg.pairs, backend=self.cfg.backend,
                        generator=torch.Generator().manual_seed(k), pair_total=pair_total,
                        token_total=token_total)
            loss += float(out["total"])
        model.train(was)
        return {"held_out_loss": loss}


# ---------------------------------------------------------------- checkpoints

def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write):
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    _fsync(tmp)
    os.replace(tmp, path)


def _unshared(state):
    """The state dict on the CPU with a copy of every tensor whose storage an earlier one already
    holds (a tied head and embedding): safetensors refuses tensors that share memory."""
    out, seen = {}, set()
    for k, v in state.items():
        v = v.detach().contiguous().cpu()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def save_checkpoint(out_dir, step, model, optimizer, scheduler, cfg: TrainConfig, keep: int, log=None):
    """out_dir/checkpoints/step-N/{model.safetensors, state.pt, config.json}, then `latest` names it.
    `log`: the logging interval still open at `step` (each rank's loss sum and the steps in it), when
    the run stops between two logged steps.

    The folder is written under a temporary name and renamed, and `latest` is replaced atomically,
    so a kill at any moment leaves the previous checkpoint as the latest complete one."""
    from safetensors.torch import save_file

    root = Path(out_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f".step-{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_unshared(model.state_dict()), str(tmp / "model.safetensors"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(), "log": log}, tmp / "state.pt")
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    for path in (*tmp.iterdir(), tmp):  # on disk before the rename makes them the checkpoint
        _fsync(path)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(root / "latest", lambda p: p.write_text(final.name))
    for old in sorted(root.glob("step-*"))[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out_dir) -> Optional[Path]:
    latest = Path(out_dir) / "checkpoints" / "latest"
    if not latest.exists():
        return None
    path = latest.parent / latest.read_text().strip()
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} named by {latest} is missing")
    return path


def load_checkpoint(path, model, optimizer=None, scheduler=None):
    """Loads weights (and optimizer, scheduler, RNG); a corrupt or mismatched checkpoint raises
    ValueError. Returns the training state: {"step": N, "log": the open logging interval or None}
    ({"step": 0} without an optimizer)."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        weights = load_file(str(path / "model.safetensors"))
    except Exception as e:  # safetensors raises several types for a damaged file
        raise ValueError(f"checkpoint {path} is corrupt or unreadable: {e}") from e
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [k for k in own if k in weights and own[k].shape != weights[k].shape]
    if missing or extra or shapes:
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}, shape mismatch {[(k, tuple(weights[k].shape), tuple(own[k].shape)) for k in shapes[:5]]}")
    # Names of one tied tensor (the SwiGLU head's lm_head and the token embedding) must be saved
    # equal: loading writes them all into one Parameter, and the last one would silently win.
    tied = {}
    for k, v in own.items():
        if v.numel():
            tied.setdefault((v.untyped_storage().data_ptr(), v.storage_offset(), v.shape), []).append(k)
    for names in tied.values():
        if any(not torch.equal(weights[names[0]], weights[k]) for k in names[1:]):
            raise ValueError(f"checkpoint {path} holds different values for {names}, which this model ties into "
                             f"one tensor: it was not trained with the tie (model.head_tie_embedding)")
    model.load_state_dict(weights)
    state = {"step": 0}
    if optimizer is not None:
        try:
            state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            torch.set_rng_state(state["rng"])
        except Exception as e:
            raise ValueError(f"checkpoint {path} has a corrupt or mismatched state.pt: {e}") from e
    return state


def load_model(path, device="cpu"):
    """(model, TrainConfig) from a checkpoint folder (or a run folder, taking its latest checkpoint)."""
    path = Path(path)
    if not (path / "config.json").exists():
        found = latest_checkpoint(path)
        if found is None:
            raise ValueError(f"{path} is neither a checkpoint folder nor a run folder with checkpoints")
        path = found
    cfg = TrainConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = build_model(cfg).to(device)
    load_checkpoint(path, model)
    return model, cfg


# ---------------------------------------------------------------- training

def build_task(cfg: TrainConfig, resume: bool = False):
    task = _StarTask(cfg) if cfg.data == "star" else _TextTask(cfg, resume)
    # teacherless: one extra id, the dummy answer token
    cfg.model.vocab_size = task.vocab_size + (cfg.method == "teacherless")
    cfg.model.max_len = task.max_len
    cfg.model.gpt_head = cfg.gamma > 0
    return task


def build_model(cfg: TrainConfig):
    if cfg.method == "bst":
        return BeliefStateTransformer(cfg.model)
    return Teacherless(cfg.model) if cfg.method == "teacherless" else ForwardOnly(cfg.model)


def _lr_lambda(cfg: TrainConfig):
    """The lr factor of 0-based step `step`: a linear warmup that reaches lr at its last step
    (peak = warmup - 1, or step 0 without warmup), then a cosine that reaches min_lr at the run's
    last step, steps - 1. Each step's lr is used once, peak and min_lr included."""
    peak = max(cfg.warmup - 1, 0)

    def f(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - peak) / max(1, cfg.steps - 1 - peak)
        return (cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(t, 1.0)))) / cfg.lr
    return f


def _optimizer(model, cfg):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


class _Metrics:
    def __init__(self, out_dir, enabled):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.csv"
        self.tb = None
        if enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except Exception:  # tensorboard is optional
                self.tb = None

    def truncate(self, step):
        """Drop the rows after `step`."""
        if self.enabled and self.path.exists():
            with self.path.open(newline="") as fh:
                rows = list(csv.reader(fh))
            keep = [rows[0]] + [r for r in rows[1:] if int(r[0]) <= step]
            _atomic_write(self.path, lambda p: p.write_text("".join(",".join(r) + "\n" for r in keep)))

    def log(self, step, row):
        if not self.enabled:
            return
        row = {"step": step, **row}
        new = not self.path.exists()
        with self.path.open("a", newline="") as fh:
            w = csv.writer(fh)
            if new:
                w.writerow(["step", "key", "value"])
            for k, v in row.items():
                if k != "step":
                    w.writerow([step, k, v])
        if self.tb is not None:
            for k, v in row.items():
                if k != "step":
                    self.tb.add_scalar(k, v, step)

    def close(self):
        """Writes TensorBoard's buffered events (its writer thread would otherwise be left to the
        interpreter's exit)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class NothingToTrain(ValueError):
    """A resumed run is already at the step it was asked to reach; `result` holds the figures its
    metrics.csv logged at that step (the run's final ones when it is finished)."""

    def __init__(self, message, result):
        super().__init__(message)
        self.result = result


class TrainingStopped(RuntimeError):
    """A run stopped on a fault (a non-finite loss); the message names the last good checkpoint."""


# Fields a resumed run may change: they do not touch the parameters' trajectory (steps does, through
# the schedule's length, but extending a run is a deliberate choice).
# Not n_test: the star-graph test set, and so what training excludes, depends on it.
RESUMABLE_CHANGES = ("steps", "eval_every", "ckpt_every", "keep_checkpoints", "log_every",
                     "progress", "device", "compile", "out_dir", "backend")


def _check_out_dir(out_dir: Path, resume: bool, overwrite: bool):
    """(the checkpoint to resume from or None, the paths an overwrite will delete). A new run
    refuses a folder holding another run unless told to overwrite it. Nothing is changed here: the
    caller deletes only once the whole config has been checked and the model built."""
    # The nearest existing folder on the way must be a folder: a file there is an error by name.
    existing = next((p for p in (out_dir, *out_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"out_dir {out_dir}: {existing} is a file, not a folder")
    if resume:
        ckpt = latest_checkpoint(out_dir)
        if ckpt is None:
            raise ValueError(f"--resume: no checkpoint under {out_dir / 'checkpoints'}")
        return ckpt, []
    held = [out_dir / n for n in ("checkpoints", "metrics.csv", "tensorboard", "tokenizer.json", "data.json")
            if (out_dir / n).exists()]
    if held and not overwrite:
        raise ValueError(f"out_dir {out_dir} already holds a run ({', '.join(p.name for p in held)}): "
                         f"resume it (--resume), start over in it (--overwrite) or choose another out_dir")
    return None, held


def _check_resumable(ckpt: Path, cfg: TrainConfig):
    """The checkpoint's config must equal cfg (after build_task filled the model's data fields) in
    every field a resumed run may not change."""
    try:
        saved = json.loads((ckpt / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {ckpt} has a corrupt or unreadable config.json: {e}") from None
    now = cfg.to_dict()
    diff = {k: (saved.get(k), v) for k, v in now.items()
            if k not in RESUMABLE_CHANGES and k != "model" and saved.get(k) != v}
    diff.update({f"model.{k}": (saved.get("model", {}).get(k), v) for k, v in now["model"].items()
                 if saved.get("model", {}).get(k) != v})
    if diff:
        raise ValueError(f"checkpoint {ckpt} was trained with another config; (checkpoint, now) per field: {diff}")


def train(config: ConfigLike = None, resume: bool = False, stop_at: Optional[int] = None,
          overwrite: bool = False, **overrides: Any) -> Dict[str, float]:
    """Trains a model; returns the last evaluation's metrics plus the training rates (`loss`, `lr`,
    `tokens_per_s`, `pairs_per_s`, `steps_per_s`, and `path_accuracy` on star graphs or
    `held_out_loss` on text).

    `config` is a TrainConfig, a dict of its fields or the path of a YAML/JSON config (None: the
    defaults, a G(2,5) star-graph BST). Keyword overrides use the config's field names; the model's
    fields are given as `model={...}` (only the named fields change) or as dotted keys,
    `**{"model.n_layer": 6}`. An unknown field raises a ValueError naming it and the known ones.
    The config passed in is never changed.

        bst_fast.train("configs/star_cpu.yaml", steps=500, out_dir="runs/mine", model={"n_layer": 2})

    resume continues from the latest checkpoint in out_dir. stop_at ends this call after that step
    with a checkpoint, as a pre-empted job would; a later call with resume=True continues to exactly
    the parameters of an uninterrupted run. overwrite starts over in an out_dir that holds another
    run (otherwise that is an error).

    Under torchrun (WORLD_SIZE > 1) it runs DDP (NCCL on GPU, gloo on CPU); every rank draws the
    same global batch and takes its share of rows, and each rank's loss is divided by the global
    pair and token counts, so the averaged gradient equals that of one process on the whole batch.
    """
    cfg = resolve_config(config, **overrides).check()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
        # Kept for later calls in this process (a group started anew under torchrun could hang in
        # its rendezvous) and ended at exit: left to the interpreter's teardown, gloo aborted
        # ("terminate called without an active exception") in about one run in fifteen. A review
        # still saw that abort, after the final checkpoint, in 6 of 66 2-rank CPU runs on a loaded
        # machine; 40 runs here, unloaded, gave none.
        atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)
    rank = dist.get_rank() if world > 1 else 0
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("config field 'device' is 'cuda', but this torch sees no CUDA device "
                             f"(torch {torch.__version__}); use 'auto' or 'cpu'")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if cfg.batch_size % world:
        raise ValueError(f"config field 'batch_size' ({cfg.batch_size}) must divide by the number of ranks ({world})")

    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise ValueError(f"stop_at must be None or a step >= 1, got {stop_at!r}")

    out_dir = Path(cfg.out_dir)
    ckpt, held = _check_out_dir(out_dir, resume, overwrite)
    torch.manual_seed(cfg.seed)
    task = build_task(cfg, resume)
    if ckpt is not None:
        _check_resumable(ckpt, cfg)
    model = build_model(cfg)
    task.batch(0, cfg.batch_size)  # the data's own checks (enough rows for a batch); batches are pure in the step
    # Every check has passed (config, data, model): only now is an overwritten run deleted.
    if rank == 0:
        for path in held:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        out_dir.mkdir(parents=True, exist_ok=True)
        task.save(out_dir)
    if world > 1:
        dist.barrier()
    model = model.to(device)
    if cfg.compile:
        # Module.compile() compiles in place: parameter names, and so checkpoints, stay the same.
        model.forward_encoder.compile()
        if getattr(model, "backward_encoder", None) is not None:
            model.backward_encoder.compile()
    optimizer = _optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(cfg))
    state = {"step": 0} if ckpt is None else load_checkpoint(ckpt, model, optimizer, scheduler)
    start, open_log = state["step"], state.get("log")
    # The saved lr is the old schedule's; a resume that changed steps continues on the new one
    # (unchanged steps: the same product, so the same value as saved).
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(start)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    if start >= end:
        logged = {}
        if (out_dir / "metrics.csv").exists():
            with (out_dir / "metrics.csv").open(newline="") as fh:
                logged = {k: float(v) for step, k, v in list(csv.reader(fh))[1:] if int(step) == start}
        raise NothingToTrain(f"nothing to train: the checkpoint {ckpt} is at step {start}, and this call stops at "
                         f"{'steps' if stop_at is None or stop_at >= cfg.steps else 'stop_at'} = {end}; "
                         f"raise steps (a resumable change) to continue the run", logged)
    ddp = DistributedDataParallel(model) if world > 1 else model
    metrics = _Metrics(out_dir, rank == 0)
    metrics.truncate(start)  # rows logged after the checkpoint we resume from are replayed
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    bar = None
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.method}", dynamic_ncols=True)
    result: Dict[str, float] = {}
    last_good = latest_checkpoint(out_dir) if rank == 0 else None
    # The mean loss of a logging interval: its sum and steps (an interval a stop_at left open comes
    # back from the checkpoint, so the row that closes it is the uninterrupted run's); the rates.
    loss_sum, n_sum = torch.zeros((), device=device), 0
    if open_log:
        sums, n_sum = open_log["loss_sum"], open_log["n"]  # one per rank
        if len(sums) == world:
            loss_sum.fill_(sums[rank])
        elif rank == 0:  # another number of ranks: rank 0 carries a total that averages the same
            loss_sum.fill_(sum(sums) * world / len(sums))
    t0, tokens_seen, pairs_seen, n_timed = time.perf_counter(), 0, 0, 0
    for step in range(start, end):
        # Every random choice is a function of (seed, step, rank): resuming at any step is exact.
        torch.manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
        tokens, lengths, row_start = task.batch(step, cfg.batch_size)  # the global batch, (B, L)
        start_pos = torch.full_like(lengths, task.prefix_start) if row_start is None else row_start
        pair_total, token_total = (n / world for n in _batch_totals(lengths, start_pos, tokens.shape[1]))
        tokens, lengths = tokens[rank::world].to(device), lengths[rank::world].to(device)
        # A per-row start only where rows differ (FIM); the int keeps the other methods' kernels as they were.
        prefix_start = task.prefix_start if row_start is None else row_start[rank::world].to(device)
        with autocast:
            out = ddp(tokens, lengths, prefix_start=prefix_start, pairs=cfg.pairs,
                      next_weight=cfg.next_weight, gamma=cfg.gamma, backend=cfg.backend,
                      generator=torch.Generator().manual_seed(cfg.seed * 7919 + step * 31 + rank),
                      pair_total=pair_total, token_total=token_total)
        loss = out["total"]
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]  # this step's, logged (the scheduler then moves on)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        loss_sum += loss.detach().float()
        n_sum += 1
        n_timed += 1
        tokens_seen += int(tokens.numel())
        pairs_seen += pair_total * (cfg.pairs or 1.0) if cfg.method == "bst" else 0
        done = step + 1
        eval_now = (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps
        ckpt_now = (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps
        logged = done % cfg.log_every == 0 or eval_now or ckpt_now  # a function of the step alone
        # stop_at between logged steps: no row (an uninterrupted run has none there); the call
        # returns the open interval's figures and its checkpoint keeps them for the resumed call
        stopping = done == end and not logged
        if logged or stopping:
            mean_loss = float(loss_sum) / n_sum  # the one host sync of a logging interval
            if world > 1:
                t = torch.tensor([mean_loss], device=device)
                dist.all_reduce(t)
                mean_loss = float(t) / world
            if not math.isfinite(mean_loss):
                if bar is not None:
                    bar.close()
                metrics.close()
                raise TrainingStopped(f"training stopped: the loss became non-finite ({mean_loss}) by step {done}; "
                                   f"the last good checkpoint is {last_good or 'none (no checkpoint was written yet)'}")
            dt = time.perf_counter() - t0
            row = {"loss": mean_loss, "lr": lr, "tokens_per_s": tokens_seen * world / dt,
                   "pairs_per_s": pairs_seen * world / dt, "steps_per_s": n_timed / dt}
            result.update(row)
            if eval_now and rank == 0:
                row.update(task.evaluate(model, device))
                result.update(row)
            if bar is not None:
                bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k != "lr"}, refresh=False)
                bar.update(n_timed)
            t0, tokens_seen, pairs_seen, n_timed = time.perf_counter(), 0, 0, 0
            if logged:
                metrics.log(done, row)
                n_sum = 0
                loss_sum.zero_()
        if ckpt_now or done == end:
            open_log = None
            if stopping:  # every rank's share of the open interval's loss
                sums = [loss_sum.clone() for _ in range(world)]
                if world > 1:
                    dist.all_gather(sums, loss_sum)
                open_log = {"loss_sum": [float(s) for s in sums], "n": n_sum}
            if rank == 0:
                last_good = save_checkpoint(out_dir, done, model, optimizer, scheduler, cfg, cfg.keep_checkpoints,
                                            log=open_log)
    if bar is not None:
        bar.close()
    metrics.close()
    if world > 1:
        dist.barrier()
    return result
