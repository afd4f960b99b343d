"""bst_fast.trainer: the training loop, AdamW + warmup/cosine, with exact resume and DDP.

Methods (TrainConfig.method): "bst"; the star-graph baselines of the paper's figure: "forward"
(next-token), "augment" (goal replaced by an intermediate node), "fim" (Fill-in-the-Middle: a path
suffix placed before the answer) and "teacherless" (multi-token prediction). The BST ablations are
"bst" with next_weight=1 ("w/o Prev") and with model.backward_encoder=false ("w/o backward").

One function a phase: `_setup` (every check, then the run folder is claimed), `train_step` (one
optimizer step; also what bench/paper_speed.py times), `_close_interval` (log, evaluate,
checkpoint). The config lives in config.py, the data and the objective in tasks.py, checkpoints in
checkpoint.py and the run folder in run_folder.py. This module is named `trainer` so that the name
`bst_fast.train` is the function, never a submodule.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function

from ._checks import ArgumentTypeError, short
from ._pairs import to_device
from .backends import runtime
from .checkpoint import (CheckpointWriteError, NonFiniteWeights, best_so_far, latest_checkpoint, load_checkpoint, read_config,
                         resume_changes, save_checkpoint)
from .config import RESUMABLE_CHANGES, ConfigLike, TrainConfig, resolve_config
from .model import FLEX_ON_CPU
from .run_folder import MetricsLog, RunFolder, logged_at
from .tasks import (DATA_SET_FIELDS, RANK_ERRORS, Objective, build_model, build_task, failure_summary, model_config,
                    rank_failure, sum_over_ranks)


# steps _prepare looks through for a first batch with something to learn from (Objective.nothing_to_learn)
FIRST_BATCH_SEARCH = 64


class TrainingStopped(RuntimeError):
    """A run stopped on a fault (a non-finite loss or weights); the message names the last good checkpoint."""


def from_rank0(world: int, rank: int, work: Callable[[], Any]) -> Any:
    """work() on rank 0 (the one that holds the run folder, evaluates and saves), its result given to
    every rank, and its failure raised on every rank: a rank left running while rank 0 stopped would
    wait in the next collective until its timeout (or die of a closed connection, naming nothing).
    The other ranks raise its nearest known type (the run's own faults too) with rank 0's message
    (tasks.rank_failure)."""
    if world == 1:
        return work()
    known = (TrainingStopped, CheckpointWriteError, *RANK_ERRORS)
    box: List[Any] = [None, None]
    failed = None
    if rank == 0:
        try:
            box[0] = work()
        except BaseException as e:
            failed, box[1] = e, failure_summary(e, known)
    dist.broadcast_object_list(box, src=0)
    if failed is not None:
        raise failed
    if box[1] is not None:
        raise rank_failure(0, box[1], known)
    return box[0]


def lr_lambda(cfg: TrainConfig):
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


def build_optimizer(model, cfg: TrainConfig):
    """AdamW (weight decay on matrices only) and its lr schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def autocast_for(device: str):
    """The trainer's precision: bf16 autocast on a GPU, float32 on the CPU."""
    if device == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _check_resumable(ckpt: Path, then: TrainConfig, cfg: TrainConfig, before_task: bool = False):
    """The checkpoint's config (`then`, read_config's) must equal cfg (with the model's data fields
    set) in every field a resumed run may not change (resume_changes: a text run's `data` may name
    its corpus by another path). before_task: checked before the task reads the data, so that a
    changed field is named, not what the task finds wrong with the data it names (a star run's
    checkpoint holds no tokenizer.json); the model fields the data sets (model_config) are checked after."""
    diff = resume_changes(then.to_dict(), cfg.to_dict(), RESUMABLE_CHANGES)
    if before_task:
        diff = {k: v for k, v in diff.items() if k not in {f"model.{f}" for f in (*DATA_SET_FIELDS, "gpt_head")}}
    if diff:
        raise ValueError(f"checkpoint {ckpt} was trained with another config; (checkpoint, now) per field: {diff}. "
                         f"Set them back to resume it, or start over (--overwrite, or another out_dir); a resume "
                         f"may change {', '.join(RESUMABLE_CHANGES)}")


class Batch(NamedTuple):
    """One rank's rows of a step and the counts of the whole step's batch (per rank) that its
    losses divide by, so ranks and micro-batches add up to the mean over the global batch."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    prefix_start: Union[int, torch.Tensor]
    pair_total: float
    token_total: float
    row_total: float
    documents: Optional[torch.Tensor] = None  # packed rows' (B, L) document ids (docs/contract.md §10)
    pairs_drawn: float = 0.0  # the pairs the loss reads (a subsample's k_r summed), for pairs_per_s
    positions: float = 0.0  # valid positions (BOS and EOS in, padding out), for tokens_per_s

    def split(self, n: int) -> List["Batch"]:
        """`n` micro-batches of consecutive rows, each keeping the whole batch's totals."""
        size = len(self.tokens) // n
        parts = []
        for k in range(n):
            rows = slice(k * size, (k + 1) * size)
            start = self.prefix_start if isinstance(self.prefix_start, int) else self.prefix_start[rows]
            documents = None if self.documents is None else self.documents[rows]
            parts.append(self._replace(tokens=self.tokens[rows], lengths=self.lengths[rows], prefix_start=start,
                                       documents=documents))
        return parts


@dataclasses.dataclass
class Run:
    """What the steps of one training call share."""

    cfg: TrainConfig
    task: Any
    model: torch.nn.Module
    net: torch.nn.Module  # the model, or its DDP wrapper: what the step calls
    optimizer: torch.optim.Optimizer
    scheduler: Any
    objective: Objective
    device: str
    world: int
    rank: int
    folder: Optional[RunFolder] = None  # rank 0's, locked
    metrics: Optional[MetricsLog] = None
    bar: Any = None
    last_good: Optional[Path] = None
    best: Optional[float] = None  # the best evaluation figure so far (keep_best)
    result: Dict[str, float] = dataclasses.field(default_factory=dict)
    # the open logging interval: loss sum and steps, and the rates' counts since it opened
    loss_sum: Optional[torch.Tensor] = None
    n_sum: int = 0
    n_logged: int = 0  # steps metrics.csv has rows for (a checkpoint records it; a resume checks it)
    t0: float = 0.0
    tokens_seen: float = 0.0
    pairs_seen: float = 0.0
    n_timed: int = 0

    def batch(self, step: int) -> "Batch":
        """Step `step`'s rows for this rank and the global counts the loss is normalised by."""
        tokens, lengths, row_start, documents = self.task.rows(step, self.cfg.batch_size)  # the global batch, (B, L)
        start_pos = torch.full_like(lengths, self.task.prefix_start) if row_start is None else row_start
        pair_total, token_total, drawn = (n / self.world for n in
                                          self.objective.totals(lengths, start_pos, tokens.shape[1], documents))
        r, w = self.rank, self.world
        # The rows go up without blocking (pinned), and the lengths stay on the host, where the loss
        # draws a subsample from them while the GPU runs the encoders: a step reads nothing back.
        up = lambda t: to_device(t[r::w].contiguous(), self.device)
        # A per-row start only where rows differ (FIM); the int keeps the other methods' kernels as they were.
        prefix_start = self.task.prefix_start if row_start is None else up(row_start)
        return Batch(up(tokens), lengths[r::w].contiguous(), prefix_start, float(pair_total), float(token_total),
                     len(tokens) / w, None if documents is None else up(documents), float(drawn),
                     float(lengths.sum()) / w)

    def close(self):
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.folder is not None:
            self.folder.unlock()


def train_step(run: Run, step: int) -> Optional[torch.Tensor]:
    """One optimizer step of `run` at 0-based `step`: forward and loss under the trainer's autocast
    and backward for each of cfg.grad_accum micro-batches (their losses and gradients add up to the
    whole batch's), clipping, AdamW and the schedule. Returns the loss (a 0-dim tensor, not synced),
    or None for a batch with nothing to learn from (Objective.nothing_to_learn): no update then, the
    schedule alone moves on, and rank 0 names the step on stderr."""
    cfg = run.cfg
    # Every random choice is a function of (seed, step, rank): resuming at any step is exact.
    # (a rank's term 2**44 apart: no rank meets another's seed of a later step; rank 0's is as before)
    torch.manual_seed(cfg.seed * 1_000_003 + step * 1009 + run.rank * 2**44)
    batch = run.batch(step)
    # Every rank holds the global batch's totals, so all of them skip the same steps (no collective
    # is left waiting). A mean over no pair is undefined: the loss refuses it, and a step would stop
    # the run at the same step on every resume.
    empty = run.objective.nothing_to_learn(cfg.method, batch.pair_total, batch.token_total)
    if empty:
        if run.rank == 0:
            print(f"step {step + 1}: the batch (row lengths {short(batch.lengths.tolist())}"
                  f"{' on rank 0' if run.world > 1 else ''}) holds {empty}: no update at this step, the "
                  "learning-rate schedule moves on", file=sys.stderr, flush=True)
        with warnings.catch_warnings():  # before the first optimizer.step, torch warns of a skipped
            warnings.simplefilter("ignore", UserWarning)  # first lr value, which is not what happens here
            run.scheduler.step()
        return None
    run.optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=run.device)
    parts = batch.split(cfg.grad_accum)
    for k, part in enumerate(parts):
        # DDP averages the gradients once, at the step's last micro-batch.
        sync = run.world == 1 or k == len(parts) - 1
        with contextlib.nullcontext() if sync else run.net.no_sync():
            # The phases are named for profilers (bench/paper_speed.py); record_function costs nothing unprofiled.
            with record_function("forward"), autocast_for(run.device):
                seed = cfg.seed * 7919 + step * 31 + k * 1_000_000_007 + run.rank * 2**44
                out = run.objective(run.net, part.tokens, part.lengths, prefix_start=part.prefix_start,
                                    generator=torch.Generator().manual_seed(seed), pair_total=part.pair_total,
                                    token_total=part.token_total, row_total=part.row_total, documents=part.documents)
            with record_function("backward"):
                out["total"].backward()
        loss += out["total"].detach().float()
    with record_function("optimizer"):
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
        run.optimizer.step()
        run.scheduler.step()
    # tokens: the rows' valid positions (padding is not counted); pairs: those the loss read (until
    # stop 38 pair_total * pairs, which missed the subsample's rounding and its at-least-one)
    run.tokens_seen += batch.positions
    run.pairs_seen += batch.pairs_drawn if cfg.method == "bst" else 0
    return loss


_GROUP = {"started": None, "timeout": 0.0}  # the process group train() started, if any, and its ddp_timeout


def end_process_group() -> bool:
    """End the DDP process group train() started (and no other; True if it did): the CLI calls it
    once the command is done, at exit otherwise. Left to the interpreter's teardown, gloo aborted a
    finished rank now and then under load (`terminate called without an active exception`), and
    even after this it still did, about one run in ten on a loaded machine: the CLI then leaves
    without the teardown (cli)."""
    group, _GROUP["started"] = _GROUP["started"], None
    if group is not None and dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()
        return True
    return False


def _environment_int(name: str, default: int, lowest: int, highest: Optional[int] = None, why: str = "") -> int:
    """The environment variable `name` (torchrun sets it) as an int in [lowest, highest], ASCII
    digits only (int() also takes ' 2', '2_0' and '٢'), `default` when unset; else a ValueError
    naming it (WORLD_SIZE=0 was a ZeroDivisionError, 'abc' int()'s message naming nothing)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text) if text.isascii() and text.isdigit() else None
    except ValueError:  # past Python's 4300 digits
        value = None
    if value is None or value < lowest or (highest is not None and value > highest):
        bound = f"from {lowest} to {highest}" if highest is not None else f">= {lowest}"
        raise ValueError(f"environment variable {name} must be an int {bound}{why}, got {short(text)}")
    return value


def _world() -> int:
    """WORLD_SIZE, the number of processes: 1 unless launched by torchrun (or another launcher
    setting it), checked with RANK before torch.distributed reads them."""
    world = _environment_int("WORLD_SIZE", 1, 1, why=" (the number of processes; unset: 1)")
    if world > 1:
        if "RANK" not in os.environ:
            raise ValueError(f"environment variable WORLD_SIZE is {world}, but RANK is not set: launch the "
                             f"processes with torchrun, which sets both")
        _environment_int("RANK", 0, 0, world - 1, " (this process's rank, below WORLD_SIZE)")
    return world


def _device(cfg: TrainConfig, world: int) -> str:
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and not dist.is_initialized():
        timeout = {"timeout": datetime.timedelta(seconds=cfg.ddp_timeout)} if cfg.ddp_timeout else {}
        dist.init_process_group("nccl" if device == "cuda" else "gloo", **timeout)
        _GROUP["timeout"] = cfg.ddp_timeout
        # Kept for later calls in this process (a group started anew under torchrun could hang in
        # its rendezvous) and ended at exit: left to the interpreter's teardown, gloo aborted in
        # about one run in fifteen (docs/results.md, DDP). The CLI ends it earlier (end_process_group).
        _GROUP["started"] = dist.group.WORLD
        atexit.register(end_process_group)
    elif world > 1:
        # a group outlives the train() call that made it (or the user made it): its timeout is fixed
        ours = dist.group.WORLD is _GROUP["started"]
        if cfg.ddp_timeout != (_GROUP["timeout"] if ours else 0) and dist.get_rank() == 0:
            made = f"by an earlier train() call with ddp_timeout {_GROUP['timeout']:g}" if ours else "outside train()"
            print(f"warning: config field 'ddp_timeout' ({cfg.ddp_timeout:g}) does not apply: this process's DDP group, "
                  f"started {made}, keeps its own timeout", file=sys.stderr, flush=True)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("config field 'device' is 'cuda', but this torch sees no CUDA device "
                             f"(torch {torch.__version__}); use 'auto' or 'cpu'")
        torch.cuda.set_device(_environment_int("LOCAL_RANK", 0, 0, why=" (this process's GPU on its machine)"))
    if cfg.batch_size % (world * cfg.grad_accum):
        raise ValueError(f"config field 'batch_size' ({cfg.batch_size}) must divide by the number of ranks ({world}) "
                         f"times grad_accum ({cfg.grad_accum})")
    return device


def build_run(cfg: TrainConfig, device: str, resume_from: Optional[Path] = None, world: int = 1, rank: int = 0) -> Run:
    """The task, model, optimizer and objective of `cfg` on `device`, touching no folder: what
    `train` steps through (and bench/paper_speed.py times with `train_step`). `resume_from`: the
    checkpoint a resumed run continues from, checked against `cfg` (its weights are not loaded)."""
    torch.manual_seed(cfg.seed)
    # Read once (every file of the checkpoint hashed: read_config verifies it whole) for both checks,
    # before the task reads the checkpoint's tokenizer.json and data.json: damage is named as such,
    # not as a bad tokenizer or another corpus. load_checkpoint verifies it again as it loads it.
    then = None if resume_from is None else read_config(resume_from)
    if then is not None:
        _check_resumable(resume_from, then, cfg, before_task=True)
    task = build_task(cfg, resume_from, rank)
    cfg = model_config(cfg, task)
    if then is not None:
        _check_resumable(resume_from, then, cfg)
    model = build_model(cfg).to(device)
    optimizer, scheduler = build_optimizer(model, cfg)
    objective = Objective.from_config(cfg, task.eos_id)
    return Run(cfg, task, model, model, optimizer, scheduler, objective, device, world, rank)


def compile_encoders(model) -> None:
    """TrainConfig.compile: torch.compile the model's encoders (the forward one, and the backward
    one where it has its own). Module.compile() compiles in place: parameter names, and so
    checkpoints, stay the same. The first step through them compiles."""
    model.forward_encoder.compile()
    if getattr(model, "backward_encoder", None) is not None:
        model.backward_encoder.compile()


def _prepare(cfg: TrainConfig, folder: RunFolder, resume: bool, stop_at: Optional[int], overwrite: bool,
             device: str, world: int, rank: int):
    """_setup's checks, then (rank 0) the claim of the run folder: (run, start, end, loaded state),
    or the logged figures of a run already at its end."""
    def held_check():
        # Locked before anything in it is read: a second process on a folder a run trains in stops
        # here, naming the holder, not on a checkpoint the holder is pruning. Rank 0 alone reads the
        # folder (another rank, later, would see what rank 0 wrote since) and gives every rank its
        # checkpoint.
        folder.hold()
        return folder.check(resume, overwrite)

    ckpt = from_rank0(world, rank, held_check)
    def build():
        """The run, its state and its steps on this rank, through the first batch's loss: every
        check that may fail before the folder is claimed (None: a run already at its end)."""
        run = build_run(cfg, device, ckpt, world, rank)
        state = {"step": 0} if ckpt is None else load_checkpoint(ckpt, run.model, run.optimizer, run.scheduler)
        start, end = state["step"], run.cfg.steps if stop_at is None else min(stop_at, run.cfg.steps)
        if start >= end:
            return run, state, start, end
        if run.cfg.compile:
            # Compiled here, so that the first batch below compiles the training graph (with grad, as
            # a step runs it) and a broken compiler fails before the folder is touched.
            compile_encoders(run.model)
        # the backend takes this head on this device, and the data gives a batch: the first step's, or
        # the next one with something to learn from (train_step skips the others), looked for in the
        # run's next FIRST_BATCH_SEARCH steps, past this call's end too (a resume or stop_at range of
        # skipped steps alone must run); none there: a new run is refused, a resumed one goes on
        # without the check
        with torch.enable_grad() if run.cfg.compile else torch.no_grad():
            batch, first_empty = None, None
            for at in range(start, min(run.cfg.steps, start + FIRST_BATCH_SEARCH)):
                batch = run.batch(at)
                empty = run.objective.nothing_to_learn(run.cfg.method, batch.pair_total, batch.token_total)
                if not empty:
                    break
                batch, first_empty = None, first_empty or empty
            if batch is None and start == 0:
                raise ValueError(f"no batch of steps 1..{min(run.cfg.steps, FIRST_BATCH_SEARCH)} has anything to "
                                 f"learn from (step 1's holds {first_empty}): the rows are too short for the "
                                 "objective; check min_gap, max_gap and max_len against the data")
            if batch is not None:
                part = batch.split(run.cfg.grad_accum)[0]
                # the first step's backward would refuse it (this forward runs without grad): refused now
                if part.documents is not None and run.cfg.model.attention == "flex" and torch.device(device).type == "cpu":
                    raise ValueError(FLEX_ON_CPU)
                with autocast_for(device):
                    run.objective(run.model, part.tokens, part.lengths, prefix_start=part.prefix_start,
                                  generator=torch.Generator(), pair_total=part.pair_total, token_total=part.token_total,
                                  row_total=part.row_total, documents=part.documents)
        return run, state, start, end

    built, failure = None, None
    try:
        built = build()
    except BaseException as e:  # an interrupt too: counted, then raised after the other ranks learn of it
        failure = e
    sum_over_ranks([], device, world, failure)  # every rank got this far, or every rank stops here
    run, state, start, end = built
    cfg, task = run.cfg, run.task
    if start >= end:  # a finished run (or one already past stop_at): reported, not an error
        if rank == 0:
            print(f"{cfg.out_dir}: the run is at step {start} (checkpoint {ckpt}), where this call stops "
                  f"({'steps' if stop_at is None or stop_at >= cfg.steps else 'stop_at'} = {end}): nothing to "
                  f"train; raise steps (a resumable change) to continue it", file=sys.stderr, flush=True)
        return {"step": float(start), **logged_at(Path(cfg.out_dir), start)}

    def claim():
        folder.claim()
        if folder.check(resume, overwrite) != ckpt:  # changed before the lock was taken
            raise ValueError(f"out_dir {short(cfg.out_dir)} changed while this run started; start it again")
        folder.start(new_run=ckpt is None)
        task.save(folder.path)

    from_rank0(world, rank, claim)
    run.folder = folder if rank == 0 else None
    return run, start, end, state


def _setup(cfg: TrainConfig, resume: bool, stop_at: Optional[int], overwrite: bool):
    """A Run ready to train, or the logged figures (a dict) of a run that is already at its end.
    Every check comes first (config, folder, data, model, the backend and a compile on the first
    batch); only then is the run folder claimed, cleaned and written. An existing folder's lock is
    taken before anything else, so that a folder in use stops this run before it reads a checkpoint."""
    runtime.check_environment()
    world = _world()
    device = _device(cfg, world)
    rank = dist.get_rank() if world > 1 else 0
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise ValueError(f"stop_at must be None or a step >= 1, got {stop_at!r}")
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):  # resume="false" is truthy: it resumed
            raise ArgumentTypeError(f"{name} must be True or False, got {short(flag)}")
    if resume and overwrite:  # the folder would decide which one wins: say which is meant
        raise ValueError("resume (--resume) continues the run in out_dir and overwrite (--overwrite) starts it over: "
                         "give one of them")
    folder = RunFolder(cfg.out_dir)
    try:
        setup = _prepare(cfg, folder, resume, stop_at, overwrite, device, world, rank)
    except BaseException:
        folder.unlock()
        raise
    if isinstance(setup, dict):
        folder.unlock()
        return setup
    run, start, end, state = setup
    try:
        return _ready(run, start, end, state)
    except BaseException:
        run.close()  # the lock with it
        raise


def _ready(run: Run, start: int, end: int, state: Dict[str, Any]):
    """The rest of _setup once the folder is claimed: the schedule, DDP, the logs, the open interval."""
    cfg, optimizer, scheduler, model = run.cfg, run.optimizer, run.scheduler, run.model
    device, world, rank = run.device, run.world, run.rank
    if world > 1:
        dist.barrier()
    # The saved lr is the old schedule's; a resume that changed steps continues on the new one
    # (unchanged steps: the same product, so the same value as saved).
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(start)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    run.net = DistributedDataParallel(model) if world > 1 else model
    run.metrics = MetricsLog(cfg.out_dir, rank == 0)
    # rows logged after the checkpoint we resume from are replayed
    run.n_logged = from_rank0(world, rank, lambda: run.metrics.truncate(start, state.get("logged")))
    if cfg.progress and rank == 0:
        from tqdm import tqdm

        run.bar = tqdm(total=cfg.steps, initial=start, desc=f"{cfg.method}", dynamic_ncols=True)
    run.last_good = from_rank0(world, rank, lambda: latest_checkpoint(cfg.out_dir))  # named in every rank's faults
    # _keep_best runs on rank 0 alone, and a damaged best.json is named once
    run.best = best_so_far(cfg.out_dir, cfg.keep_best, start, cfg, world) if cfg.keep_best and rank == 0 else None
    # An interval a stop_at left open comes back from the checkpoint, so the row that closes it is
    # the uninterrupted run's.
    run.loss_sum, open_log = torch.zeros((), device=device), state.get("log")
    if open_log:
        sums, run.n_sum = open_log["loss_sum"], open_log["n"]  # one per rank
        if len(sums) == world:
            run.loss_sum.fill_(sums[rank])
        elif rank == 0:  # another number of ranks: rank 0 carries a total that averages the same
            run.loss_sum.fill_(sum(sums) * world / len(sums))
    run.t0 = time.perf_counter()
    return run, start, end


def _evaluate(run: Run, done: int, row: Dict[str, float]) -> Dict[str, float]:
    """The task's evaluation after step `done` (each rank its share, summed), then checkpoints/best
    (rank 0, its fault every rank's) when it is the best so far."""
    figures = run.task.evaluate(run.model, run.device, run.world, run.rank)
    from_rank0(run.world, run.rank, lambda: _keep_best(run, done, {**row, **figures}))
    return figures


def _keep_best(run: Run, done: int, row: Dict[str, float]):
    """Saves checkpoints/best when this evaluation's figure (cfg.keep_best) beats the best so far."""
    metric = run.cfg.keep_best
    if not metric or metric not in row:
        return
    value, lower = row[metric], metric.endswith("loss")
    if run.best is None or (value < run.best if lower else value > run.best):
        _save(run, done, keep=0, best={"metric": metric, "value": value, "step": done, "world": run.world})
        run.best = value


def _save(run: Run, done: int, **kw) -> Path:
    """save_checkpoint of the run after step `done`; weights it refuses (non-finite) stop the run,
    naming the last good checkpoint."""
    try:
        return save_checkpoint(run.cfg.out_dir, done, run.model, run.optimizer, run.scheduler, run.cfg,
                               task=run.task, logged=run.n_logged if run.rank == 0 else None, **kw)
    except NonFiniteWeights as e:
        raise TrainingStopped(f"training stopped at step {done}: {e}; the last good checkpoint is "
                              f"{run.last_good or 'none (no checkpoint was written yet)'}") from None


def _close_interval(run: Run, done: int, end: int, lr: float):
    """After step `done` (1-based): the logging interval's row, the evaluation and the checkpoint,
    each when the step calls for it."""
    cfg = run.cfg
    eval_now = (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps
    ckpt_now = (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps
    logged = done % cfg.log_every == 0 or eval_now or ckpt_now  # a function of the step alone
    # stop_at between logged steps: no row (an uninterrupted run has none there); the call returns
    # the open interval's figures and its checkpoint keeps them for the resumed call
    stopping = done == end and not logged
    if logged or stopping:
        # the one host sync of a logging interval; an interval whose every step had nothing to learn
        # from (train_step: the same on every rank) logs a loss of nan, and the run goes on
        mean_loss = float(run.loss_sum) / run.n_sum if run.n_sum else math.nan
        if run.world > 1 and run.n_sum:
            t = torch.tensor([mean_loss], device=run.device)
            dist.all_reduce(t)
            mean_loss = float(t) / run.world
        if run.n_sum and not math.isfinite(mean_loss):
            raise TrainingStopped(f"training stopped: the loss became non-finite ({mean_loss}) by step {done}; "
                                  f"the last good checkpoint is {run.last_good or 'none (no checkpoint was written yet)'}")
        dt = time.perf_counter() - run.t0
        row = {"loss": mean_loss, "lr": lr, "tokens_per_s": run.tokens_seen * run.world / dt,
               "pairs_per_s": run.pairs_seen * run.world / dt, "steps_per_s": run.n_timed / dt}
        if eval_now:
            row.update(_evaluate(run, done, row))
        run.result.update(row)
        if run.bar is not None:
            run.bar.set_postfix({k: f"{v:.3g}" for k, v in row.items() if k != "lr"}, refresh=False)
            run.bar.update(run.n_timed)
        if logged:
            from_rank0(run.world, run.rank, lambda: run.metrics.log(done, row))
            run.n_logged += 1
            run.n_sum = 0
            run.loss_sum.zero_()
        # the next interval times its own steps: not this evaluation, log write or checkpoint
        run.t0, run.tokens_seen, run.pairs_seen, run.n_timed = time.perf_counter(), 0, 0, 0
    if ckpt_now or done == end:
        open_log = None
        if stopping:  # every rank's share of the open interval's loss
            sums = [run.loss_sum.clone() for _ in range(run.world)]
            if run.world > 1:
                dist.all_gather(sums, run.loss_sum)
            open_log = {"loss_sum": [float(s) for s in sums], "n": run.n_sum}
        saving = time.perf_counter()
        run.last_good = from_rank0(run.world, run.rank,
                                   lambda: _save(run, done, keep=cfg.keep_checkpoints, log=open_log))
        run.t0 += time.perf_counter() - saving  # a checkpoint's time is no step's


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

    resume continues from the latest checkpoint in out_dir; a run already at its last step is
    reported (a line on stderr) and returns the figures logged at that step, with "step". A step
    whose whole batch has nothing to learn from (no pair; tasks.Objective.nothing_to_learn) makes no
    update and is named on stderr; a logging interval of such steps alone logs a loss of nan. stop_at
    ends this call after that step with a checkpoint, as a pre-empted job would; a later call with
    resume=True continues to exactly the parameters of an uninterrupted run. overwrite starts over
    in an out_dir that holds another bst_fast run, deleting only that run's files.

    Under torchrun (WORLD_SIZE > 1) it runs DDP (NCCL on GPU, gloo on CPU); every rank draws the
    same global batch and takes its share of rows, and each rank's loss is divided by the global
    pair and token counts, so the averaged gradient equals that of one process on the whole batch.
    """
    cfg = resolve_config(config, **overrides).check()
    setup = _setup(cfg, resume, stop_at, overwrite)
    if isinstance(setup, dict):
        return setup
    run, start, end = setup
    try:
        for step in range(start, end):
            lr = run.optimizer.param_groups[0]["lr"]  # this step's, logged (the scheduler then moves on)
            loss = train_step(run, step)
            if loss is not None:  # None: a step with nothing to learn from (the same on every rank)
                run.loss_sum += loss.detach().float()
                run.n_sum += 1
            run.n_timed += 1
            _close_interval(run, step + 1, end, lr)
    except RuntimeError as e:
        if run.world > 1 and "timed out" in str(e).lower():  # gloo's and NCCL's words for a collective's timeout
            raise RuntimeError(f"{e} (DDP: this rank waited past the process group's timeout for another: a rank "
                               f"froze or died, or rank 0's checkpoint save took longer; config field "
                               f"ddp_timeout, {f'{cfg.ddp_timeout:g} s' if cfg.ddp_timeout else 'torch default'} here, sets it)") from e
        raise
    finally:
        run.close()
    if run.world > 1:
        dist.barrier()
    return run.result
