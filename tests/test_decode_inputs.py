"""Inputs of the decoders, the probes, path_accuracy, the star/table experiments and the generate CLI:
refused with an error naming the argument (or the flag typed), never truncated or ignored; scores
in the model's precision; probes that train under a caller's no_grad / inference_mode."""
import itertools
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bst_fast import TrainConfig, decode, train
from bst_fast.__main__ import main
from bst_fast.model import BeliefStateTransformer, ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
EOS = 3

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_bst(V=5, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = BeliefStateTransformer(ModelConfig(vocab_size=V, max_len=24, n_layer=2, d_model=16, n_head=2,
                                               head_hidden=16)).to(dtype).eval()
    with torch.no_grad():  # spread the probabilities so that orders are not decided by rounding
        model.head.layers[-1].weight.mul_(30.0)
    return model


def fake_train(monkeypatch):
    """trainer.train replaced by a recorder: what an experiment would have trained."""
    import bst_fast.trainer as trainer

    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: seen.append(cfg) or {"path_accuracy": 1.0, "loss": 0.0})
    return seen


# ---------------------------------------------------------------- experiments (items 1, 6, 11)

def test_star_and_table_refuse_text_data_before_anything_trains(tmp_path, monkeypatch, capsys):
    from bst_fast import experiments

    seen = fake_train(monkeypatch)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("one story\n\nanother story\n")
    cfg = TrainConfig.load(TINY)
    cfg.data, cfg.text_vocab, cfg.out_dir = str(corpus), 260, str(tmp_path / "run")
    for run in (experiments.star, experiments.table):
        with pytest.raises(ValueError, match="config field 'data' must be 'star'"):
            run(cfg)
    assert main(["table", "--config", str(TINY), "--set", f"out_dir={tmp_path / 'run'}",
                 "--set", f"data={corpus}", "--set", "text_vocab=260"]) == 2
    assert "'data' must be 'star'" in capsys.readouterr().err
    assert not seen and capsys.readouterr().out == ""  # no fake table of nan printed


def test_a_series_takes_the_model_fields_its_runs_data_sets(tmp_path, monkeypatch):
    """A saved run's config as the base (model.vocab_size and max_len set by its data) trained some
    rows of `table`, then stopped at the first row whose data sets other values (teacherless adds a
    token, fim lengthens the row): every row's data now sets them."""
    from bst_fast import experiments
    from bst_fast.tasks import build_task, model_config

    seen = fake_train(monkeypatch)
    base = TrainConfig.load(TINY)
    base.out_dir = str(tmp_path)
    saved = model_config(base, build_task(base))  # what a bst run's checkpoint holds
    assert saved.model.vocab_size != base.model.vocab_size
    experiments.table(saved)
    experiments.star(saved, methods=("bst", "forward"))
    assert len(seen) == len(experiments.TABLE_ROWS) + 2
    for cfg in seen:  # what each run's train would build
        assert model_config(cfg, build_task(cfg)).model.vocab_size >= saved.model.vocab_size


def test_the_table_names_the_bst_objective_its_base_changes(tmp_path, monkeypatch, capsys):
    """A base config's pairs, max_gap or gamma reach every BST row, the one labelled "BST" too: the
    table's text says so (it named none of them)."""
    from bst_fast import experiments

    fake_train(monkeypatch)
    base = TrainConfig.load(TINY)
    base.out_dir = str(tmp_path)
    experiments.table(base)
    assert "BST objective: the defaults (all pairs, min_gap 2, no GPT head)" in capsys.readouterr().out
    base.pairs, base.max_gap = 0.05, 9
    experiments.table(base)
    assert "BST objective: pairs=0.05, max_gap=9 (the rest as the defaults)" in capsys.readouterr().out


def test_star_refuses_a_repeated_method(tmp_path, monkeypatch, capsys):
    from bst_fast import experiments

    seen = fake_train(monkeypatch)
    cfg = TrainConfig.load(TINY)
    cfg.out_dir = str(tmp_path)
    with pytest.raises(ValueError, match=r"methods \(star --methods\) must not repeat"):
        experiments.star(cfg, methods=("bst", "bst"))
    assert main(["star", "--config", str(TINY), "--set", f"out_dir={tmp_path}", "--methods", "bst", "bst"]) == 2
    assert "methods (star --methods) must not repeat" in capsys.readouterr().err
    assert not seen


def test_table_out_refuses_an_existing_file_it_cannot_write(tmp_path, monkeypatch):
    """An unwritable file (root: chattr +i; here os.access says no) fails before the rows train,
    not after all of them."""
    from bst_fast import experiments

    seen = fake_train(monkeypatch)
    out = tmp_path / "table.md"
    out.write_text("an old table\n")
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out and mode & os.W_OK
                        else real(p, mode, **kw))
    cfg = TrainConfig.load(TINY)
    cfg.out_dir = str(tmp_path / "runs")
    with pytest.raises(ValueError, match="table.md' exists and is not writable"):
        experiments.table(cfg, out=str(out))
    assert not seen and out.read_text() == "an old table\n"


# ---------------------------------------------------------------- probes (items 2, 3, 9)

def test_probes_train_under_no_grad_and_inference_mode():
    y = torch.arange(20) % 4
    x = F.one_hot(y, 4).float()
    assert decode.probe_accuracy(x, y, x, y, steps=50) == 1.0
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            x_in = F.one_hot(y, 4).float()  # made in that mode: an inference tensor under inference_mode
            assert decode.probe_accuracy(x_in, y, x_in, y, steps=50) == 1.0
    model = tiny_bst()
    gen = torch.Generator().manual_seed(0)
    tr, te = torch.randint(0, 5, (12, 6), generator=gen), torch.randint(0, 5, (6, 6), generator=gen)
    want = decode.probe_future_tokens(model, tr, te, 2, [1, 2], steps=5)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            assert decode.probe_future_tokens(model, tr, te, 2, [1, 2], steps=5) == want


@pytest.mark.parametrize("call, says", [
    # float and bool ids were cast to int64: 3.7 read as 3
    (lambda m, t: decode.belief_states(m, [[1.0, 3.7]]), "tokens must hold integer token ids"),
    (lambda m, t: decode.belief_states(m, [[True, False]]), "tokens must hold integer token ids"),
    (lambda m, t: decode.probe_future_tokens(m, t.double() + 0.6, t, 1, [1], steps=1), "train_tokens must hold integer"),
    (lambda m, t: decode.probe_future_tokens(m, t, t.bool(), 1, [1], steps=1), "test_tokens must hold integer"),
    (lambda m, t: decode.probe_future_tokens(m, t, t[0], 1, [1], steps=1), r"test_tokens must be \(n, L\)"),
    (lambda m, t: decode.probe_future_tokens(m, t, t[:0], 1, [1], steps=1), "test_tokens must be"),
    # test rows shorter than the training rows: the shorter L was used silently
    (lambda m, t: decode.probe_future_tokens(m, t, t[:, :4], 1, [1], steps=1), "rows of one length, got 6 and 4"),
    (lambda m, t: decode.probe_accuracy(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), torch.randn(0, 3),
                                        torch.zeros(0, dtype=torch.long), steps=2), "test_x must be"),
    (lambda m, t: decode.probe_accuracy(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), torch.randn(2, 3),
                                        torch.tensor([0, 1]), steps=0), "steps must be an int >= 1"),
    (lambda m, t: decode.probe_accuracy(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]), torch.randn(2, 3),
                                        torch.tensor([0, 1]), hidden=0, steps=2), "hidden must be an int >= 1"),
])
def test_belief_states_and_probes_refuse_bad_inputs(call, says):
    tokens = torch.randint(0, 5, (8, 6), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=says):
        call(tiny_bst(), tokens)


def test_belief_states_read_no_padding():
    """Padding past a row's length may hold any id, as the models take it (model.checked_batch): -1 or V
    there gave "tokens must hold token ids in 0..V-1"; an id out of range at a valid position is refused."""
    model, V = tiny_bst(), 5
    tokens, lengths = torch.randint(3, V, (2, 7), generator=torch.Generator().manual_seed(1)), torch.tensor([7, 4])
    want = decode.belief_states(model, tokens, lengths)
    for pad in (-1, V, 2**40):
        padded = tokens.clone()
        padded[1, 4:] = pad
        assert torch.equal(decode.belief_states(model, padded, lengths), want), pad
    tokens[1, 2] = V
    with pytest.raises(IndexError, match=r"at valid positions, got tokens\[1, 2\] = 5"):
        decode.belief_states(model, tokens, lengths)


def test_path_accuracy_refuses_a_0d_tensor_by_name():
    from bst_fast.data import path_accuracy

    with pytest.raises(ValueError, match=r"tokens must be \(n, L\) rows"):
        path_accuracy(lambda p, n: p[:, :n], torch.tensor(3), 2, 2)


# ---------------------------------------------------------------- decoders (items 4, 7, 8, 10)

@pytest.mark.parametrize("goal", [None, "34", [None]])
@pytest.mark.parametrize("decoder", ["sample", "plan", "beam_search"])
def test_decoders_refuse_a_goal_that_is_not_ids(decoder, goal):
    """The default goal is () (no goal); None or a string was a TypeError from torch or range()."""
    model = tiny_bst()
    call = {"sample": lambda: decode.sample(model, [4, 0], 2, EOS, goal=goal),
            "plan": lambda: decode.plan(model, [4, 0], goal, horizon=1, rollouts=1, eos_id=EOS),
            "beam_search": lambda: decode.beam_search(model, [4, 0], 2, goal=goal, eos_id=EOS)}[decoder]
    with pytest.raises(ValueError, match="goal must hold integer token ids, got "):
        call()


def test_a_float64_model_scores_in_float64():
    model = tiny_bst(seed=1, dtype=torch.float64)
    prompt, goal, horizon = [4, 0], [1], 2
    result = decode.plan(model, prompt, goal, horizon=horizon, rollouts=4, eos_id=EOS)
    unknown = decode.plan(model, prompt, (), horizon=horizon, rollouts=4, eos_id=EOS)
    assert result.scores.dtype == unknown.scores.dtype == torch.float64
    end = len(prompt) + horizon
    with torch.no_grad():
        for plan, first, head in ((result, end, 0), (unknown, len(prompt), 1)):
            for cand, score in zip(plan.candidates, plan.scores.tolist()):
                row = torch.tensor([cand.tolist() + [EOS]])
                f, b = model.prefix_states(row)[0], model.suffix_states(row)[0]
                want = sum(float(F.log_softmax(model.logits(f[p - 1], b[p + 1])[head], -1)[row[0, p]])
                           for p in range(first, row.shape[1] - 1))
                assert abs(score - want) < 1e-12, (score, want)
        seqs, logp = decode.beam_search(model, prompt, 2, beams=25, goal=goal, eos_id=EOS)
        assert logp.dtype == torch.float64
        b = model.suffix_states(torch.tensor([goal + [EOS]]))[0, 0]
        for seq, score in zip(seqs.tolist(), logp.tolist()):
            want = 0.0
            for d in range(len(seq)):
                f = model.prefix_states(torch.tensor([prompt + seq[:d]]))[0, -1]
                want += float(F.log_softmax(model.logits(f, b)[0], -1)[seq[d]])
            assert abs(score - want) < 1e-12, (score, want)


def test_sample_checks_temperature_top_k_and_stop_token_like_the_other_numbers():
    model = tiny_bst()
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        decode.sample(model, [4, 0], 2, EOS, temperature=True)  # a bool is no temperature
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary size 5, got 6"):
        decode.sample(model, [4, 0], 2, EOS, top_k=6)  # was "keep all"
    assert decode.sample(model, [4, 0], 2, EOS, top_k=5, generator=torch.Generator().manual_seed(0)).shape == (1, 2)
    # numpy integers are ints here as in every other count and id (check_int)
    greedy = decode.sample(model, [4, 0], 3, EOS, temperature=0, stop_token=2)
    assert torch.equal(decode.sample(model, [4, 0], 3, EOS, temperature=0, stop_token=np.int64(2)), greedy)
    assert decode.sample(model, [4, 0], 2, EOS, temperature=np.float32(0.5),
                         generator=torch.Generator().manual_seed(0)).shape == (1, 2)


def test_plan_docstring_states_the_papers_k_plus_1_factors():
    doc = " ".join(decode.plan.__doc__.split())
    assert "k + 1 factors" in doc and "score_last=k + 1" in doc


# ---------------------------------------------------------------- generate CLI (items 5, 11)

@pytest.fixture(scope="module")
def star_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("star")
    d = TrainConfig.load(TINY).to_dict()
    d.update(out_dir=str(out), steps=2, eval_every=2, ckpt_every=0)
    train(TrainConfig.from_dict(d))
    return out


GRAPH = "0 1 | 1 2 | 0 3 | 3 4 / 0 4 ="  # star_path_len 3: the path is 0 3 4


def test_generate_default_horizon_leaves_out_the_path_nodes_in_the_prompt(star_ckpt, capsys):
    run = lambda *flags: main(["generate", "--checkpoint", str(star_ckpt), *flags])
    for prefix, suffix, n in ((GRAPH, None, 3), (GRAPH + " 0", None, 2), (GRAPH + " 0 3", None, 1),
                              (GRAPH + " 0", "4", 1), (GRAPH + " 0 3", "4", 0)):
        assert run("--prefix", prefix, *(["--suffix", suffix] if suffix else [])) == 0
        generated = capsys.readouterr().out.splitlines()[1]
        assert len(generated.split()) == 1 + n, (prefix, suffix, generated)
    assert run("--prefix", GRAPH + " 0 3", "--suffix", "3 4") == 2
    assert "--prefix holds 2 path nodes after '=' and --suffix 2: more than a path's 3 nodes" in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--horizon", "-1"], "--horizon must be an int >= 0, got -1"),
    (["--search", "sample", "--top-k", "0"], "--top-k must be an int >= 1"),
    (["--search", "sample", "--top-k", "100"], "--top-k must be an int >= 1 and <= 18 (the vocabulary size)"),
    (["--rollouts", "0"], "--rollouts must be an int >= 1"),
    (["--search", "beam", "--beams", "0"], "--beams must be an int >= 1"),
    (["--search", "sample", "--temperature", "-1"], "--temperature must be a finite number"),
])
def test_generate_errors_name_the_flag_typed(star_ckpt, capsys, flags, says):
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", GRAPH, *flags]) == 2
    assert says in capsys.readouterr().err


class _TiedSearch:
    """A searcher stub: logits [5, 5, 0, -1] at every step (tokens 0 and 1 tied first)."""

    def start(self, prefix, goal):
        self.B = prefix.shape[0]
        return torch.tensor([[5.0, 5.0, 0.0, -1.0]]).expand(self.B, 4)

    def step(self, token):
        return self.start(torch.zeros(self.B, 1), ())

    def score(self, *args):  # (a search interface has one; sample does not call it)
        raise AssertionError


@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324])
def test_sampling_at_a_temperature_below_float32s_smallest_number_is_the_greedy_limit(temperature):
    """A temperature under float32's smallest number (1e-46) is 0 there: the row's maximum was 0 / 0,
    NaN, and torch.multinomial refused ('probability tensor contains either inf, nan ...'). The limit
    T -> 0 is drawn: greedy where the maximum is one token, the tied maxima evenly."""
    model = tiny_bst()
    for prompt in ([4, 0], [4, 1, 2], [4, 3, 3, 0]):
        greedy = decode.sample(model, prompt, 4, EOS, temperature=0)
        for top_k in (None, 2):
            got = decode.sample(model, prompt, 4, EOS, temperature=temperature, top_k=top_k,
                                generator=torch.Generator().manual_seed(1))
            assert torch.equal(got, greedy), (prompt, top_k)
    drawn = decode.sample(_TiedSearch(), torch.zeros(400, 1, dtype=torch.long), 1, temperature=temperature,
                          generator=torch.Generator().manual_seed(0))[:, 0]
    counts = torch.bincount(drawn, minlength=4).tolist()
    assert counts[2:] == [0, 0] and 150 < counts[0] < 250, counts


@pytest.mark.parametrize("word", ["١", "²", "٣"])
def test_generate_reads_star_nodes_in_ascii_digits_only(star_ckpt, capsys, word):
    """'١' (Arabic-Indic one: str.isdigit, int() reads 1) was silently node 1; '²' was int()'s own
    message, naming no flag."""
    for flags, option in ((["--prefix", f"{GRAPH} {word}"], "--prefix"), (["--prefix", GRAPH, "--suffix", word], "--suffix")):
        assert main(["generate", "--checkpoint", str(star_ckpt), *flags]) == 2
        err = capsys.readouterr().err
        assert f"{option}: '{word}' is out of the star-graph vocabulary" in err and "ASCII digits" in err, err


def test_generate_names_a_horizon_past_max_len(star_ckpt, capsys):
    """A --horizon past the model's positions was refused in decode's words, naming no flag; the
    largest that fits is stated and decodes. The prompt is 16 tokens of max_len 20: sampling reads
    the generated tokens but the last (at most 5), planning the horizon, goal and EOS (at most 2)."""
    run = lambda *flags: main(["generate", "--checkpoint", str(star_ckpt), "--prefix", GRAPH, *flags])
    for flags, most in ((["--horizon", "6"], 5), (["--horizon", "6", "--search", "beam", "--beams", "2"], 5),
                        (["--horizon", "3", "--suffix", "4"], 2), (["--horizon", "1000"], 5)):
        assert run(*flags) == 2, flags
        err = capsys.readouterr().err
        assert f"--horizon {flags[1]} does not fit the model's max_len 20" in err and f"at most {most}" in err, err
        flags[1] = str(most)
        assert run(*flags) == 0, (flags, capsys.readouterr().err)
        capsys.readouterr()
