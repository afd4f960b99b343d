"""Training engine: exact resume, DDP equals one process, checkpoints, config and fault handling."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bst_fast import TrainConfig, load_model, train
from bst_fast.checkpoint import latest_checkpoint
from bst_fast.files import sha256
from bst_fast.run_folder import MARKER
from _helpers import DDP_SCRIPT_END, star_fields_for, torchrun

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"


def tiny(tmp_path, **changes):
    d = TrainConfig.load(TINY).to_dict()
    d.update(out_dir=str(tmp_path), **{**star_fields_for(changes.get("data", "star")), **changes})
    return TrainConfig.from_dict(d)


def same_params(a, b):
    ma, _ = load_model(a)
    mb, _ = load_model(b)
    return {k: (v, mb.state_dict()[k]) for k, v in ma.state_dict().items()}


@pytest.mark.parametrize("method", ["bst", "forward"])
def test_resume_is_bitwise_exact(tmp_path, method):
    # Dropout and subsampled pairs make every step random: resume must replay the same draws.
    model = {"n_layer": 1, "d_model": 16, "n_head": 2, "head_hidden": 16, "dropout": 0.1}
    pairs = {"pairs": 0.5} if method == "bst" else {}  # a forward-only model reads no pairs (and refuses the field)
    full = tiny(tmp_path / "full", method=method, ckpt_every=0, **pairs, model=model)
    train(full)
    cut = tiny(tmp_path / "cut", method=method, ckpt_every=0, **pairs, model=model)
    train(cut, stop_at=4)
    train(cut, resume=True)
    params = same_params(tmp_path / "full", tmp_path / "cut")
    assert all(torch.equal(x, y) for x, y in params.values())
    # And the run really changed the parameters: resume is not trivially exact.
    fresh = tiny(tmp_path / "fresh", method=method, ckpt_every=0, steps=1, model=model)
    train(fresh)
    moved = same_params(tmp_path / "full", tmp_path / "fresh")
    assert any(not torch.equal(x, y) for x, y in moved.values())


@pytest.mark.parametrize("head_type", ["mlp", "swiglu"])
def test_ddp_two_processes_equal_one(tmp_path, head_type):
    """Two DDP ranks give one process's parameters: the TextHead (cpp backend) and the official
    SwiGLU head (the torch backend, whose gradients are computed in the loss's forward). The DDP
    run stops at step 5, between logged steps, and resumes: its step-6 loss row still averages
    both ranks' steps 5 and 6 (each rank's share of the open interval is in the checkpoint). The mlp
    case takes two micro-batches a step (grad_accum 2): DDP must average at the last one (review
    helper-78: averaging at the first left the ranks 0.92 apart, unseen with grad_accum 1). The
    swiglu case's DDP ranks recompute their encoder blocks in the backward
    (model.activation_checkpointing), the one process does not: the same numbers under DDP too. The
    ranks' process group has its own timeout (ddp_timeout)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    accum = 2 if head_type == "mlp" else 1
    sets = ["--set", "ckpt_every=0", "--set", f"model.head_type={head_type}", "--set", f"grad_accum={accum}"]
    base = [sys.executable, "-m", "bst_fast", "train", "--config", str(TINY)] + sets
    subprocess.run(base + ["--set", f"out_dir={tmp_path / 'one'}"], check=True, env=env, capture_output=True,
                   timeout=300)
    legs = tmp_path / "legs.py"
    legs.write_text("import bst_fast, sys\n"
                    f"kw = dict(ckpt_every=0, grad_accum={accum}, out_dir={str(tmp_path / 'two')!r}, ddp_timeout=240, "
                    f"**{{'model.head_type': {head_type!r}, 'model.activation_checkpointing': {head_type == 'swiglu'}}})\n"
                    f"bst_fast.train({str(TINY)!r}, stop_at=5, **kw)\n"
                    f"bst_fast.train({str(TINY)!r}, resume=True, **kw)\n" + DDP_SCRIPT_END)
    ddp = torchrun(legs)
    run = subprocess.run(ddp, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]

    def loss_rows(run):
        lines = (tmp_path / run / "metrics.csv").read_text().splitlines()[1:]
        return {int(s): float(v) for s, k, v in (line.split(",") for line in lines) if k == "loss"}
    one, two = loss_rows("one"), loss_rows("two")
    assert load_model(tmp_path / "two")[1].model.activation_checkpointing == (head_type == "swiglu")
    assert sorted(one) == sorted(two) == [2, 3, 4, 6]
    assert all(abs(one[s] - two[s]) <= 1e-5 * abs(one[s]) for s in one), (one, two)
    params = same_params(tmp_path / "one", tmp_path / "two")
    d = 16  # model.d_model of the tiny config
    for name, (x, y) in params.items():
        if name.endswith("qkv.bias"):
            # attention ignores a key bias (it shifts every score of a query alike): its gradient is
            # rounding noise, which AdamW turns into lr-sized steps of any sign; compare q and v
            keep = torch.ones_like(x, dtype=torch.bool)
            keep[d : 2 * d] = False
            x, y = x[keep], y[keep]
        assert float((x - y).abs().max() / (y.abs().max() + 1e-12)) < 1e-5, name


def test_ddp_ranks_agree_on_the_folder_and_on_rank_0_faults(tmp_path):
    """Rank 0 alone reads the run folder and saves: a rank reaching the folder check after rank 0
    wrote the run's files still starts, and weights that overflow at a save stop every rank with
    rank 0's TrainingStopped (rank 1 used to wait in the next all-reduce)."""
    legs = tmp_path / "legs.py"
    legs.write_text(f"""
import os, sys, time
import torch.distributed as dist
import bst_fast
rank = int(os.environ["RANK"])
say = lambda line: os.write(1, (line + "\\n").encode())  # one write: the ranks' lines never interleave
dist.init_process_group("gloo")
if rank == 1:
    time.sleep(3)  # rank 0 has checked, claimed and written the folder by now
r = bst_fast.train({str(TINY)!r}, out_dir={str(tmp_path / 'late')!r}, ckpt_every=0)
say(f"rank {{rank}} trained: path_accuracy {{r['path_accuracy']!r}}")
try:
    bst_fast.train({str(TINY)!r}, out_dir={str(tmp_path / 'nf')!r}, lr=3.4e38, beta1=0.0, min_lr=0.0,
                   weight_decay=1.0, steps=3, ckpt_every=1, warmup=0)
except bst_fast.TrainingStopped as e:
    say(f"rank {{rank}} stopped: {{e}}")
import bst_fast.tasks as tasks
import bst_fast.trainer as trainer
from bst_fast.run_folder import MetricsLog

def fault(label, owner, name, on_rank, message, out):
    # one run with owner.name raising on rank on_rank only; each rank prints how it ended
    real = getattr(owner, name)
    def broken(*a, **k):
        raise (OSError(28, message) if label == "log" else ValueError(message))
    if rank == on_rank:
        setattr(owner, name, broken)
    try:
        bst_fast.train({str(TINY)!r}, out_dir=out, ckpt_every=0, steps=2)
    except Exception as e:
        say(f"rank {{rank}} {{label}}: {{type(e).__name__}}: {{e}}")
    setattr(owner, name, real)

# rank 1's share of the evaluation fails: rank 0 must not wait for it
fault("evaluation", tasks, "sample", 1, "decoder fault on rank 1", {str(tmp_path / 'evalfault')!r})
# rank 1's first batch fails before the folder is claimed: no rank claims it
fault("build", trainer.Run, "batch", 1, "batch fault on rank 1", {str(tmp_path / 'buildfault')!r})
# rank 0 cannot write metrics.csv
fault("log", MetricsLog, "log", 0, "No space left on device", {str(tmp_path / 'logfault')!r})
# this script started the group, so the trainer's exit hook (which ends a group it started) does not
""" + DDP_SCRIPT_END)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = torchrun(legs)
    run = subprocess.run(ddp, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # each rank decoded half the test graphs; every rank holds the sum, one process's figure
    from bst_fast.tasks import StarTask

    model, cfg = load_model(tmp_path / "late")
    want = StarTask(cfg).evaluate(model, "cpu")["path_accuracy"]
    assert {f"rank 0 trained: path_accuracy {want!r}", f"rank 1 trained: path_accuracy {want!r}"} <= set(lines), \
        (want, run.stdout)
    stops = {line.split(" ", 2)[1]: line.split(": ", 1)[1] for line in lines if " stopped: " in line}
    assert "the last good checkpoint is" in stops["0"] and stops["1"] == "rank 0 stopped the run: " + stops["0"], \
        run.stdout
    assert "rank 1 evaluation: ValueError: decoder fault on rank 1" in lines, run.stdout
    assert "rank 0 evaluation: ValueError: rank 1 stopped the run: decoder fault on rank 1" in lines, run.stdout
    assert {"rank 1 build: ValueError: batch fault on rank 1",
            "rank 0 build: ValueError: rank 1 stopped the run: batch fault on rank 1"} <= set(lines), run.stdout
    assert not (tmp_path / "buildfault").exists()
    assert "rank 0 log: OSError: [Errno 28] No space left on device" in lines, run.stdout
    assert "rank 1 log: OSError: rank 0 stopped the run: [Errno 28] No space left on device" in lines, run.stdout


def test_star_evaluation_split_across_ranks_adds_up_to_one_process(monkeypatch):
    """Each rank decodes the test graphs rank::world; their right rows and rows add up to one
    process's (also with more ranks than graphs). The decoder is a stub right on some rows."""
    from bst_fast import tasks

    task = tasks.StarTask(tiny("unused"))
    rows = task.test_rows
    start, l = task.test_start, task.data.path_len
    truth = {tuple(r[:start + 1].tolist()): r[start + 1:start + 1 + l] for r in rows}

    def stub(model, prefix, n_new, eos, temperature):
        out = torch.stack([truth[tuple(p.tolist())] for p in prefix])
        out[prefix[:, 1] % 3 == 0] = 0  # wrong on the rows whose second token divides by 3
        return out

    monkeypatch.setattr(tasks, "sample", stub)
    model = torch.nn.Linear(1, 1)
    whole = task.evaluate(model, "cpu")["path_accuracy"]
    want = sum(int(r[1]) % 3 != 0 for r in rows)
    assert 0 < want < len(rows) and whole == want / len(rows)
    for world in (2, 3, len(rows) + 2):
        shares = []
        monkeypatch.setattr(tasks, "sum_over_ranks", lambda values, device, w, failure=None: shares.append(values) or [1, 1])
        for rank in range(world):
            task.evaluate(model, "cpu", world, rank)
        assert [sum(s[k] for s in shares) for k in (0, 1)] == [want, len(rows)], world


def test_checkpoints_are_kept_and_named(tmp_path):
    train(tiny(tmp_path, steps=6, ckpt_every=2, keep_checkpoints=2))
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000004", "step-00000006"]
    assert (root / "latest").read_text() == "step-00000006"
    assert not list(root.glob("*.tmp"))
    cfg = json.loads((root / "step-00000006" / "config.json").read_text())
    assert cfg["steps"] == 6


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    train(tiny(tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "step-00000006"
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        load_model(ckpt)
    train(tiny(tmp_path / "b"))
    bigger = tiny(tmp_path / "b", steps=8, model={"n_layer": 1, "d_model": 32, "n_head": 2, "head_hidden": 16})
    with pytest.raises(ValueError, match="another config.*model.d_model"):
        train(bigger, resume=True)
    with pytest.raises(ValueError, match="no checkpoint"):
        train(tiny(tmp_path / "empty"), resume=True)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    from bst_fast import model as model_mod

    real = model_mod.BeliefStateTransformer.forward
    calls = {"n": 0}

    def poisoned(self, *a, **k):
        out = real(self, *a, **k)
        calls["n"] += torch.is_grad_enabled()  # training steps (not the start's check of the backend)
        if calls["n"] > 4:  # steps 5 and on
            out["total"] = out["total"] * float("nan")
        return out

    monkeypatch.setattr(model_mod.BeliefStateTransformer, "forward", poisoned)
    cfg = tiny(tmp_path, steps=8, ckpt_every=4, log_every=2, eval_every=0)
    with pytest.raises(RuntimeError, match="non-finite.*step-00000004"):
        train(cfg)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-00000004"


@pytest.mark.parametrize("bad, field", [
    ({"stepz": 3}, "stepz"),
    ({"steps": "many"}, "steps"),
    ({"lr": True}, "lr"),
    ({"model": {"n_layr": 2}}, "model.n_layr"),
    ({"model": 3}, "model"),
    ({"pairs": "half"}, "pairs"),
])
def test_malformed_config_names_the_field(bad, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        TrainConfig.from_dict(bad)


@pytest.mark.parametrize("bad, field", [
    ({"method": "gpt"}, "method"), ({"pairs": 1.5}, "pairs"), ({"steps": 0}, "steps"), ({"min_lr": 1.0}, "min_lr"),
    ({"model": {"n_head": 0}}, "model.n_head"), ({"model": {"n_head": 3}}, "model.n_head"),
    ({"model": {"dropout": 2.0}}, "model.dropout"), ({"model": {"mlp_ratio": -1.0}}, "model.mlp_ratio"),
    ({"model": {"n_layer": -1}}, "model.n_layer"), ({"model": {"head_type": "swigl"}}, "model.head_type"),
    # the head's fields are checked whichever head and method use them: none is silently ignored
    ({"model": {"head_type": "swiglu", "head_hidden": -3}}, "model.head_hidden"),
    ({"method": "forward", "model": {"head_activation": "nope"}}, "model.head_activation"),
    ({"model": {"head_layers": 3, "head_hidden": [8]}}, "model.head_hidden"),
    ({"model": {"head_tie_embedding": True}}, "model.head_tie_embedding"),
])
def test_invalid_config_values_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        TrainConfig.from_dict(bad).check()


def test_config_values_as_written_in_yaml(tmp_path, capsys):
    """YAML 1.1 reads 3e-4 (no dot) as text and 2024 as a number: a float field takes the number,
    a string field the text; null only where the default is None; bad YAML is a clean error."""
    from bst_fast.__main__ import main
    from bst_fast.config import apply_sets as _apply_sets

    cfg = _apply_sets(TrainConfig(), ["lr=3e-4", "data=2024", "out_dir=on", "pairs=null", "model.head_hidden=[8]"])
    assert (cfg.lr, cfg.data, cfg.out_dir, cfg.pairs, cfg.model.head_hidden) == (3e-4, "2024", "on", None, [8])
    (tmp_path / "c.yaml").write_text("lr: 3e-4\nmin_lr: 1E-5\n")
    assert (TrainConfig.load(tmp_path / "c.yaml").lr, TrainConfig.load(tmp_path / "c.yaml").min_lr) == (3e-4, 1e-5)
    for bad, field in (("steps=null", "steps"), ("lr=fast", "lr"), ("x=[1,", "x"),
                       ("lr=.nan", "lr"), ("beta2=1.0", "beta2"), ("seed=-1", "seed")):
        assert main(["train", "--config", str(TINY), "--set", bad]) == 2, bad
        assert field in capsys.readouterr().err, bad
    (tmp_path / "bad.yaml").write_text("steps: [1,\n")
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["train", "--config", str(TINY), "--set", "device=cuda", "--set", f"out_dir={tmp_path / 'c'}"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("text, field, written", [("steps: 010", "steps", "010"), ("seed: 0x1f", "seed", "0x1f"),
                                                   ("batch_size: 1:04", "batch_size", "1:04"),
                                                   ("lr: 1:30.0", "lr", "1:30.0"), ("steps: 0b11", "steps", "0b11")])
def test_a_config_file_reads_numbers_in_decimal_only(tmp_path, text, field, written):
    """YAML 1.1 read `steps: 010` as 8, `0x1f` as 31 and `1:04` as 64 (base 60), silently, where
    --set reads 010 as 10: such a number is now refused, quoted as written."""
    (tmp_path / "c.yaml").write_text(text + "\n")
    with pytest.raises(ValueError, match=f"'{field}' must be (int|float), got '{re.escape(written)}'"):
        TrainConfig.load(tmp_path / "c.yaml")
    (tmp_path / "ok.yaml").write_text("steps: 1_000\nseed: 0\nlr: .5\nmin_lr: 1.0e-6\nout_dir: 010\n")
    cfg = TrainConfig.load(tmp_path / "ok.yaml")
    assert (cfg.steps, cfg.seed, cfg.lr, cfg.min_lr, cfg.out_dir) == (1000, 0, 0.5, 1e-6, "010")


def test_a_config_files_suffix_is_read_whatever_its_case(tmp_path):
    (tmp_path / "c.YAML").write_text("steps: 7\n")
    assert TrainConfig.load(tmp_path / "c.YAML").steps == 7  # was parsed as JSON: "not valid JSON"


def test_fields_the_data_sets_are_refused_when_set_otherwise(tmp_path, capsys):
    """model.vocab_size and model.max_len were accepted and then overwritten by the data's; the star
    graph's size is checked with the config, under the fields' names."""
    from bst_fast.__main__ import main

    for sets, field in ((["model.vocab_size=2"], "model.vocab_size"), (["model.max_len=1000000"], "model.max_len"),
                        (["star_nodes=3"], "star_nodes")):
        assert main(["train", "--config", str(TINY), "--set", f"out_dir={tmp_path / 'r'}", *sum((["--set", x] for x in sets), [])]) == 2
        assert f"'{field}'" in capsys.readouterr().err, sets
    assert not (tmp_path / "r").exists()
    with pytest.raises(TypeError, match="resume must be True or False, got 'false'"):
        train(TINY, out_dir=str(tmp_path / "r"), resume="false")


def test_yaml_and_json_configs_load_the_same(tmp_path):
    cfg = TrainConfig.load(TINY)
    (tmp_path / "c.json").write_text(json.dumps(cfg.to_dict()))
    assert TrainConfig.load(tmp_path / "c.json") == cfg


def test_star_checks_every_config_before_it_prints_or_trains(tmp_path, capsys):
    from bst_fast import experiments

    cfg = TrainConfig.load(TINY)
    cfg.steps, cfg.out_dir = 0, str(tmp_path / "s")
    with pytest.raises(ValueError, match="'steps' must be >= 1"):
        experiments.star(cfg)
    assert capsys.readouterr().out == "" and not (tmp_path / "s").exists()


def test_star_command_prints_both_accuracies(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bst_fast", "star", "--config", str(TINY),
                          "--set", f"out_dir={tmp_path}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    # Each method's row holds numbers, and they are the run's last logged values in its metrics.csv.
    for method in ("bst", "forward"):
        row = re.search(rf"^\| {method} \| (.+) \| (.+) \| (.+) \|$", run.stdout, re.M)
        assert row, f"no table row for {method}: {run.stdout}"
        accuracy, loss, steps_per_s = (float(x) for x in row.groups())
        assert 0.0 <= accuracy <= 1.0 and math.isfinite(loss) and loss > 0 and steps_per_s > 0
        logged = {}
        for line in (tmp_path / method / "metrics.csv").read_text().splitlines()[1:]:
            _, key, value = line.split(",")
            logged[key] = float(value)  # the last row of each key wins
        assert row.group(1) == f"{logged['path_accuracy']:.3f}" and row.group(2) == f"{logged['loss']:.4f}"
    bad = subprocess.run([sys.executable, "-m", "bst_fast", "train", "--config", str(TINY), "--set", "modle.x=1"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "modle.x" in bad.stderr


def test_text_training_end_to_end(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    words = "the cat sat on a mat and the dog ran to the park while it rained".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[int(k)] for k in torch.randint(0, len(words), (int(n),), generator=g))
            for n in torch.randint(5, 40, (60,), generator=g)]
    (corpus / "a.txt").write_text("\n\n".join(docs))
    # A constant learning rate and an evaluation every step: the held-out loss must fall from its
    # first value (after one step, near the untrained model's log V) well below it.
    cfg = tiny(tmp_path / "run", data=str(corpus), text_vocab=300, max_len=24, steps=6, eval_every=1,
               log_every=1, warmup=0, lr=1e-2, min_lr=1e-2)
    result = train(cfg)
    assert (tmp_path / "run" / "tokenizer.json").exists()
    rows = [line.split(",") for line in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]]
    held_out = [float(v) for _, k, v in rows if k == "held_out_loss"]
    losses = [float(v) for _, k, v in rows if k == "loss"]
    assert len(held_out) == len(losses) == 6 and result["held_out_loss"] == held_out[-1]
    vocab = json.loads((tmp_path / "run" / "checkpoints" / "step-00000006" / "config.json").read_text())["model"]["vocab_size"]
    assert held_out[0] > math.log(vocab) - 0.5  # an untrained model guesses about uniformly
    assert held_out[-1] < held_out[0] - 0.3, f"held-out loss did not fall: {held_out}"
    assert losses[-1] < losses[0] - 0.3, f"training loss did not fall: {losses}"


def test_out_dir_holding_a_run_needs_resume_or_overwrite(tmp_path):
    train(tiny(tmp_path))
    with pytest.raises(ValueError, match="already holds a run"):
        train(tiny(tmp_path))
    train(tiny(tmp_path, steps=4), overwrite=True)  # starts over: the old checkpoints are gone
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-00000003", "step-00000004"]


def test_a_failed_start_leaves_the_run_it_would_overwrite(tmp_path):
    """Every check (config, data, model) runs before --overwrite deletes anything: a bad value
    leaves the old run as it was, and a text run that failed to start leaves no tokenizer.json
    that would block the corrected start."""
    train(tiny(tmp_path))
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="'model.n_head'"):
        train(tiny(tmp_path, model={"n_layer": 1, "d_model": 16, "n_head": 3}), overwrite=True)
    with pytest.raises(ValueError, match="batch_size"):  # a data error, raised by the first batch
        train(tiny(tmp_path, n_train=4), overwrite=True)
    assert {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"doc {k} says the cat sat on the mat" for k in range(40)))
    text = dict(data=str(corpus), text_vocab=280, max_len=16, steps=2)
    with pytest.raises(ValueError, match="'model.head_type'"):
        train(tiny(tmp_path / "text", **text, model={"head_type": "swigl"}))
    assert not (tmp_path / "text" / "tokenizer.json").exists()
    train(tiny(tmp_path / "text", **text, model={"n_layer": 1, "d_model": 16, "n_head": 2, "head_type": "swiglu"}))
    assert (tmp_path / "text" / "tokenizer.json").exists()


def test_stop_between_logged_steps_resumes_to_the_same_metrics(tmp_path):
    """stop_at between two logged steps writes no row (an uninterrupted run has none there) and its
    checkpoint keeps the open interval's loss: the resumed run's rows, and what train returns, are
    the uninterrupted run's."""
    kw = dict(steps=8, log_every=4, eval_every=4, ckpt_every=4)
    full = train(tiny(tmp_path / "full", **kw))
    part = train(tiny(tmp_path / "cut", **kw), stop_at=6)
    logged4 = [float(line.split(",")[2]) for line in (tmp_path / "cut" / "metrics.csv").read_text().splitlines()[1:]
               if line.startswith("4,loss,")]
    assert part["loss"] != logged4[0]  # it returns the open interval's mean (steps 5 and 6), not step 4's
    resumed = train(tiny(tmp_path / "cut", **kw), resume=True)

    def rows(run):  # the rows that are functions of the run alone (not of the clock)
        lines = (tmp_path / run / "metrics.csv").read_text().splitlines()[1:]
        return [line for line in lines if line.split(",")[1] in ("loss", "lr", "path_accuracy")]
    assert rows("full") == rows("cut") and [r.split(",")[0] for r in rows("full")].count("6") == 0
    # one line ending throughout (the rows a resume kept were rewritten with "\n", new ones had "\r\n")
    assert all(b"\r" not in (tmp_path / run / "metrics.csv").read_bytes() for run in ("full", "cut"))
    assert {k: full[k] for k in ("loss", "lr", "path_accuracy")} == {k: resumed[k] for k in ("loss", "lr", "path_accuracy")}


def test_stop_at_and_a_finished_run_are_checked(tmp_path):
    with pytest.raises(ValueError, match="stop_at"):
        train(tiny(tmp_path), stop_at=0)
    first = train(tiny(tmp_path))
    # a finished run, resumed, is reported (a requeued job succeeds) with the figures it logged
    assert train(tiny(tmp_path), resume=True) == {"step": 6, **{k: pytest.approx(v) for k, v in first.items()
                                                              if k in ("loss", "lr", "path_accuracy")},
                                                  **{k: pytest.approx(v, rel=1) for k, v in first.items()
                                                     if k.endswith("_per_s")}}
    train(tiny(tmp_path, steps=7), resume=True)  # extending the run is allowed


def test_a_tied_model_refuses_an_untied_checkpoint(tmp_path):
    model = {"n_layer": 1, "d_model": 16, "n_head": 2, "head_type": "swiglu"}
    train(tiny(tmp_path, steps=2, model=model))
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model"]["head_tie_embedding"] = True
    (ckpt / "config.json").write_text(json.dumps(cfg))
    sums = json.loads((ckpt / "checksums.json").read_text())
    (ckpt / "checksums.json").write_text(json.dumps({**sums, "config.json": sha256(ckpt / "config.json")}))
    with pytest.raises(ValueError, match="ties into one tensor"):
        load_model(ckpt)


def test_resume_refuses_a_changed_training_field(tmp_path):
    train(tiny(tmp_path), stop_at=3)
    with pytest.raises(ValueError, match="another config.*'seed'"):
        train(tiny(tmp_path, seed=5), resume=True)
    # the star-graph test set, and so what training excludes, depends on n_test
    with pytest.raises(ValueError, match="another config.*'n_test'"):
        train(tiny(tmp_path, n_test=tiny(tmp_path).n_test + 1), resume=True)
    train(tiny(tmp_path, log_every=1), resume=True)  # logging fields may change


def test_resume_replays_no_metric_rows(tmp_path):
    cfg = tiny(tmp_path, ckpt_every=2, log_every=1, eval_every=0)
    train(cfg, stop_at=4)
    # A run killed after step 5's log line but before its checkpoint: resume from step 4.
    with (tmp_path / "metrics.csv").open("a") as fh:
        fh.write("5,loss,1.0\n")
    train(cfg, resume=True)
    steps = [int(line.split(",")[0]) for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]
             if line.split(",")[1] == "loss"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_table_pins_the_bst_row_and_checks_every_row_first(tmp_path, monkeypatch, capsys):
    import bst_fast.trainer as trainer
    from bst_fast.__main__ import main
    from bst_fast.experiments import TABLE_ROWS

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: seen.append(cfg) or {"path_accuracy": 1.0, "loss": 0.0})
    base = ["--config", str(TINY), "--set", f"out_dir={tmp_path}"]
    # a --set of what each row sets is refused (it was replaced silently), --note without --out too
    for flags, says in ((["--set", "next_weight=1.0"], "--set next_weight: table sets it in each row"),
                        (["--set", "model={backward_encoder: false}"], "--set model.backward_encoder: table"),
                        (["--set", "method=fim"], "--set method"), (["--note", "x"], "give --out too")):
        assert main(["table", *base, *flags]) == 2 and says in capsys.readouterr().err
    assert main(["star", *base, "--set", "method=fim"]) == 2 and "choose them with --methods" in capsys.readouterr().err
    assert not seen
    # a base config file that sets what the rows set is refused, naming the field (every BST row was
    # trained with 0.5 / true instead, silently, under "BST objective: the defaults")
    for line, field in (("next_weight: 0.2", "next_weight"), ("method: forward", "method"),
                        ("model.backward_encoder: false", "model.backward_encoder")):
        ablated = tmp_path / "ablated.yaml"
        ablated.write_text(TINY.read_text() + f"\n{line}\n")
        assert main(["table", "--config", str(ablated), "--set", f"out_dir={tmp_path}"]) == 2
        assert f"config field '{field}' is" in capsys.readouterr().err and not seen
    # the BST objective of the base config reaches the BST rows and is named; the baselines, which do
    # not read it (and refuse it), train without it
    out = tmp_path / "table.md"
    assert main(["table", *base, "--set", "model.n_layer=2", "--set", "pairs=0.5", "--out", str(out)]) == 0
    rows = dict(zip([label for label, _ in TABLE_ROWS], seen))
    assert len(seen) == len(TABLE_ROWS)
    assert rows["BST"].next_weight == 0.5 and rows["BST"].model.backward_encoder and rows["BST"].model.n_layer == 2
    assert rows["BST w/o Prev"].next_weight == 1.0 and not rows["BST w/o backward"].model.backward_encoder
    assert all(cfg.pairs == (0.5 if cfg.method == "bst" else None) for cfg in seen)
    assert out.read_text().count("| 1.000 |") == len(TABLE_ROWS) and "BST objective: pairs=0.5" in out.read_text()
    # a row that cannot run (augment needs an intermediate node) fails before any row trains
    seen.clear()
    assert main(["table", *base, "--set", "star_path_len=2"]) == 2
    assert "augment" in capsys.readouterr().err and not seen


def test_text_resume_checks_the_corpus_and_held_out_loss_ignores_batching(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"doc {k} says the cat sat on the mat {'and ran ' * (k % 7)}" for k in range(40)))
    text = dict(data=str(corpus), text_vocab=280, max_len=16, steps=4, eval_every=0, ckpt_every=2)
    train(tiny(tmp_path / "run", **text), stop_at=2)
    saved = json.loads((tmp_path / "run" / "data.json").read_text())
    assert saved["documents"] == 40 and len(saved["sha256"]) == 64
    corpus.write_text(corpus.read_text() + "\n\none more document")  # the split would change
    with pytest.raises(ValueError, match="not the one this run was trained on"):
        train(tiny(tmp_path / "run", **text), resume=True)
    with pytest.raises(ValueError, match="'text_vocab'"):
        train(tiny(tmp_path / "other", **{**text, "text_vocab": 100}))

    # The held-out loss is the mean over every held-out pair: neither the evaluation's batch size (the
    # training batch size) nor a training subsample of pairs changes it.
    from bst_fast.tasks import TextTask as _TextTask
    model, cfg = load_model(tmp_path / "run")
    figures = []
    for batch_size, pairs in ((1, None), (3, None), (64, None), (3, 0.3), (64, 0.05)):
        task = _TextTask(TrainConfig.from_dict({**cfg.to_dict(), "batch_size": batch_size, "pairs": pairs,
                                                "out_dir": str(tmp_path / "eval")}))
        figures.append(task.evaluate(model, "cpu")["held_out_loss"])
    assert max(figures) - min(figures) < 1e-5 * figures[0], figures


@pytest.mark.parametrize("method", ["bst", "forward"])
def test_eval_batches_scores_the_first_held_out_batches_alone(tmp_path, method):
    """eval_batches N: an evaluation is the held-out loss of the first N batches on their own (their
    pair, token and row counts, row_mean's too), as if the held-out set held those rows only; 0 and
    a cap past the set score every batch. A star run refuses it; a resume may change it; a refusal
    of held-out batches without a pair names it. (Also, on the same corpus: a raw run whose BPE
    cannot reach text_vocab says so.)"""
    from bst_fast.tasks import TextTask as _TextTask

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"doc {k} says the cat sat on the mat {'and ran ' * (k % 7)}" for k in range(80)))
    text = dict(data=str(corpus), text_vocab=280, max_len=16, steps=2, eval_every=0, ckpt_every=2, batch_size=2,
                method=method, **({"reduction": "row_mean"} if method == "bst" else {}))
    train(tiny(tmp_path / "run", **text))
    model, cfg = load_model(tmp_path / "run")
    task = lambda **kw: _TextTask(TrainConfig.from_dict({**cfg.to_dict(), "out_dir": str(tmp_path / "e"), **kw}))
    every = task()
    n = len(list(every.held_out()))
    assert n >= 3 and every.held_out_rows == every.data.n_held_out
    assert task(eval_batches=n + 5).evaluate(model, "cpu") == every.evaluate(model, "cpu")
    first = task(eval_batches=2)
    assert len(list(first.held_out())) == 2 and first.held_out_rows == 4
    got = first.evaluate(model, "cpu")["held_out_loss"]
    assert got != every.evaluate(model, "cpu")["held_out_loss"]
    # the same rows batched otherwise: the same figure (the counts are the rows', not the batches')
    assert task(eval_batches=1, batch_size=4).evaluate(model, "cpu")["held_out_loss"] == pytest.approx(got, rel=1e-6)
    if method == "bst":  # row_mean over the one row scored is that row's mean: its divisor is 1 row
        one = {m: task(eval_batches=1, batch_size=1, reduction=m).evaluate(model, "cpu")["held_out_loss"]
               for m in ("row_mean", "mean")}
        assert one["row_mean"] == pytest.approx(one["mean"], rel=1e-6), one
    with pytest.raises(ValueError, match="eval_batches"):
        train(tiny(tmp_path / "star", eval_batches=2))
    with pytest.raises(ValueError, match="eval_batches"):
        train(tiny(tmp_path / "neg", **text, eval_batches=-1))
    train(tiny(tmp_path / "run", **{**text, "steps": 3}, eval_batches=2), resume=True)
    assert load_model(tmp_path / "run")[1].eval_batches == 2
    # a raw run's BPE asked for more entries than its text gives says so (as tokenize does)
    if method == "forward":
        import contextlib
        import io
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            small = _TextTask(TrainConfig.from_dict({**cfg.to_dict(), "text_vocab": 5000, "out_dir": str(tmp_path / "v")}))
        assert small.vocab_size < 5000 and f"a BPE of vocab 5000 (text_vocab) was asked for, and the text had merges " \
            f"for {small.vocab_size} only" in err.getvalue()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            _TextTask(TrainConfig.from_dict({**cfg.to_dict(), "out_dir": str(tmp_path / "v")}))
        assert "was asked for" not in err.getvalue()
    # held-out batches with no pair: the refusal names eval_batches when it set them
    short = tmp_path / "short.txt"
    short.write_text("\n\n".join("x" if k % 2 else f"doc {k} the cat sat on the mat and ran" for k in range(80)))
    kw = dict(data=str(short), text_vocab=280, max_len=16, batch_size=1, min_gap=4, keep_best="held_out_loss")
    if method == "bst":  # (a BST run: min_gap)
        capped = next(eb for eb in range(1, 20) if not _TextTask(TrainConfig.from_dict(
            {**tiny(tmp_path / "s", **kw).to_dict(), "keep_best": "", "eval_batches": eb})).held_out_empty) - 1
        assert capped >= 1
        _TextTask(tiny(tmp_path / "s", **kw))  # all held-out batches: some pairs
        with pytest.raises(ValueError, match=rf"but the first {capped} held-out batches \(eval_batches; 0 scores"):
            _TextTask(tiny(tmp_path / "s", **kw, eval_batches=capped))
    # a best checkpoint's figure counts for a resume scoring the same rows only
    from bst_fast.checkpoint import best_so_far

    train(tiny(tmp_path / "best", **text, keep_best="held_out_loss"))
    saved = load_model(tmp_path / "best")[1]
    assert best_so_far(tmp_path / "best", "held_out_loss", 2, saved) is not None
    assert best_so_far(tmp_path / "best", "held_out_loss", 2, TrainConfig.from_dict({**saved.to_dict(), "eval_batches": 2})) is None


def test_lr_schedule_uses_each_value_once_and_logs_the_lr_it_used(tmp_path):
    """Warmup reaches lr at its last step, the cosine reaches min_lr at the run's last step, and the
    lr logged for a step is the one that step used; an extended run follows the new schedule."""
    from bst_fast.trainer import lr_lambda as _lr_lambda

    cfg = tiny(tmp_path / "a", steps=6, warmup=3, lr=1e-3, min_lr=1e-4, log_every=1, eval_every=0)
    f = _lr_lambda(cfg)
    used = [1e-3 * f(s) for s in range(6)]
    cos = lambda t: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * t))
    assert used == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, cos(1 / 3), cos(2 / 3), 1e-4], rel=1e-12)
    assert _lr_lambda(tiny(tmp_path, steps=5, warmup=0, lr=1e-3, min_lr=0.0))(0) == 1.0  # no warmup: lr first

    def logged_lr(run):
        rows = [line.split(",") for line in (run / "metrics.csv").read_text().splitlines()[1:]]
        return {int(s): float(v) for s, k, v in rows if k == "lr"}
    train(cfg)
    assert [logged_lr(tmp_path / "a")[s] for s in range(1, 7)] == pytest.approx(used, rel=1e-12)
    # Extended to 12 steps on resume: steps 7.. use the 12-step schedule, as a 12-step run does.
    train(tiny(tmp_path / "a", steps=12, warmup=3, lr=1e-3, min_lr=1e-4, log_every=1, eval_every=0), resume=True)
    f12 = _lr_lambda(tiny(tmp_path, steps=12, warmup=3, lr=1e-3, min_lr=1e-4))
    assert [logged_lr(tmp_path / "a")[s] for s in range(7, 13)] == pytest.approx([1e-3 * f12(s) for s in range(6, 12)],
                                                                                rel=1e-12)


def test_set_values_and_out_dir_errors(tmp_path, capsys):
    from bst_fast.__main__ import main
    from bst_fast.config import apply_sets as _apply_sets

    cfg = _apply_sets(TrainConfig(), ["out_dir=runs/exp #2", "data=notes #1.txt", "seed=010", "pairs=2e-1",
                                      "model.n_layer=03"])
    assert (cfg.out_dir, cfg.data, cfg.seed, cfg.pairs, cfg.model.n_layer) == ("runs/exp #2", "notes #1.txt", 10, 0.2, 3)
    assert _apply_sets(TrainConfig(), ["out_dir='a b'"]).out_dir == "a b"
    assert _apply_sets(TrainConfig(), ["out_dir=null"]).out_dir == "null"  # a folder's name, as written
    (tmp_path / "afile").write_text("x")
    for out in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        assert main(["train", "--config", str(TINY), "--set", f"out_dir={out}"]) == 2
        assert f"{tmp_path / 'afile'} is a file, not a folder" in capsys.readouterr().err
    train(tiny(tmp_path / "run", steps=2))
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    (ckpt / "config.json").write_text('{"steps": 2,\n')
    with pytest.raises(ValueError, match=f"checkpoint {re.escape(str(ckpt))} is corrupt: config.json"):
        train(tiny(tmp_path / "run", steps=3), resume=True)


def test_star_resume_continues_an_interrupted_job(tmp_path):
    """The job stopped after the BST run finished and before the forward-only run wrote a
    checkpoint: --resume reports the finished run and trains the other, instead of stopping at
    'nothing to train'."""
    from bst_fast.__main__ import main

    train(tiny(tmp_path / "bst", method="bst"))
    (tmp_path / "forward").mkdir()
    (tmp_path / "forward" / MARKER).write_text('{"format": 1, "run_id": "killed"}')  # its start marked it
    (tmp_path / "forward" / "metrics.csv").write_text("step,key,value\n1,loss,3.0\n")  # no checkpoint yet
    before = (tmp_path / "bst" / "metrics.csv").read_text()
    assert main(["star", "--config", str(TINY), "--set", f"out_dir={tmp_path}", "--resume"]) == 0
    assert (tmp_path / "bst" / "metrics.csv").read_text() == before  # not retrained
    assert (tmp_path / "forward" / "checkpoints" / "latest").exists()


def test_a_checkpoint_or_a_log_write_is_timed_in_no_interval(tmp_path, monkeypatch):
    """The rates of an interval time its own steps. The timer was restarted before the log write and
    the checkpoint, whose time went to the next interval: after every checkpoint a row was about 3x
    slower. Here the trainer's clock jumps 100 s in every checkpoint and every log write; a step of
    this model takes well under a second, however loaded the machine."""
    import types

    import bst_fast.trainer as trainer
    from bst_fast.run_folder import MetricsLog

    jumped = [0.0]
    real = trainer.time.perf_counter

    def jumping(call):
        def wrapped(*a, **k):
            jumped[0] += 100.0
            return call(*a, **k)
        return wrapped

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=lambda: real() + jumped[0]))
    monkeypatch.setattr(trainer, "_save", jumping(trainer._save))
    monkeypatch.setattr(MetricsLog, "log", jumping(MetricsLog.log))
    train(tiny(tmp_path, steps=7, log_every=1, eval_every=100, ckpt_every=2))
    assert jumped[0] == 100.0 * (7 + 4)  # 7 rows, checkpoints after steps 2, 4, 6 and 7
    rows = [line.split(",") for line in (tmp_path / "metrics.csv").read_text().splitlines()[1:]]
    rates = [float(value) for _, key, value in rows if key == "steps_per_s"]  # tokens/pairs: the same dt
    assert len(rates) == 7 and min(rates) > 1 / 50, rates  # a jump in an interval makes it 100 s a step


def test_a_saved_config_on_other_data_names_how_to_let_the_data_set_its_fields(tmp_path):
    """A run's saved config holds the vocab_size and max_len its data set. On another star shape they
    are refused ('leave it out'), though the user never wrote them: the message now says how to unset
    them, and that works."""
    from bst_fast import ModelConfig

    train(tiny(tmp_path / "a", steps=2))
    saved = load_model(tmp_path / "a")[1]
    default = ModelConfig.__dataclass_fields__["max_len"].default
    assert saved.model.max_len != default
    with pytest.raises(ValueError, match=rf"'model.max_len' is set by the data .* set model.max_len={default} \(unset\)"):
        train(saved, out_dir=str(tmp_path / "b"), star_path_len=4)
    train(saved, out_dir=str(tmp_path / "b"), star_path_len=4, **{"model.max_len": default})
    assert load_model(tmp_path / "b")[1].model.max_len not in (default, saved.model.max_len)


def test_the_cli_ends_the_ddp_group_at_its_exit_and_not_between_commands(tmp_path):
    """`bst-fast` (cli) ends the group a train command started once the command is done, before the
    interpreter's teardown (where gloo aborted a finished rank now and then under load); main()
    does not, so a second command in the same torchrun process trains on the same group (ending it
    there hung a second main() in a new rendezvous: review helper-77)."""
    script = tmp_path / "cli.py"
    script.write_text(f"""import os, sys
import torch.distributed as dist
import bst_fast.trainer as trainer
from bst_fast.__main__ import cli, main
args = ["train", "--config", {str(TINY)!r}, "--set", "out_dir={tmp_path / 'run'}", "--set", "ckpt_every=0"]
assert main(args + ["--set", "steps=3"]) == 0 and dist.is_initialized()
real = trainer.end_process_group
def spy():
    ended = real()
    # one write(2) of a short line: the two ranks share torchrun's stdout pipe, and print's separate
    # writes of 'rank' and ' ended' interleaved there ('rank\\nrank ended\\n ended': a CI failure)
    sys.stdout.flush()
    os.write(1, ("rank " + ("ended" if ended and not dist.is_initialized() else "kept") + "\\n").encode())
    return ended
trainer.end_process_group = spy
sys.argv = ["bst-fast", *args, "--resume"]
rc = cli()
print("after cli", rc)  # not reached: a rank whose group cli ended leaves without the interpreter's teardown
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = torchrun(script)
    run = subprocess.run(ddp, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("rank ended") == 2 and "after cli" not in run.stdout, run.stdout
    assert latest_checkpoint(tmp_path / "run").name == f"step-{TrainConfig.load(TINY).steps:08d}"


def test_a_resume_may_change_grad_accum_and_gives_the_same_weights_up_to_rounding(tmp_path):
    """A run out of memory is resumed with more micro-batches (review helper-100: refused as a changed
    training field). All pairs and no dropout: the same weights, up to rounding."""
    full = tiny(tmp_path / "full", ckpt_every=0)
    train(full)
    train(tiny(tmp_path / "cut", ckpt_every=0), stop_at=3)
    train(tiny(tmp_path / "cut", ckpt_every=0, grad_accum=2), resume=True)
    params = same_params(tmp_path / "full", tmp_path / "cut")
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in params.values())
    assert load_model(tmp_path / "cut")[1].grad_accum == 2
