"""The trainer's objective options (min_gap/meet_token, row_mean), gradient accumulation and the
best checkpoint: each equals its definition, and resume stays exact."""
import json
from pathlib import Path

import pytest
import torch

from bst_fast import belief_state_loss, load_model, train
from bst_fast.checkpoint import latest_checkpoint
from bst_fast.config import TrainConfig, resolve_config
from bst_fast.tasks import Objective, build_task
from bst_fast.trainer import build_run, train_step
from _helpers import star_fields_for

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"


def tiny(out_dir, **changes):
    return resolve_config(TINY, out_dir=str(out_dir), **{**star_fields_for(changes.get("data", "star")), **changes})


def corpus(tmp_path):
    path = tmp_path / "c.txt"
    words = "the cat sat on a mat and ran to see the dog who barked at it".split()
    path.write_text("\n\n".join(" ".join(words[: 3 + (k * 7) % 13]) for k in range(50)))
    return path


def text(tmp_path, **changes):
    return tiny(tmp_path / "run", data=str(corpus(tmp_path)), text_vocab=270, max_len=24, **changes)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("changes, field", [
    ({"min_gap": 1}, "meet_token"),
    ({"min_gap": 0}, "min_gap"),
    ({"meet_token": "bos"}, "meet_token"),
    ({"meet_token": -1}, "meet_token"),
    ({"meet_token": True}, "meet_token"),
    ({"reduction": "sum"}, "reduction"),
    ({"max_gap": 1}, "max_gap"),
    ({"max_gap": 2.5}, "max_gap"),
    ({"grad_accum": 0}, "grad_accum"),
    ({"keep_best": "held_out_loss"}, "keep_best"),  # star data scores path accuracy
])
def test_bad_objective_fields_name_the_field(tmp_path, changes, field):
    with pytest.raises(ValueError, match=f"'{field}'"):
        tiny(tmp_path, **changes).check()


def test_a_star_bst_keeps_the_pairs_its_evaluation_reads(tmp_path):
    """The evaluation decodes path node k from the pair ("=" + k, EOS), l + 1 - k apart: max_gap <= l
    trained a BST that never saw the pairs it is scored on."""
    l = tiny(tmp_path).star_path_len
    with pytest.raises(ValueError, match=f"'max_gap' must be None or >= star_path_len \\+ 1 = {l + 1}"):
        tiny(tmp_path, max_gap=l).check()
    tiny(tmp_path, max_gap=l + 1).check()
    with pytest.raises(ValueError, match="'max_gap' must be its default None for method 'forward'"):
        tiny(tmp_path, max_gap=l, method="forward").check()  # no pairs: the field is not read
    with pytest.raises(ValueError, match="'min_gap' must be 1 or 2 for a star-graph BST"):  # the last node's pair
        tiny(tmp_path, min_gap=3).check()


def test_meet_token_eos_is_the_datas_eos_and_reaches_the_loss(tmp_path):
    cfg = text(tmp_path, min_gap=1, meet_token="eos", max_gap=6)
    run = build_run(cfg.check(), "cpu")
    assert run.objective.meet_token == run.task.eos_id and run.objective.max_gap == 6
    # The trained loss is the belief loss with these options over the step's batch.
    batch = run.batch(0)
    model = run.model.eval()
    out = run.objective(model, batch.tokens, batch.lengths, prefix_start=0, generator=torch.Generator(),
                        pair_total=batch.pair_total, token_total=batch.token_total, row_total=batch.row_total)
    f, b = model.prefix_states(batch.tokens), model.suffix_states(batch.tokens, batch.lengths)
    want = belief_state_loss(f, b, batch.tokens, model.head, lengths=batch.lengths, min_gap=1, max_gap=6,
                             meet_token=run.task.eos_id, backend="reference")
    assert torch.allclose(out["total"], want, rtol=1e-5)
    # The pair count the mean divides by includes the adjacent pairs.
    n = sum(min(int(l) - 1 - i, 6) for l in batch.lengths for i in range(int(l) - 1))
    assert batch.pair_total == n


def test_row_mean_is_the_mean_of_row_means_over_batches_and_ranks(tmp_path):
    run = build_run(text(tmp_path, reduction="row_mean").check(), "cpu")
    batch = run.batch(0)
    model = run.model.eval()
    f, b = model.prefix_states(batch.tokens), model.suffix_states(batch.tokens, batch.lengths)
    want = belief_state_loss(f, b, batch.tokens, model.head, lengths=batch.lengths, reduction="row_mean",
                             backend="reference")
    got = sum(float(run.objective(model, p.tokens, p.lengths, prefix_start=0, generator=torch.Generator(),
                                  pair_total=p.pair_total, token_total=p.token_total, row_total=p.row_total)["total"])
              for p in batch.split(4))
    assert got == pytest.approx(float(want), rel=1e-5)
    # held-out: the mean over every held-out row whatever the evaluation's batch size
    figures = []
    for size in (1, 5, 64):
        task = build_task(text(tmp_path, reduction="row_mean", batch_size=size))
        figures.append(task.evaluate(model, "cpu")["held_out_loss"])
    assert max(figures) - min(figures) < 1e-5 * figures[0]


@pytest.mark.parametrize("reduction", ["mean", "row_mean"])
def test_grad_accum_gives_the_big_batchs_weights(tmp_path, reduction):
    """All pairs and no dropout: micro-batches sum to the batch's loss and gradient, so AdamW's
    steps match to float32 rounding."""
    runs = []
    for accum in (1, 4):
        cfg = text(tmp_path, reduction=reduction, grad_accum=accum, batch_size=8, **{"model.dropout": 0.0}).check()
        run = build_run(cfg, "cpu")
        losses = [float(train_step(run, step)) for step in range(3)]
        runs.append((losses, params(run.model)))
    (l1, p1), (l4, p4) = runs
    assert l1 == pytest.approx(l4, rel=1e-5)
    assert all(torch.allclose(p1[k], p4[k], atol=1e-6, rtol=1e-5) for k in p1)
    assert any(not torch.equal(p1[k], build_run(text(tmp_path).check(), "cpu").model.state_dict()[k]) for k in p1)


@pytest.mark.parametrize("reduction", ["mean", "row_mean"])
def test_a_micro_batch_without_pairs_adds_nothing(tmp_path, reduction):
    """A micro-batch of rows too short for any pair (a split stream's last row can be one) adds 0
    to the step and zeros to the gradients: the step equals the whole batch's in one piece. The
    loss raised on such a micro-batch before."""
    def short_tail(rows):
        def patched(step, batch_size):
            tokens, lengths, start, documents = rows(step, batch_size)
            return tokens, torch.cat([lengths[:2], torch.tensor([2, 1])]), start, documents
        return patched

    runs = []
    for accum in (1, 2):
        run = build_run(text(tmp_path, reduction=reduction, grad_accum=accum, batch_size=4,
                             **{"model.dropout": 0.0}).check(), "cpu")
        run.task.rows = short_tail(run.task.rows)
        losses = [float(train_step(run, step)) for step in range(2)]
        runs.append((losses, params(run.model)))
    (l1, p1), (l2, p2) = runs
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert all(torch.allclose(p1[k], p2[k], atol=1e-6, rtol=1e-5) for k in p1)


@pytest.mark.parametrize("reduction", ["mean", "row_mean"])
def test_a_batch_without_pairs_is_refused_by_the_model_and_the_trainer(tmp_path, reduction):
    """A whole batch without pairs stays an error under both reductions (row_mean's loss over it is
    0: the model, given the batch's counts, refuses it, and a run of such rows stops at once)."""
    run = build_run(text(tmp_path, reduction=reduction).check(), "cpu")
    tokens = torch.zeros(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="pair_total must be > 0"):
        run.objective(run.model, tokens, torch.tensor([2, 1]), prefix_start=0, generator=torch.Generator(),
                      pair_total=0.0, token_total=1.0, row_total=2)
    with pytest.raises(ValueError, match=r"no batch of steps 1\.\.2 has anything to learn from \(step 1's holds no "
                                         r"pair \(min_gap 100"):
        train(text(tmp_path, reduction=reduction, min_gap=100, steps=2))
    assert not (tmp_path / "run").exists()  # refused before the run folder is claimed
    for rows in (0, float("nan"), float("inf")):  # a ZeroDivisionError, a NaN loss before
        with pytest.raises(ValueError, match="row_total must be a finite number > 0"):
            run.objective(run.model, torch.randint(3, 9, (2, 6)), torch.tensor([6, 6]), prefix_start=0,
                          generator=torch.Generator(), pair_total=12.0, token_total=10.0, row_total=rows)


@pytest.mark.parametrize("method", ["bst", "forward"])
def test_a_step_with_nothing_to_learn_makes_no_update_and_the_run_goes_on(tmp_path, capfd, method):
    """A step whose whole batch has no pair (a BST) or no next-token target (forward), such as a split
    stream's last row of one token drawn alone, is skipped: no update, the schedule moves on, its
    logging interval's loss is nan. The run stopped there on every resume before (a BST's loss
    refused pair_total 0, forward's was 0/0 = nan)."""
    def empty_step_2(rows):
        def patched(step, batch_size):
            tokens, lengths, start, documents = rows(step, batch_size)
            return tokens, (torch.ones_like(lengths) if step == 1 else lengths), start, documents
        return patched

    cfg = text(tmp_path, method=method, steps=4, log_every=1, eval_every=0, ckpt_every=0, batch_size=2)
    run = build_run(cfg.check(), "cpu")
    run.task.rows = empty_step_2(run.task.rows)
    assert train_step(run, 0) is not None
    before, lr = params(run.model), run.optimizer.param_groups[0]["lr"]
    assert train_step(run, 1) is None
    assert all(torch.equal(before[k], v) for k, v in params(run.model).items())
    assert run.optimizer.param_groups[0]["lr"] > lr  # the warm-up went on
    assert "step 2: the batch (row lengths [1, 1]) holds no " in capfd.readouterr().err
    assert train_step(run, 2) is not None and not all(torch.equal(before[k], v) for k, v in params(run.model).items())

    import bst_fast.tasks as tasks
    rows = tasks.TextTask.rows
    try:
        tasks.TextTask.rows = lambda self, step, batch_size: empty_step_2(rows.__get__(self))(step, batch_size)
        out = train(cfg)
    finally:
        tasks.TextTask.rows = rows
    assert out["loss"] == out["loss"]  # the last interval trained
    logged = [l.split(",") for l in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]]
    losses = {int(s): float(v) for s, k, v in logged if k == "loss"}
    assert sorted(losses) == [1, 2, 3, 4] and losses[2] != losses[2] and all(losses[s] == losses[s] for s in (1, 3, 4))


def test_a_run_stopped_before_steps_with_nothing_to_learn_resumes_exactly(tmp_path, monkeypatch):
    """Steps 2 and 4 of 4 have nothing to learn from. A run stopped after step 3 (or 1) resumes over
    them to the uninterrupted run's parameters, bit for bit: the first-batch check looks past the
    call's own steps, and goes without a check where none has anything (a resume over only step 4
    was refused before, at every try). A skipped first step warns of nothing."""
    import warnings

    import bst_fast.tasks as tasks

    rows = tasks.TextTask.rows

    def empty_at(steps):
        def patched(self, step, batch_size):
            tokens, lengths, start, documents = rows(self, step, batch_size)
            return tokens, (torch.ones_like(lengths) if step in steps else lengths), start, documents
        return patched

    opts = dict(steps=4, log_every=1, eval_every=0, ckpt_every=0, batch_size=2, **{"model.dropout": 0.1})
    monkeypatch.setattr(tasks.TextTask, "rows", empty_at({0}))
    run = build_run(text(tmp_path, **opts).check(), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warned that the schedule's first value was skipped
        assert train_step(run, 0) is None
    monkeypatch.setattr(tasks.TextTask, "rows", empty_at({1, 3}))
    full = train(text(tmp_path, **opts), out_dir=str(tmp_path / "full"))  # the config's out_dir overridden
    assert full["loss"] != full["loss"]  # step 4's interval trained no step
    for stop in (3, 1):
        cut = text(tmp_path, **opts)
        train(cut, stop_at=stop, out_dir=str(tmp_path / f"cut{stop}"))
        train(cut, resume=True, out_dir=str(tmp_path / f"cut{stop}"))
        a, _ = load_model(tmp_path / "full")
        b, _ = load_model(tmp_path / f"cut{stop}")
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_grad_accum_resume_is_bitwise_exact(tmp_path):
    opts = dict(grad_accum=2, pairs=0.5, steps=6, ckpt_every=0, **{"model.dropout": 0.1})
    train(tiny(tmp_path / "full", **opts))
    train(tiny(tmp_path / "cut", **opts), stop_at=3)
    train(tiny(tmp_path / "cut", **opts), resume=True)
    a, _ = load_model(tmp_path / "full")
    b, _ = load_model(tmp_path / "cut")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_keep_best_held_out_loss_without_held_out_rows_is_refused(tmp_path):
    """One document of one row leaves no held-out rows: the run kept no best checkpoint and said
    nothing before."""
    (tmp_path / "one.txt").write_text("the cat sat on the mat")
    cfg = tiny(tmp_path / "run", data=str(tmp_path / "one.txt"), text_vocab=270, max_len=24, batch_size=1,
               keep_best="held_out_loss")
    with pytest.raises(ValueError, match="'keep_best' is 'held_out_loss', but the corpus's held-out rows are none"):
        train(cfg)
    assert not (tmp_path / "run").exists()
    train(cfg, keep_best="", steps=1)  # without keep_best the corpus trains


def test_held_out_rows_without_a_pair_give_no_figure_and_keep_best_on_them_is_refused(tmp_path, capfd):
    """Held-out rows too short for min_gap (seed 2's are 9, 19 and 22 long; training rows reach 24)
    have no loss: the run reports none, and keep_best on it is refused at once. The run stopped at
    its first evaluation (and at every resume) before, naming no held-out set."""
    cfg = text(tmp_path, seed=2, min_gap=22, steps=2, eval_every=1, ckpt_every=0)
    with pytest.raises(ValueError, match="'keep_best' is 'held_out_loss', but the corpus's held-out rows hold no pair "
                                         r"\(min_gap 22"):
        train(cfg, keep_best="held_out_loss")
    assert not (tmp_path / "run").exists()
    out = train(cfg)
    assert "held_out_loss" not in out and out["loss"] == out["loss"]
    assert "the corpus's held-out rows hold no pair (min_gap 22, max_gap None): the run reports no held_out_loss" in capfd.readouterr().err
    assert "held_out_loss" in train(cfg, min_gap=21, overwrite=True)  # one held-out pair: a figure


def test_keep_best_saves_the_best_evaluation_and_survives_resume(tmp_path, monkeypatch):
    from bst_fast import tasks

    figures = iter([0.2, 0.6, 0.4, 0.5, 0.9] + [0.0] * 9)
    monkeypatch.setattr(tasks.StarTask, "evaluate", lambda self, model, device, world=1, rank=0: {"path_accuracy": next(figures)})
    d = tmp_path / "b"
    opts = dict(steps=10, eval_every=2, ckpt_every=2, keep_checkpoints=1, keep_best="path_accuracy")
    train(tiny(d, **opts), stop_at=6)
    best = json.loads((d / "checkpoints" / "best" / "best.json").read_text())
    assert best == {"metric": "path_accuracy", "value": 0.6, "step": 4, "world": 1}
    model, cfg = load_model(d / "checkpoints" / "best")  # a complete, verified checkpoint
    assert latest_checkpoint(d).name == "step-00000006"
    train(tiny(d, **opts), resume=True)  # 0.5 at step 8 does not beat 0.6; 0.9 at step 10 does
    best = json.loads((d / "checkpoints" / "best" / "best.json").read_text())
    assert best["step"] == 10 and best["value"] == 0.9
    train(tiny(d, seed=3, steps=2, eval_every=2, ckpt_every=2), overwrite=True)  # a new run: the old best goes
    assert not (d / "checkpoints" / "best").exists()


def test_a_config_pairs_of_int_1_is_the_fraction_all_pairs():
    """TrainConfig(pairs=1), built in code, passed check() as the fraction 1 and reached the loss as
    the count 1 (one pair a row); the same config read from a file is 1.0 (all pairs)."""
    lengths, start = torch.tensor([10, 8]), torch.zeros(2, dtype=torch.long)
    for cfg in (TrainConfig(pairs=1), TrainConfig.from_dict(TrainConfig(pairs=1).to_dict())):
        objective = Objective.from_config(cfg.check())
        pairs, _, drawn = objective.totals(lengths, start, 10)
        assert objective.pairs == 1.0 and isinstance(objective.pairs, float) and drawn == pairs == 36 + 21


def test_objective_from_config_needs_an_eos_for_eos():
    cfg = resolve_config(TINY, min_gap=1, meet_token="eos")
    with pytest.raises(ValueError, match="meet_token"):
        Objective.from_config(cfg)
    assert Objective.from_config(cfg, eos_id=5).meet_token == 5


@pytest.mark.parametrize("pairs", [0.01, 0.3, 1.0, None])
def test_rates_count_the_pairs_the_loss_draws_and_the_valid_tokens(tmp_path, monkeypatch, pairs):
    """pairs_per_s counts the pairs the loss reads: a fraction's round(rho |P_r|) with at least one
    a row (pair_total * pairs before stop 38: 0.48 for 8 drawn at 0.01); tokens_per_s counts valid
    positions, not padding."""
    from bst_fast import _pairs

    drawn = []
    real = _pairs.sample_pairs
    monkeypatch.setattr(_pairs, "sample_pairs", lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1])
    for kind, cfg in (("star", tiny(tmp_path / "s", pairs=pairs)), ("text", text(tmp_path, pairs=pairs))):
        run = build_run(cfg.check(), "cpu")
        drawn.clear()
        batch = run.batch(0)
        before = (run.tokens_seen, run.pairs_seen)
        train_step(run, 0)
        read = sum(len(r) for r, _, _ in drawn) if pairs is not None else batch.pair_total
        assert run.pairs_seen - before[1] == read > 0, kind
        assert run.tokens_seen - before[0] == int(batch.lengths.sum()), kind
        if kind == "text":  # rows of unequal length: padding is left out
            assert int(batch.lengths.sum()) < batch.tokens.numel()
            # each of 2 ranks counts half the whole batch's (rank 0's own rows times 2 was the first fix)
            shares = [build_run(cfg.check(), "cpu", None, 2, r).batch(0) for r in (0, 1)]
            assert shares[0].positions == shares[1].positions == int(batch.lengths.sum()) / 2
            assert int(shares[0].lengths.sum()) != int(shares[1].lengths.sum())
            assert shares[0].pairs_drawn == shares[1].pairs_drawn == batch.pairs_drawn / 2
        run.close()


def test_flex_attention_on_packed_cpu_rows_is_refused_before_the_folder(tmp_path):
    """flex_attention has no backward on the CPU: packed rows with attention 'flex' are refused at the
    first batch's check, before anything is written (the first step refused them, after the claim)."""
    cfg = text(tmp_path, pack=True, steps=2, **{"model.attention": "flex"})
    with pytest.raises(ValueError, match="'flex' trains on a CUDA GPU only"):
        train(cfg, device="cpu")
    assert not Path(cfg.out_dir).exists()


@pytest.mark.parametrize("gap", [10**20, 2**63 - 1])
def test_a_huge_max_gap_in_a_config_is_no_limit(tmp_path, gap):
    """A max_gap past int64 raised a bare OverflowError in the pair counts, and 2**63 - 1 wrapped
    i + max_gap to negative ranges there; both are no limit, as belief_state_loss takes them."""
    want = build_run(tiny(tmp_path / "none").check(), "cpu").batch(0)
    got = build_run(tiny(tmp_path / "huge", max_gap=gap).check(), "cpu").batch(0)
    assert got.pair_total == want.pair_total > 0 and got.pairs_drawn == want.pairs_drawn


def test_each_step_and_micro_batch_draws_its_own_pair_subsample(tmp_path, monkeypatch):
    """pairs < 1: the loss's generator is seeded from (seed, step, micro-batch, rank), so every step
    and every micro-batch draws its own subsample (a seed without the step trained the same pairs of
    each row shape at every step), and the same run draws the same ones again (resume stays exact)."""
    from bst_fast import _pairs

    drawn = []
    real = _pairs.sample_pairs

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        drawn.append(torch.stack(out, 1))  # (pairs, 3): row, i, j
        return out

    monkeypatch.setattr(_pairs, "sample_pairs", recorded)

    def draws():
        run = build_run(tiny(tmp_path, pairs=0.25, grad_accum=2).check(), "cpu")
        drawn.clear()
        for step in range(3):
            assert train_step(run, step) is not None
        return list(drawn)

    first = draws()
    assert len(first) == 6  # 3 steps of 2 micro-batches; the star rows share one length, so only the seed differs
    for a in range(6):
        for b in range(a):
            assert not torch.equal(first[a], first[b]), f"draws {b} and {a} (step, micro-batch) drew the same pairs"
    again = draws()
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def first_step_gradients(cfg):
    """The gradients AdamW steps on at a run's first step (None for a parameter without one)."""
    run = build_run(cfg.check(), "cpu")
    seen = []
    run.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(
        [None if p.grad is None else p.grad.clone() for g in opt.param_groups for p in g["params"]]))
    assert train_step(run, 0) is not None and len(seen) == 1
    return seen[0]


def test_grad_clip_steps_on_the_gradient_clipped_to_its_norm(tmp_path):
    """grad_clip > 0: AdamW steps on the whole gradient scaled to norm grad_clip when it is longer,
    untouched when shorter; 0: untouched (the tiny run's norms lie below the default 1.0, so no other
    test sees a clip act)."""
    raw = first_step_gradients(tiny(tmp_path, grad_clip=0.0))
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in raw if g is not None])))
    clip = 1e-3
    assert norm > 10 * clip
    clipped = first_step_gradients(tiny(tmp_path, grad_clip=clip))
    for g, c in zip(raw, clipped):
        assert (g is None) == (c is None)
        if g is not None:
            assert torch.allclose(c, g * (clip / norm), rtol=1e-4, atol=0)
    loose = first_step_gradients(tiny(tmp_path, grad_clip=2 * norm))
    assert all(g is None and c is None or torch.equal(g, c) for g, c in zip(raw, loose))


def test_weight_decay_falls_on_matrices_only(tmp_path):
    """Each parameter is in one optimizer group: the matrices (embeddings included) decay at
    weight_decay, the biases and the norms' weights not at all."""
    from collections import Counter

    run = build_run(tiny(tmp_path, weight_decay=0.05).check(), "cpu")
    held = Counter(id(p) for g in run.optimizer.param_groups for p in g["params"])
    named = dict(run.model.named_parameters())
    assert sorted(held) == sorted(id(p) for p in named.values()) and set(held.values()) == {1}
    decay = {id(p): g["weight_decay"] for g in run.optimizer.param_groups for p in g["params"]}
    norms = {id(m.weight) for m in run.model.modules() if isinstance(m, torch.nn.LayerNorm)}
    for name, p in named.items():
        want = 0.0 if name.endswith("bias") or id(p) in norms else 0.05
        assert want == (0.05 if p.dim() >= 2 else 0.0), name  # the rule: matrices decay
        assert decay[id(p)] == want, (name, decay[id(p)])
    assert any(n.endswith("bias") for n in named) and norms


def test_ddp_timeout_reaches_the_process_group_and_a_resume_may_change_it(tmp_path, monkeypatch, capsys):
    """A frozen rank held the others for torch's default timeout (30 min on gloo), with no way to
    shorten it: ddp_timeout (seconds; 0 keeps torch's default) is the process group's timeout."""
    import datetime

    from bst_fast import trainer

    seen = []
    monkeypatch.setattr(trainer.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(trainer.dist, "init_process_group", lambda backend, **kw: seen.append((backend, kw)))
    monkeypatch.setattr(trainer.atexit, "register", lambda fn: None)
    monkeypatch.setitem(trainer._GROUP, "started", None)
    trainer._device(tiny(tmp_path, device="cpu", batch_size=4, ddp_timeout=90), 2)
    trainer._device(tiny(tmp_path, device="cpu", batch_size=4), 2)
    assert seen == [("gloo", {"timeout": datetime.timedelta(seconds=90)}), ("gloo", {})]
    # a later call in the same process finds the group made: its timeout cannot change, and says so
    monkeypatch.setattr(trainer.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(trainer.dist, "get_rank", lambda: 0)
    trainer._device(tiny(tmp_path, device="cpu", batch_size=4, ddp_timeout=5), 2)
    assert len(seen) == 2
    assert "config field 'ddp_timeout' (5) does not apply: this process's DDP group, started by an earlier " \
        "train() call with ddp_timeout 0, keeps its own timeout" in capsys.readouterr().err
    trainer._device(tiny(tmp_path, device="cpu", batch_size=4), 2)  # the group's own value: nothing to say
    assert capsys.readouterr().err == ""
    monkeypatch.undo()
    for bad in (-1, 0.0005, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"config field 'ddp_timeout' must be 0 \(torch's default\) or a number"):
            tiny(tmp_path, ddp_timeout=bad).check()
    d = tmp_path / "run"
    train(tiny(d, steps=2, eval_every=0, ckpt_every=0))
    train(tiny(d, steps=3, eval_every=0, ckpt_every=0, ddp_timeout=60), resume=True)
    assert load_model(d)[1].ddp_timeout == 60
