"""bst_fast.experiments: the paper's star-graph experiments, each a series of runs of one config.

`star`: the BST against the forward-only baseline (the README's main command); `table`: every
baseline and BST ablation of the paper's star-graph figure. Each run has its own folder under the
config's out_dir; `resume` continues an interrupted series (a finished run is reported, a run not
started yet is started).

Each run's data sets its model's vocabulary and row length (tasks.model_config), and the methods'
differ (teacherless adds a token, fim lengthens the row): a series takes model.vocab_size and
model.max_len from its runs' data, whatever the base config holds (a saved run's config, say).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Optional

from . import trainer
from .checkpoint import latest_checkpoint
from .config import BST_FIELDS, TrainConfig, apply_sets


def is_rank0() -> bool:
    """Whether this process prints and writes a series' output: the only one, or rank 0 of torchrun's."""
    return os.environ.get("RANK", "0") == "0"


def _say(*lines):
    if is_rank0():
        print(*lines, sep="\n", flush=True)


def _train_run(cfg, resume):
    """One run of star or table. Without --resume it starts over; with it, a run continues from its
    checkpoint, a finished run reports its logged final figures, and a run that had not written a
    checkpoint yet (the job stopped during an earlier run) starts."""
    go_on = resume and latest_checkpoint(cfg.out_dir) is not None
    return trainer.train(cfg, resume=go_on, overwrite=not go_on)


def _series_base(base: TrainConfig, command: str) -> TrainConfig:
    """Path accuracy is a star-graph figure: on text data the table would be a column of nan. Returns
    `base` with the model fields each run's data sets (module docstring), and model.gpt_head, which
    each run's gamma sets, at their defaults."""
    from ._checks import short

    if base.data != "star":
        raise ValueError(f"{command} compares path accuracy on star graphs: config field 'data' must be 'star', "
                         f"got {short(base.data)} (train a text model with the train command)")
    from .tasks import DATA_SET_FIELDS

    fields = type(base.model).__dataclass_fields__
    # gpt_head too: the trainer sets it from gamma, which a baseline's run leaves at 0 (_method_config)
    model = dataclasses.replace(base.model, **{name: fields[name].default for name in (*DATA_SET_FIELDS, "gpt_head")})
    return dataclasses.replace(base, model=model)


def _method_config(base: TrainConfig, method: str) -> TrainConfig:
    """A copy of `base` for one run of a series: its method, and for a method other than the BST the
    objective's fields (config.BST_FIELDS, which only the BST reads and check refuses elsewhere) at
    their defaults, so that a BST setting of the base config reaches the BST runs and the baselines
    still run."""
    cfg = copy.deepcopy(base)
    cfg.method = method
    if method != "bst":
        fields = TrainConfig.__dataclass_fields__
        for name in BST_FIELDS:
            setattr(cfg, name, fields[name].default)
    return cfg


def star(base: TrainConfig, methods=("bst", "forward"), resume: bool = False):
    """Trains the BST and the forward-only baseline on one config (each in out_dir/<method>) and
    prints their path accuracy side by side."""
    base = _series_base(base, "star")
    if base.method != "bst":  # (the command line refuses --set method; a config's was dropped silently)
        raise ValueError(f"config field 'method' is {base.method!r}: star trains each of its methods in turn (choose "
                         f"them with --methods, methods=), so the config must leave it at 'bst' (a config a "
                         f"forward-only run saved: set its method to bst in the file, or leave the field out)")
    if len(set(methods)) != len(methods):  # a repeat would train into, and report, the same folder twice
        raise ValueError(f"methods (star --methods) must not repeat a method, got {list(methods)}")
    configs = []  # every method's config is checked before the first one trains (or prints)
    for method in methods:
        cfg = _method_config(base, method)
        cfg.out_dir = str(Path(base.out_dir) / method)
        configs.append(cfg.check())
    rows = []
    for cfg in configs:
        _say(f"== {cfg.method}: G({cfg.star_degree},{cfg.star_path_len}), N={cfg.star_nodes}, "
             f"{cfg.model.n_layer} layers x {cfg.model.d_model}, {cfg.steps} steps of {cfg.batch_size}")
        result = _train_run(cfg, resume)  # a reproduction reruns, unless resumed
        rows.append((cfg.method, result))
    _say("\n| method | path accuracy | final loss | steps/s |", "| --- | --- | --- | --- |",
         *(f"| {method} | {r.get('path_accuracy', float('nan')):.3f} | {r.get('loss', float('nan')):.4f} | "
           f"{r.get('steps_per_s', float('nan')):.2f} |" for method, r in rows),
         f"\n(a forward-only model that learned only the 'flawed cheat' scores about 1/d = {1 / base.star_degree:.3f})")


# The paper's star-graph figure: its four baselines, the BST and the two BST ablations.
TABLE_ROWS = (
    ("forward-only", {"method": "forward"}),
    ("data augmentation", {"method": "augment"}),
    ("fill-in-the-middle", {"method": "fim"}),
    ("teacherless (multi-token)", {"method": "teacherless"}),
    ("BST", {"method": "bst"}),
    ("BST w/o Prev", {"method": "bst", "next_weight": 1.0}),
    ("BST w/o backward", {"method": "bst", "model.backward_encoder": False}),
)
# The fields the rows set (with method): a base config must leave them at these, their defaults,
# so that no ablation of its own reaches the row labelled "BST" and none is replaced silently.
TABLE_BASE = {"next_weight": 0.5, "model.backward_encoder": True}


# The BST rows' objective settings beyond the table's own ablations (TABLE_BASE), named in its text
# where a base config changes them: they reach every BST row.
OBJECTIVE_FIELDS = ("pairs", "min_gap", "max_gap", "meet_token", "reduction", "gamma")


def _objective(base: TrainConfig) -> str:
    """The line of a table's text that says which pair objective its BST rows trained."""
    fields = TrainConfig.__dataclass_fields__
    changed = [f"{name}={getattr(base, name)!r}" for name in OBJECTIVE_FIELDS
               if getattr(base, name) != fields[name].default]
    return "BST objective: " + (", ".join(changed) + " (the rest as the defaults)" if changed else
                                "the defaults (all pairs, min_gap 2, no GPT head)")


def machine() -> str:
    """The CPU (or GPU) model, the thread count and the torch version, for result files."""
    import platform

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def _check_out(out: Path):
    """A ValueError, before any run trains, when the table could not be written to `out`: a file on
    the way to its folder, a folder in its place, or a folder that is not writable."""
    from ._checks import short

    if out.is_dir():
        raise ValueError(f"table --out {short(str(out))} is a folder: give a file name")
    if out.exists() and not os.access(out, os.W_OK):  # else the table is lost after every run has trained
        raise ValueError(f"table --out {short(str(out))} exists and is not writable")
    existing = next((p for p in out.parents if p.exists()), None)  # the folder it is written in, or made in
    if existing is not None and not existing.is_dir():
        raise ValueError(f"table --out {short(str(out))}: {short(str(existing))} is a file, not a folder")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK) \
            and not (existing == out.parent and os.access(out, os.W_OK)):
        raise ValueError(f"table --out {short(str(out))}: {short(str(existing))} is not writable")


def table(base: TrainConfig, resume: bool = False, out: Optional[str] = None, note: Optional[str] = None):
    """Trains every row of TABLE_ROWS on one config (each in out_dir/<row>) and prints path accuracy
    per method; `out`: also write the table there, below `note`."""
    from ._checks import short

    base = _series_base(base, "table")
    for name, default in {"method": "bst", **TABLE_BASE}.items():
        value = getattr(base.model, name[len("model."):]) if name.startswith("model.") else getattr(base, name)
        if value != default:
            raise ValueError(f"config field {name!r} is {short(value)}: table sets it in each row (the rows are the "
                             f"paper's baselines and ablations), so the config must leave it at {default!r}; "
                             f"train one setting with the train command")
    if out:
        _check_out(Path(out))
    rows = []  # every row's config is checked before the first one trains
    for label, changes in TABLE_ROWS:
        rest = [f"{k}={json.dumps(v)}" for k, v in changes.items() if k != "method"]
        cfg = apply_sets(_method_config(base, changes["method"]), rest).check()
        cfg.out_dir = str(Path(base.out_dir) / label.split(" (")[0].replace(" ", "_").replace("/", ""))
        rows.append((label, cfg))
    lines = []
    for label, cfg in rows:
        _say(f"== {label}")
        t0 = time.perf_counter()
        r = _train_run(cfg, resume)
        lines.append(f"| {label} | {r.get('path_accuracy', float('nan')):.3f} | {r.get('loss', float('nan')):.4f} | "
                     f"{time.perf_counter() - t0:.0f} |")
    text = "\n".join([
        f"Star graph G({base.star_degree},{base.star_path_len}), N={base.star_nodes} node labels, "
        f"{base.n_test} test graphs; {base.model.n_layer} layers x {base.model.d_model}, "
        f"{base.steps} steps of {base.batch_size} rows. Machine: {machine()}.", _objective(base), "",
        "| method | path accuracy | final train loss | train time (s) |", "| --- | --- | --- | --- |", *lines, "",
        f"(guessing one arm at random scores 1/d = {1 / base.star_degree:.3f})"])
    _say("\n" + text)
    if out and is_rank0():
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text((note + "\n\n" if note else "") + text + "\n")
