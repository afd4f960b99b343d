"""The paper's Table 3 (training speed on TinyStories, one H100) reproduced with bst_fast's own trainer.

    python bench/paper_speed.py                      # --shape paper on a GPU, --shape cpu on a CPU
    python bench/paper_speed.py --shape tiny         # seconds on a CPU (the test's run)
    python bench/paper_speed.py --columns gpt bst-improved --steps 30 --trace /tmp/traces
    python bench/paper_speed.py --set model.head_hidden=768 --set model.head_layers=2   # any config field, every column
    python bench/paper_speed.py --variant fused=fused_ce=1,relu_in_gemm=1   # each BST column again with these switches
    python bench/paper_speed.py --variant ac=model.activation_checkpointing=true   # every column again with this config

Every column is one TrainConfig stepped by `bst_fast.trainer.train_step`, the optimizer step
`bst_fast.train` runs (forward and loss under the trainer's autocast, bf16 on a GPU; backward;
gradient clipping; AdamW and its schedule), on a `Run` made of the pieces `build_run` uses
(`tasks.model_config`, `tasks.build_model`, `trainer.build_optimizer`, `tasks.Objective`), with
`SyntheticText` in place of the corpus: random ids in full rows [BOS, T ids, EOS]. The paper keeps
stories of at most 256 tokens, so its rows are at most this long and its pair counts at most ours.

| column | config | paper, it/s |
| --- | --- | --- |
| GPT | `method: forward` | 3.086 |
| BST original | `method: bst`, separate encoders, all pairs (`pairs: null`), `next_weight: 0.5`, `gamma: 0` | 0.205 |
| BST improved | `model.shared_encoders: true`, `pairs: 0.02`, `gamma: 0.9`, `next_weight: 0.0` | 0.801 |
| BST improved, SwiGLU head | the same with `model.head_type: swiglu` (the official code's head) | - |

The improved BST's mapping (paper eq. "updated training objective", Table 3's caption: gamma = 0.9,
lambda = 0.0): `gamma` is the weight of the plain next-token head on f (TrainConfig.gamma; > 0 adds
that head), lambda the Next term's weight inside the belief loss, `lambda CE_next + (1 - lambda)
CE_prev` (TrainConfig.next_weight), so lambda = 0 is `next_weight: 0.0`: the belief term is the
Prev head alone, next-token prediction coming from the GPT head.

Shapes (--shape): `paper`: V = 1000, T = 256 (rows of L = 258 with BOS and EOS), batch 256,
encoders of 8 layers x 768 with 8 heads and a 4x MLP (56.6 M parameters each without embeddings,
57.7 M with: the paper's "57 million"), TextHead of 3 layers x 512 with relu (the paper's
appendix). `cpu`: V = 1000, T = 64, batch 8, 2 layers x 128 (4 heads), head 3 x 128. `tiny`:
V = 1000, T = 32, batch 4, 2 layers x 32 (2 heads), head 3 x 32, 3 timed steps.

Per column: it/s as 1 / the median step time of --steps timed steps after --warmup steps (each
step timed with CUDA events on a GPU, the host clock on a CPU), and the whole timed loop's it/s
beside it; tokens/s (B L per step, as the trainer counts); the peak memory (GPU: the CUDA
allocator's max_memory_allocated over the column; CPU: the growth of the process's RSS over
building the run and its warm-up steps, sampled every ms, or null; the process's one-off growth is
paid before the first column, in an untimed step of its run); model TFLOP/s (`step_flops`);
and the time of each phase, from marks at the record_function ranges of `train_step` ("forward",
"backward", "optimizer") and of `BeliefStateTransformer.forward` ("encoders", "pair_loss"). The
fused pair-loss backends compute the loss's gradient inside its forward, so "pair loss" holds
both and "backward" is the encoders' backward (and the GPT head's). `--nvtx` emits those phases and
every op as NVTX ranges during the timed steps (for `nsys profile`). `--trace DIR` also profiles
--profile-steps steps of each column with torch.profiler: DIR/<column>.trace.json (chrome trace)
and DIR/<column>.txt (the top-op table). `--variant` runs each BST column again, right after it in
this process, under other runtime switches, or every column under other config fields (a dotted
model field or a TrainConfig field; each run after its own warm-up; `triton_compiles_timed`
counts the kernels Triton compiled during a column's timed steps). Between columns torch.compile's
caches are reset, so a compiled column never reuses another's graphs. Results: bench/results/<card>/paper_speed.{json,md}
(<card>: the device's name as a slug, e.g. nvidia-h100-80gb-hbm3), or --out DIR; written after
every column, so a run cut short keeps the columns it finished.

PREDICTIONS for --shape paper on one H100 SXM (989 TFLOP/s dense bf16), from FLOPs, not
measurements (model FLOPs as `step_flops` counts them: 6 per parameter and token, attention
12 n_layer m L per token, the head's per-pair GEMMs 6 |P| x their multiply-adds):
- GPT: 24.0 TFLOP a step (56.6 M non-embedding parameters x 66,048 tokens x 6 = 22.4, attention
  1.3, LM head 0.3). At 30-40% of peak (eager PyTorch at m = 768, no torch.compile: the GEMMs near
  600 TFLOP/s, 20-30 ms of LayerNorm, GELU and residual traffic; the H200 ran the old
  bench/profile.py's GPT step at this shape in 79 ms): 60-80 ms, about 12-16 it/s. The paper: 3.086.
- BST original: 112.7 TFLOP. Both encoders 47.4 (about twice GPT's time, 130-160 ms) and the pair
  loss: |P| = 256 x 257 x 256 / 2 = 8.42 M pairs x 6 x (512 x 512 + 512 x 2000) = 65.0 TFLOP of
  per-pair head work (the issue's 77 TFLOP is 6 |P| h 2V with h = 768, the old bench/profile.py's
  2-layer 768-wide head). At the triton backend's ~225 TFLOP/s for a 3-layer head (README, H200)
  about 290 ms: 420-470 ms a step, about 1.9-2.4 it/s, ten times the paper's 0.205.
- BST improved: 49.3 TFLOP. The shared encoder runs twice (the same 47.4), 2% of the pairs is 1.3
  plus the host's pair sampler and the loss's fixed costs: 150-190 ms, about 5-6.5 it/s (the paper:
  0.801).
- BST improved, SwiGLU head: 60.6 TFLOP. + 5.0 of per-token gate/up projections (SwiGLU width
  4096) and 168 k pairs x 47 MFLOP = 7.9 through the torch backend (~250 TFLOP/s on the H200):
  190-230 ms, about 4.3-5.3 it/s.
- Peak memory: GPT ~20 GB (bf16 autocast saves about 46 m bytes a token and layer: 35 KB x 66 k
  tokens x 8 layers = 19 GB), the BSTs ~40-45 GB (two encoders' activations, or the shared one's
  twice; the pair loss adds its 256 MB chunks).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# bench/ holds profile.py, which would shadow the standard library's profile module that torch
# imports: take bench/ off the path, put the project root on it (as bench/pairs.py does).
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bst_fast.backends import runtime  # noqa: E402
from bst_fast.config import TrainConfig, apply_overrides, apply_sets  # noqa: E402
from bst_fast.model import ModelConfig  # noqa: E402
from bst_fast.tasks import Objective, Rows, build_model, model_config  # noqa: E402
from bst_fast.trainer import Run, build_optimizer, compile_encoders, train_step  # noqa: E402


def bench_module(name: str):
    """A script of bench/ loaded by its path (bench/ stays off sys.path, see above)."""
    key = f"_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, _HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


RESULTS = _HERE / "results"

# Encoders, head and batch of each --shape; steps and warmup are the defaults of --steps/--warmup.
SHAPES: Dict[str, Dict[str, Any]] = {
    # the paper's TinyStories BST (Table 3; appendix: 8 layers x 768, 8 heads, a 3-layer 512-wide relu head)
    "paper": dict(vocab=1000, T=256, batch=256, n_layer=8, d_model=768, n_head=8, head_hidden=512,
                  head_layers=3, steps=20, warmup=3),
    # reduced for a CPU: the four columns in well under a minute on one core
    "cpu": dict(vocab=1000, T=64, batch=8, n_layer=2, d_model=128, n_head=4, head_hidden=128,
                head_layers=3, steps=20, warmup=2),
    # seconds on a CPU: the test's shape
    "tiny": dict(vocab=1000, T=32, batch=4, n_layer=2, d_model=32, n_head=2, head_hidden=32,
                 head_layers=3, steps=3, warmup=1),
}


@dataclasses.dataclass(frozen=True)
class Column:
    name: str
    slug: str
    paper_it_per_s: Optional[float]  # Table 3, one H100
    # the docstring's range for --shape paper on an H100: a prediction, not a measurement
    predicted_it_per_s: Optional[Tuple[float, float]]
    overrides: Dict[str, Any]  # TrainConfig fields, dotted for the model's


_IMPROVED = {"method": "bst", "model.shared_encoders": True, "pairs": 0.02, "gamma": 0.9, "next_weight": 0.0}
COLUMNS = (
    Column("GPT", "gpt", 3.086, (12, 16), {"method": "forward"}),
    Column("BST original", "bst-original", 0.205, (1.9, 2.4),
           {"method": "bst", "model.shared_encoders": False, "pairs": None, "next_weight": 0.5, "gamma": 0.0}),
    Column("BST improved", "bst-improved", 0.801, (5, 6.5), _IMPROVED),
    Column("BST improved, SwiGLU head", "bst-improved-swiglu", None, (4.3, 5.3),
           {**_IMPROVED, "model.head_type": "swiglu"}),
)
# runtime switches that only change a subsampled pair set (pairs < 1): no variant of them alone on all pairs
SUBSAMPLE_SWITCHES = {"host_pairs", "device_sampler"}
PHASES = ("encoders", "pair_loss", "forward_rest", "backward", "optimizer", "other")


class SyntheticText:
    """Random token rows of the paper's TinyStories shape: [BOS, T ids, EOS], every row full, ids 0-2
    being PAD, BOS and EOS as in a tokenizer from train_bpe. What `Run` needs of a task: `rows`,
    `prefix_start`, `vocab_size`, `max_len` (and `evaluate`, `save`, unused here). A few batches
    are drawn once and reused: the data's cost is not what is timed."""

    files = ()

    def __init__(self, vocab_size: int, T: int, seed: int = 0, pool: int = 4):
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4 (PAD, BOS, EOS and one id), got {vocab_size}")
        self.vocab_size, self.max_len, self.prefix_start, self.eos_id = vocab_size, T + 2, 0, 2
        self.seed, self.pool, self._rows = seed, pool, {}

    def rows(self, step: int, batch_size: int) -> Rows:
        key = (step % self.pool, batch_size)
        if key not in self._rows:
            g = torch.Generator().manual_seed(self.seed * 1009 + key[0])
            rows = torch.randint(3, self.vocab_size, (batch_size, self.max_len), generator=g)
            rows[:, 0], rows[:, -1] = 1, 2
            self._rows[key] = rows
        return Rows(self._rows[key], torch.full((batch_size,), self.max_len, dtype=torch.long), None)

    def evaluate(self, model, device, world=1, rank=0):
        return {}

    def save(self, folder):
        pass


def base_config(shape: Dict[str, Any], device: str, total_steps: int) -> TrainConfig:
    """The config every column starts from: the shape's encoders and head, the trainer's defaults
    for the rest (AdamW, lr schedule, grad_clip 1.0, backend auto). The vocabulary and row length
    come from the task (`tasks.model_config`); `data` names no corpus, none is read."""
    model = ModelConfig(n_layer=shape["n_layer"], d_model=shape["d_model"], n_head=shape["n_head"],
                        head_hidden=shape["head_hidden"], head_layers=shape["head_layers"], head_activation="relu")
    return TrainConfig(data="synthetic", max_len=shape["T"] + 2, model=model,
                       batch_size=shape["batch"], steps=total_steps, device=device, progress=False)


def column_config(column: Column, base: TrainConfig, sets: List[str]) -> TrainConfig:
    """`base` with the column's fields, then --set (which wins), checked."""
    return apply_sets(apply_overrides(base, column.overrides), sets).check()


def build_column_run(cfg: TrainConfig, task, device: str) -> Run:
    """What `bst_fast.trainer.build_run(cfg, device)` returns, with `task` in place of the config's
    data: the same calls in the same order."""
    torch.manual_seed(cfg.seed)
    cfg = model_config(cfg, task)
    model = build_model(cfg).to(device)
    optimizer, scheduler = build_optimizer(model, cfg)
    if cfg.compile:  # --set compile=true: the encoders compiled as train compiles them (the warm-up compiles)
        compile_encoders(model)
    return Run(cfg, task, model, model, optimizer, scheduler, Objective.from_config(cfg, task.eos_id), device, 1, 0)


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


class StepClock:
    """Marks on the device's timeline, per step: CUDA events on the current stream on a GPU (read
    after one synchronize at the end), the host clock on a CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.steps: List[list] = []  # per step: [((range name, "enter" | "exit"), stamp)]

    def mark(self, label):
        if not self.steps:
            return
        if self.cuda:
            stamp = torch.cuda.Event(enable_timing=True)
            stamp.record()
        else:
            stamp = time.perf_counter()
        self.steps[-1].append((label, stamp))

    def start_step(self):
        self.steps.append([])
        self.mark(("step", "enter"))

    def end_step(self):
        self.mark(("step", "exit"))

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def ranges(self) -> List[Dict[str, float]]:
        """Per step: {range name: ms, summed over its calls}; "step" is the whole step."""
        out = []
        for marks in self.steps:
            opened: Dict[str, list] = {}
            total: Dict[str, float] = {}
            for (name, kind), stamp in marks:
                if kind == "enter":
                    opened.setdefault(name, []).append(stamp)
                else:
                    total[name] = total.get(name, 0.0) + self.ms(opened[name].pop(), stamp)
            out.append(total)
        return out


class PhaseMarks:
    """While the block runs, each record_function range of `train_step` ("forward", "backward",
    "optimizer") and of `BeliefStateTransformer.forward` ("encoders", "pair_loss") also marks
    `clock` at its start and end: the two modules' `record_function` is wrapped (the profiler still
    sees the ranges), and put back on exit."""

    MODULES = ("bst_fast.trainer", "bst_fast.model")

    def __init__(self, clock: StepClock):
        self.clock, self.saved = clock, []

    def __enter__(self):
        for name in self.MODULES:
            module = importlib.import_module(name)
            real = module.record_function  # an AttributeError here: the module no longer names its ranges so
            self.saved.append((module, real))
            module.record_function = self._marked(real)
        return self

    def _marked(self, real):
        clock = self.clock

        @contextlib.contextmanager
        def record_function(name, *args, **kwargs):
            with real(name, *args, **kwargs):
                clock.mark((name, "enter"))
                try:
                    yield
                finally:
                    clock.mark((name, "exit"))
        return record_function

    def __exit__(self, *exc):
        for module, real in self.saved:
            module.record_function = real
        self.saved.clear()


def timed_steps(run: Run, first: int, n: int, nvtx: bool = False) -> StepClock:
    """Runs steps first .. first + n - 1 with phase marks; returns the clock (synchronized). `nvtx`:
    the phases (record_function ranges) and every op also as NVTX ranges, for nsys."""
    clock = StepClock(run.device)
    with PhaseMarks(clock), torch.autograd.profiler.emit_nvtx(enabled=nvtx):
        for step in range(first, first + n):
            clock.start_step()
            train_step(run, step)
            clock.end_step()
    synchronize(run.device)
    return clock


def phase_table(per_step: List[Dict[str, float]]) -> Dict[str, Optional[float]]:
    """Median ms per phase over the steps: the model's ranges ("encoders" holds the BST's reversal
    of rows too), the rest of the forward (the GPT's whole forward; the BST's batch checks, its GPT
    head's loss and the objective's wrapper), backward, optimizer (clipping, AdamW, the schedule)
    and other (the batch and its copy to the device, seeding, zero_grad)."""
    def med(values):
        return statistics.median(values) if values else None

    rows = []
    for r in per_step:
        inner = r.get("encoders", 0.0) + r.get("pair_loss", 0.0)
        outer = r.get("forward", 0.0) + r.get("backward", 0.0) + r.get("optimizer", 0.0)
        rows.append({**r, "forward_rest": r.get("forward", 0.0) - inner, "other": r["step"] - outer})
    out = {ph: med([r[ph] for r in rows if ph in r]) for ph in PHASES}
    out["forward"] = med([r["forward"] for r in rows if "forward" in r])
    out["step"] = med([r["step"] for r in rows])
    return out


def step_flops(cfg: TrainConfig, B: int, L: int, pairs_per_step: float) -> float:
    """Model FLOPs of one training step (forward + backward: 3 x 2 per multiply-add): the encoders'
    6 N per token (N their non-embedding parameters) plus nanoGPT's attention term 12 n_layer m L;
    the LM / GPT head; the pair head's per-token first layer (TextHead) or gate/up projection
    (SwiGLU) and its per-pair GEMMs (`pairs_per_step` pairs). Norms, activations, softmax and the
    optimizer are not counted."""
    mc = cfg.model
    m, V, tokens = mc.d_model, mc.vocab_size, B * L
    hidden = max(1, int(round(mc.mlp_ratio * m)))
    per_layer = 4 * m * m + 2 * m * hidden  # qkv, proj, the MLP's two layers
    encoder = 6 * mc.n_layer * per_layer * tokens + 12 * mc.n_layer * m * L * tokens
    if cfg.method != "bst":
        return encoder + 6 * m * V * tokens
    flops = encoder * (2 if mc.backward_encoder else 1)
    if cfg.gamma > 0:
        flops += 6 * m * V * tokens
    if mc.head_type == "swiglu":
        from bst_fast.head import swiglu_hidden

        H = swiglu_hidden(m)
        per_token, per_pair = 2 * m * 2 * H, H * 2 * m + 2 * m * V  # [gate | up] from f and b; Down, lm_head x 2
    else:
        widths = [mc.head_hidden] * (mc.head_layers - 1) if isinstance(mc.head_hidden, int) else list(mc.head_hidden)
        sizes = [2 * m, *widths, 2 * V]
        per_token = 2 * m * sizes[1]  # the first layer, split into f's and b's parts
        per_pair = sum(a * b for a, b in zip(sizes[1:-1], sizes[2:]))
    return flops + 6 * per_token * tokens + 6 * per_pair * pairs_per_step


def profile_steps(run: Run, first: int, n: int, trace_base: Path, record_shapes: bool = False) -> str:
    """Steps first .. first + n - 1 under torch.profiler: writes trace_base + '.trace.json' (chrome
    trace) and returns the top-op table."""
    cuda = run.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(run.device)
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for step in range(first, first + n):
            train_step(run, step)
        synchronize(run.device)
    trace_base.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace_base) + ".trace.json")
    try:
        return prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=30)
    except Exception as e:  # a profiler that names its columns otherwise: the trace is what matters
        return f"(no table: {type(e).__name__}: {e})"


def cleanup(device: str):
    """Frees what a column held, and torch.compile's caches: Dynamo keeps its code cache across model
    instances, so a later column of another batch size would recompile with a dynamic batch
    dimension (a graph no `bst_fast.train` run compiles, its figures depending on the columns before)."""
    gc.collect()
    torch.compiler.reset()
    if device == "cuda":
        torch.cuda.empty_cache()


def triton_cache_entries() -> Optional[int]:
    """Kernels in Triton's on-disk cache (a folder each), or None where there is none: a count that
    grows during the timed steps means a kernel compiled there (Triton specialises integer arguments
    on their divisibility by 16, so a subsample's counts may meet a new variant late)."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        return sum(1 for _ in folder.iterdir())
    except OSError:
        return None


def measure(column: Column, cfg: TrainConfig, task, device: str, steps: int, warmup: int,
            trace_dir: Optional[Path], profile_n: int, nvtx: bool = False) -> Dict[str, Any]:
    """One column: build, warm up, time, optionally profile."""
    pairs_bench = bench_module("pairs")
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_mb = torch.cuda.memory_allocated() / 2**20
    # CPU memory: the RSS growth over building and warming up (its sampling thread stays off the timed steps)
    with (contextlib.nullcontext() if cuda else pairs_bench.PeakMemory("cpu")) as mem:
        run = build_column_run(cfg, task, device)
        for step in range(warmup):
            train_step(run, step)
        synchronize(device)
    tokens0, pairs0 = run.tokens_seen, run.pairs_seen
    kernels0 = triton_cache_entries()
    t0 = time.perf_counter()
    clock = timed_steps(run, warmup, steps, nvtx)
    wall = time.perf_counter() - t0
    kernels1 = triton_cache_entries()
    loss = float(train_step(run, warmup + steps))  # one more step, whose loss is read (a sync)
    tokens = (run.tokens_seen - tokens0) / (steps + 1)
    pairs = (run.pairs_seen - pairs0) / (steps + 1)
    synchronize(device)
    per_step = clock.ranges()
    phases = phase_table(per_step)
    step_ms = [r["step"] for r in per_step]
    it_s = 1e3 / statistics.median(step_ms)
    flops = step_flops(run.cfg, cfg.batch_size, task.max_len, pairs)
    out = dict(
        it_per_s=it_s, it_per_s_wall=steps / wall, step_ms_median=statistics.median(step_ms), step_ms=step_ms,
        tokens_per_step=tokens, tokens_per_s=tokens * it_s, pairs_per_step=pairs, pairs_per_s=pairs * it_s,
        tflop_per_step=flops / 1e12, tflops=flops * it_s / 1e12,
        peak_mem_mb=(torch.cuda.max_memory_allocated() / 2**20) if cuda else mem.growth / 2**20,
        peak_mem_kind="cuda max_memory_allocated" if cuda else "cpu RSS growth (build + warm-up)",
        base_mem_mb=base_mb if cuda else None,
        params=sum(p.numel() for p in run.model.parameters()), loss=loss, phases_ms=phases,
        # kernels Triton compiled during the timed steps (None: no cache folder): more than 0 means
        # a timed step paid a compile; the median keeps it out, the whole loop's it/s does not
        triton_compiles_timed=None if kernels0 is None or kernels1 is None else kernels1 - kernels0,
        config=run.cfg.to_dict(),
    )
    if cuda:
        out["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / 2**20
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is not finite ({loss})")
    if trace_dir is not None and profile_n > 0:
        table = profile_steps(run, warmup + steps + 1, profile_n, trace_dir / column.slug)
        (trace_dir / f"{column.slug}.txt").write_text(f"# {column.name}: {profile_n} steps\n{table}\n")
        out["trace"] = str(trace_dir / f"{column.slug}.trace.json")
    return out


def parse_variant(text: str) -> Tuple[str, Dict[str, Any], List[str]]:
    """--variant NAME=KEY=VALUE[,KEY=VALUE...] -> (NAME, Switches changes, config sets); a ValueError
    names what is wrong. A KEY is a runtime switch, with 1/0 (true/false) for the on/off switches and
    an int (or none) for the others, or a config field (a TrainConfig field, or model.<field>), whose
    KEY=VALUE is a `--set` (checked with the columns' configs)."""
    name, sep, rest = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "default":
        raise ValueError(f"--variant {text!r}: expected NAME=SWITCH=VALUE[,SWITCH=VALUE...], NAME of letters, "
                         f"digits, '_', '.' or '-' and not 'default'")
    fields = {f.name: f for f in dataclasses.fields(runtime.Switches)}
    config_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model"}
    changes: Dict[str, Any] = {}
    sets: List[str] = []
    for item in rest.split(","):
        key, sep, value = item.partition("=")
        if sep and (key in config_fields or key.startswith("model.")):
            sets.append(item)
            continue
        if not sep or key not in fields:
            raise ValueError(f"--variant {text!r}: {item!r} is not KEY=VALUE with KEY a switch, one of "
                             f"{sorted(fields)}, or a config field (a TrainConfig field or model.<field>)")
        kind, optional = runtime.switch_kind(fields[key])
        if optional and value.lower() == "none":
            changes[key] = None
        elif kind == "bool":  # triton_ops too (None, True or False)
            if value.lower() not in ("1", "0", "true", "false"):
                raise ValueError(f"--variant {text!r}: {key} takes 1 or 0{' (or none)' if optional else ''}, got {value!r}")
            changes[key] = value.lower() in ("1", "true")
        else:
            try:
                changes[key] = int(value)
            except ValueError:
                raise ValueError(f"--variant {text!r}: {key} takes an int, got {value!r}") from None
    try:  # the switches' own checks (vocab_pad=-4), before any column runs
        dataclasses.replace(runtime.Switches(), **changes)
    except ValueError as e:
        raise ValueError(f"--variant {text!r}: {e}") from None
    return name, changes, sets


def run_column(column: Column, cfg: TrainConfig, task, device: str, steps: int, warmup: int,
               trace_dir: Optional[Path], profile_n: int, variant: Optional[str] = None,
               nvtx: bool = False) -> Dict[str, Any]:
    """measure(), or the column with its error (the other columns still run). `variant`: the name of
    the --variant whose switches are in force and whose config fields `cfg` holds."""
    if variant is not None:
        column = dataclasses.replace(column, name=f"{column.name} [{variant}]", slug=f"{column.slug}+{variant}")
    head = dict(name=column.name, slug=column.slug, variant=variant, paper_it_per_s=column.paper_it_per_s,
                predicted_it_per_s=None if variant else column.predicted_it_per_s, error=None,
                it_per_s=None, tokens_per_s=None, peak_mem_mb=None, phases_ms=None,
                switches=dataclasses.asdict(runtime.SWITCHES))
    print(f"== {column.name}", flush=True)
    try:
        result = {**head, **measure(column, cfg, task, device, steps, warmup, trace_dir, profile_n, nvtx)}
    except Exception as e:  # out of memory included: report it, free what the column held, go on
        traceback.print_exc()
        result = {**head, "error": f"{type(e).__name__}: {str(e)[:500]}", "config": cfg.to_dict()}
    cleanup(device)
    return result


def card_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def fmt(v, spec=".3g", none="-"):
    return none if v is None else format(v, spec)


def _levers_line(switches: Dict[str, Any]) -> str:
    """The runtime switches (docs/backends.md) this run changed from their defaults, named."""
    default = dataclasses.asdict(runtime.Switches())
    on = [f"{k}={v}" for k, v in switches.items() if v != default[k]]
    return f" Switches changed: `{' '.join(on)}`." if on else ""


def markdown(meta: Dict[str, Any], columns: List[Dict[str, Any]]) -> str:
    s = meta["shape"]
    lines = [
        "# The paper's Table 3 with bst_fast (`bench/paper_speed.py`)", "",
        f"{meta['device']}, torch {meta['torch']}" + (f", CUDA {meta['cuda']}" if meta["cuda"] else "")
        + (f", Triton {meta['triton']}" if meta["triton"] else "") + f", {meta['precision']}. "
        f"Shape `{meta['shape_name']}`: V = {s['vocab']}, T = {s['T']} (rows of {s['T'] + 2} with BOS/EOS), "
        f"batch {s['batch']}, encoders {s['n_layer']} x {s['d_model']} ({s['n_head']} heads), TextHead "
        f"{s['head_layers']} x {s['head_hidden']} relu; median of {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up steps, each through `bst_fast.trainer.train_step`."
        + (f" Config changes: `{' '.join(meta['sets'])}`." if meta["sets"] else "")
        + _levers_line(meta["switches"])
        + "".join(f" Variant `{n}`: each column it applies to (every column for a config field, the BST "
                  "columns for switches) run again right after, in this process, with `"
                  + " ".join(f"{k}={v}" for k, v in c.items()) + "`." for n, c in meta.get("variants", {}).items()), "",
    ]
    if meta["device_type"] != "cuda":
        lines += [f"A CPU run (torch threads: {meta['threads']}): not comparable with the paper's H100 figures "
                  "(x paper is given at --shape paper only).", ""]
    predicted = meta["shape_name"] == "paper"
    lines += ["| | paper, it/s (one H100) | " + ("predicted, it/s (H100) | " if predicted else "")
              + "bst_fast, it/s | x paper | it/s, whole loop | ms/step | tokens/s | peak memory, MB | model TFLOP/s |",
              "| --- " * (9 + predicted) + "|"]
    for c in columns:
        lo_hi = c["predicted_it_per_s"]
        pred = (f"{lo_hi[0]:g}-{lo_hi[1]:g} | " if lo_hi else "- | ") if predicted else ""
        if c["error"]:
            error = " ".join(c["error"][:200].replace("|", "/").split())
            lines.append(f"| {c['name']} | {fmt(c['paper_it_per_s'])} | {pred}failed: {error} | | | | | | |")
            continue
        ratio = c["it_per_s"] / c["paper_it_per_s"] if c["paper_it_per_s"] and meta["shape_name"] == "paper" else None
        lines.append(f"| {c['name']} | {fmt(c['paper_it_per_s'])} | {pred}**{c['it_per_s']:.3g}** | "
                     f"{fmt(ratio, '.1f')}{'x' if ratio else ''} | {c['it_per_s_wall']:.3g} | "
                     f"{c['step_ms_median']:.1f} | {c['tokens_per_s']:.3g} | {fmt(c['peak_mem_mb'], '.0f')} | "
                     f"{c['tflops']:.3g} |")
    by_slug = {c["slug"]: c for c in columns}
    ratios = [f"{c['name']} {c['it_per_s'] / base['it_per_s']:.3f}x" for c in columns
              if c.get("variant") and not c["error"]
              and not (base := by_slug.get(c["slug"].split("+")[0], {})).get("error", True)]
    if ratios:
        lines += ["", "Each variant's it/s over its column's with the switches and config in force (one run each, back to "
                  "back, not interleaved: indicative; bench/levers.py interleaves its reps): " + ", ".join(ratios) + "."]
    lines += ["", "Phases, ms (medians over the timed steps; \"pair loss\" includes the loss's gradient, which the "
              "fused backends compute in the forward; \"encoders\" holds the BST's row reversal; \"rest of forward\" "
              "is the GPT's whole forward, the BST's batch checks and GPT head's loss; \"other\": the batch, its "
              "copy to the device, zero_grad):", "",
              "| | encoders | pair loss | rest of forward | backward | optimizer | other | step |",
              "| --- " * 8 + "|"]
    for c in columns:
        if c["error"]:
            continue
        p = c["phases_ms"]
        lines.append(f"| {c['name']} | " + " | ".join(fmt(p[k], '.1f') for k in (*PHASES, "step")) + " |")
    counts = [f"{c['name']} {c['pairs_per_step']:.4g}" for c in columns if not c["error"] and c["pairs_per_step"]]
    if counts:
        lines += ["", "Pairs per step: " + ", ".join(counts) + "."]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="Columns: " + ", ".join(c.slug for c in COLUMNS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: paper on cuda, cpu on the CPU")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 20, tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: paper 3, cpu 2, tiny 1)")
    ap.add_argument("--columns", nargs="+", default=[c.slug for c in COLUMNS], choices=[c.slug for c in COLUMNS])
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="a config field for every column, as `bst_fast train --set` takes it (wins over the column's)")
    ap.add_argument("--out", default=None, help="folder of paper_speed.json/.md (default bench/results/<card>)")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="also write a torch.profiler trace of each column here")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps profiled per column with --trace")
    ap.add_argument("--nvtx", action="store_true",
                    help="the timed steps' phases and ops also as NVTX ranges (cuda; run under nsys)")
    ap.add_argument("--variant", dest="variants", action="append", default=[],
                    metavar="NAME=KEY=VALUE[,KEY=VALUE]",
                    help="also run each BST column with these runtime switches (docs/backends.md, Levers) right "
                         "after its run with the switches in force: levers side by side in one process, e.g. "
                         "--variant fused=fused_ce=1,relu_in_gemm=1 (the GPT column has no pair loss: once; a variant of "
                         "host_pairs/device_sampler alone runs the subsampled columns only); a KEY that is a config "
                         "field (model.activation_checkpointing=true) runs every column that takes it again with it "
                         "(the BST's objective fields: the BST columns)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (on a shared CPU small shapes run faster on 1)")
    a = ap.parse_args(argv)
    if a.threads is not None:
        if a.threads < 1:
            ap.error("--threads must be >= 1")
        torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but this torch sees no CUDA device")
    if a.nvtx and a.device != "cuda":
        ap.error("--nvtx needs --device cuda")
    shape_name = a.shape or ("paper" if a.device == "cuda" else "cpu")
    shape = SHAPES[shape_name]
    steps = shape["steps"] if a.steps is None else a.steps
    warmup = shape["warmup"] if a.warmup is None else a.warmup
    if steps < 1 or warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    columns = [c for c in COLUMNS if c.slug in a.columns]
    try:
        variants = [parse_variant(v) for v in a.variants]
    except ValueError as e:
        ap.error(str(e))
    if len({n for n, _, _ in variants}) < len(variants):
        ap.error("--variant: two variants have one name")
    base = base_config(shape, a.device, warmup + steps + 1 + a.profile_steps)
    try:  # every column's config first (then its variants'): a bad --set fails before anything runs
        configs = [column_config(c, base, a.sets) for c in columns]
    except ValueError as e:
        ap.error(str(e))
    # a config variant runs on the columns that take it (the BST's objective fields: not on GPT's,
    # which refuses them), and is an error that names it where no column does
    variant_configs: Dict[Tuple[str, str], TrainConfig] = {}
    for n, _, sets in variants:
        refused = {}
        for c in columns if sets else ():
            try:
                variant_configs[c.slug, n] = column_config(c, base, a.sets + sets)
            except ValueError as e:
                refused[c.name] = str(e)
        if refused and len(refused) == len(columns):
            ap.error(f"--variant {n}: no column takes it: " + "; ".join(f"{k}: {v}" for k, v in refused.items()))
        for name, why in refused.items():
            print(f"--variant {n} skips the {name} column: {why}", flush=True)

    if a.device == "cuda":
        device = torch.cuda.get_device_name()
    else:
        device = bench_module("pairs").device_name("cpu")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    out = Path(a.out) if a.out else RESULTS / card_slug(device)
    out.mkdir(parents=True, exist_ok=True)
    trace_dir = Path(a.trace) if a.trace else None
    meta = dict(device=device, card=card_slug(device), device_type=a.device, torch=torch.__version__,
                cuda=torch.version.cuda if a.device == "cuda" else None, triton=triton_version,
                threads=torch.get_num_threads(),
                precision="bf16 autocast (the trainer's)" if a.device == "cuda" else "float32 (the trainer's)",
                shape_name=shape_name, shape={k: v for k, v in shape.items() if k not in ("steps", "warmup")},
                steps=steps, warmup=warmup, sets=a.sets, data="SyntheticText: random ids, every row full",
                variants={n: {**c, **dict(s.split("=", 1) for s in sets)} for n, c, sets in variants},
                switches=dataclasses.asdict(runtime.SWITCHES))  # the levers in force (docs/backends.md)
    print(f"device: {device}  torch {torch.__version__}  shape {shape_name}  {steps} timed steps after {warmup}",
          flush=True)
    task = SyntheticText(shape["vocab"], shape["T"])
    if a.device == "cpu" and configs:
        # the process's one-off growth (allocator arenas, libraries set up lazily at a first step) paid
        # here, untimed: the first column's RSS growth would hold it, and no other column's does
        with contextlib.suppress(Exception):  # a column that fails says so when it runs
            train_step(build_column_run(configs[0], task, a.device), 0)
    results: List[Dict[str, Any]] = []
    for column, cfg in zip(columns, configs):
        # a variant of config fields runs every column that takes it; of switches alone, the BST columns
        # (the GPT column has no pair loss), and of the subsample's switches alone, the subsampled ones
        applies = [(n, c, sets) for n, c, sets in variants if (column.slug, n) in variant_configs
                   or not sets and column.slug != "gpt" and not (cfg.pairs is None and set(c) <= SUBSAMPLE_SWITCHES)]
        for variant, changes, _ in [(None, {}, [])] + applies:
            with runtime.switched(**changes):
                results.append(run_column(column, variant_configs.get((column.slug, variant), cfg), task,
                                          a.device, steps, warmup, trace_dir, a.profile_steps, variant, a.nvtx))
            r = results[-1]
            if not r["error"]:
                print(f"   {r['it_per_s']:.3g} it/s (whole loop {r['it_per_s_wall']:.3g}), "
                      f"{r['tokens_per_s']:.3g} tokens/s, peak {fmt(r['peak_mem_mb'], '.0f')} MB, "
                      f"{r['tflops']:.3g} TFLOP/s, loss {r['loss']:.4f}", flush=True)
            # written after every column, each file whole (gpu.sh kills a step at its timeout): a run cut
            # short keeps what it finished
            for name, text in (("paper_speed.json", json.dumps(dict(meta, columns=results), indent=1)),
                               ("paper_speed.md", markdown(meta, results))):
                (out / f"{name}.part").write_text(text)
                (out / f"{name}.part").replace(out / name)
    print("\n" + markdown(meta, results))
    print(f"wrote {out / 'paper_speed.json'} and {out / 'paper_speed.md'}")
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
