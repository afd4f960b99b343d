"""Decoding and evaluation: Algorithm 1 on hand-set probabilities, beam search against exhaustive
search, KV-cached decoding against full re-encoding, probes, the baseline methods and the generate CLI."""
import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bst_fast import decode
from bst_fast.__main__ import main
from bst_fast.model import BeliefStateTransformer, ForwardOnly, ModelConfig
from bst_fast import TrainConfig, load_tokenizer, train
from _helpers import star_fields_for

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
EOS = 3


# Many tiny ops: single-threaded (conftest's one_thread), or a shared CPU makes them 20x slower.
pytestmark = pytest.mark.usefixtures("one_thread")


class TableModel:
    """The search interface over hand-set tables: next[prefix tuple] = probabilities of the next token,
    score[candidate tuple] = its log score. It records what the planner asked for."""

    def __init__(self, next_probs, scores):
        self.next_probs, self.scores, self.calls = next_probs, scores, []

    def _logits(self):
        return torch.tensor([self.next_probs[tuple(s)] for s in self.rows]).log()

    def start(self, prefix, goal=()):
        self.rows = [list(map(int, r)) for r in prefix]
        self.calls.append(("start", tuple(self.rows[0]), tuple(int(g) for g in goal)))
        return self._logits()

    def step(self, tokens):
        for row, t in zip(self.rows, tokens.tolist()):
            row.append(t)
        return self._logits()

    def reorder(self, index):
        self.rows = [list(self.rows[i]) for i in index.tolist()]

    def score(self, seqs, first, head="next"):
        self.calls.append(("score", first, head))
        return torch.tensor([self.scores[tuple(r[:-1].tolist())] for r in seqs])


NEXT = {(0,): [0.5, 0.3, 0.2], (0, 0): [0.1, 0.1, 0.8], (0, 1): [0.2, 0.7, 0.1], (0, 2): [0.6, 0.3, 0.1]}


def test_plan_follows_algorithm_1_on_known_probabilities():
    # Rollout 1 is greedy: 0 -> 0 -> 2, pushing (0,1) r=.6, (0,2) r=.4, (0,0,0) r=.125, (0,0,1) r=.125.
    # Rollout 2 pops (0,1): greedy 1, pushes (0,1,0) r=.6*.2/.7=.171, (0,1,2) r=.086.
    # Rollout 3 pops (0,2): greedy 0, pushes (0,2,1) r=.4*.3/.6=.2, (0,2,2) r=.067.
    # Rollout 4 pops (0,2,1) (r=.2, the highest), already horizon long.
    scores = {(0, 0, 2, 1): -3.0, (0, 1, 1, 1): -1.0, (0, 2, 0, 1): -2.0, (0, 2, 1, 1): -0.5}
    stub = TableModel(NEXT, scores)
    result = decode.plan(stub, [0], goal=[1], horizon=2, rollouts=4, eos_id=EOS)
    assert [c.tolist() for c in result.candidates] == [[0, 0, 2, 1], [0, 1, 1, 1], [0, 2, 0, 1], [0, 2, 1, 1]]
    assert result.best.tolist() == [0, 2, 1, 1]
    assert result.scores.tolist() == [-3.0, -1.0, -2.0, -0.5]
    # Goal known: the goal tokens (from position 3) are scored by the Next head, once, in a batch.
    assert stub.calls[-1] == ("score", 3, "next") and sum(c[0] == "score" for c in stub.calls) == 1
    assert [c[1] for c in stub.calls if c[0] == "start"] == [(0,), (0, 1), (0, 2)]
    assert all(c[2] == (1,) for c in stub.calls if c[0] == "start")


def test_unconditional_plan_scores_last_tokens_with_prev_head():
    scores = {(0, 0, 2): -3.0, (0, 1, 1): -0.1, (0, 2, 0): -2.0}
    stub = TableModel(NEXT, scores)
    result = decode.plan(stub, [0], goal=[], horizon=2, rollouts=3, eos_id=EOS, score_last=1)
    assert result.best.tolist() == [0, 1, 1]
    assert stub.calls[-1] == ("score", 2, "prev")  # the last 1 token of 3
    assert all(c[2] == () for c in stub.calls if c[0] == "start")


def tiny_bst(V=5, shared=False, seed=0, scale=30.0, head_type="mlp"):
    torch.manual_seed(seed)
    model = BeliefStateTransformer(ModelConfig(vocab_size=V, max_len=24, n_layer=2, d_model=16, n_head=2,
                                               head_hidden=16, shared_encoders=shared, head_type=head_type)).eval()
    with torch.no_grad():  # spread the probabilities so that orders are not decided by rounding
        (model.head.layers[-1] if head_type == "mlp" else model.head.lm_head).weight.mul_(scale)
    return model


def tiny_forward(V=5, seed=0):
    torch.manual_seed(seed)
    model = ForwardOnly(ModelConfig(vocab_size=V, max_len=24, n_layer=2, d_model=16, n_head=2)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def full_next_logits(model, seq, goal):
    """Next logits after seq by re-encoding everything (no cache)."""
    seq = torch.tensor([seq])
    if isinstance(model, ForwardOnly):
        return model.lm_head(model.forward_encoder(seq))[0, -1]
    f = model.prefix_states(seq)[0, -1]
    # the goal state built here, not by the BSTSearch under test: B(goal + EOS) at its first token
    b = model.suffix_states(torch.tensor([list(goal) + [EOS]]))[0, 0]
    return model.logits(f, b)[0]


@pytest.mark.parametrize("kind", ["bst", "bst_shared", "bst_swiglu", "forward"])
def test_cached_decoding_equals_full_reencoding(kind):
    model = tiny_forward() if kind == "forward" else \
        tiny_bst(shared=kind == "bst_shared", head_type="swiglu" if kind == "bst_swiglu" else "mlp")
    goal = [] if kind == "forward" else [2, 1]
    prompt = [4, 0, 1]
    with torch.no_grad():
        out = decode.sample(model, torch.tensor([prompt]), 10, EOS, temperature=0, goal=goal)[0].tolist()
        seq, search = list(prompt), decode.searcher(model, EOS)
        cached = search.start(torch.tensor([prompt]), goal)[0]
        for t in out:
            full = full_next_logits(model, seq, goal)
            assert torch.allclose(cached, full, atol=1e-5, rtol=1e-5)
            assert int(full.argmax()) == t
            seq.append(t)
            cached = search.step(torch.tensor([t]))[0]


@pytest.mark.parametrize("call, name", [
    (lambda m: decode.sample(m, [0, 1], 2, EOS, top_k=0), "top_k"),
    (lambda m: decode.sample(m, [0, 1], 2, EOS, top_k=-1), "top_k"),
    (lambda m: decode.sample(m, [0, 1], 2, EOS, temperature=-1.0), "temperature"),
    (lambda m: decode.sample(m, [0, 1], 2, EOS, temperature=float("nan")), "temperature"),
    (lambda m: decode.sample(m, [0, 1], -1, EOS), "n_new"),
    (lambda m: decode.sample(m, [], 2, EOS), "prefix"),
    (lambda m: decode.sample(m, [0, 7], 2, EOS), "prefix"),
    (lambda m: decode.sample(m, [0, 1], 2, 9), "eos_id"),
    (lambda m: decode.plan(m, [0, 1], [2], horizon=2, rollouts=0, eos_id=EOS), "rollouts"),
    (lambda m: decode.plan(m, [0, 1], [2], horizon=-1, eos_id=EOS), "horizon"),
    (lambda m: decode.plan(m, [], [2], horizon=2, eos_id=EOS), "prompt"),
    (lambda m: decode.plan(m, [0, 1], [5], horizon=2, eos_id=EOS), "goal"),
    (lambda m: decode.plan(m, [0, 1], [1.5], horizon=2, eos_id=EOS), "goal"),
    (lambda m: decode.plan(m, [0, 1], (), horizon=2, eos_id=EOS, score_last=0), "score_last"),
    (lambda m: decode.beam_search(m, [0, 1], 2, beams=0, eos_id=EOS), "beams"),
    (lambda m: decode.beam_search(m, [0, 1], -2, eos_id=EOS), "n_new"),
    (lambda m: decode.beam_search(m, [0, -1], 2, eos_id=EOS), "prompt"),
    # a batch of prompts or goals is refused, not glued into one sequence
    (lambda m: decode.plan(m, [[4, 0], [4, 1]], [1], horizon=2, rollouts=2, eos_id=EOS), "prompt"),
    (lambda m: decode.plan(m, [4, 0], [[1], [2]], horizon=1, rollouts=1, eos_id=EOS), "goal"),
    (lambda m: decode.beam_search(m, [[4, 0], [4, 1]], 2, eos_id=EOS), "prompt"),
    (lambda m: decode.sample(m, [4, 0], 2, EOS, goal=[[1], [2]]), "goal"),
    # score_last: only without a goal, and no more than the tokens there are (never clamped)
    (lambda m: decode.plan(m, [4, 0], [1], horizon=2, eos_id=EOS, score_last=1), "score_last"),
    (lambda m: decode.plan(m, [4, 0], (), horizon=2, eos_id=EOS, score_last=4), "score_last"),
    (lambda m: decode.plan(m, [4] * 20, [1, 2, 3], horizon=1, eos_id=EOS), "max_len"),
    (lambda m: decode.sample(m, [4, 0], 2, EOS, goal=[1] * 24), "goal and EOS"),
    # no comparison of uint16/32/64 in torch: refused by name, not a NotImplementedError from min()
    (lambda m: decode.sample(m, torch.tensor([4, 0], dtype=torch.uint64), 2, EOS), r"prefix must hold integer token ids .*uint64"),
    (lambda m: decode.plan(m, [4, 0], torch.tensor([1], dtype=torch.uint64), horizon=2, eos_id=EOS), r"goal must hold integer.*uint64"),
    (lambda m: decode.BSTSearch(m, EOS).score(torch.zeros(1, 5, dtype=torch.long), 1, "nxt"), "head"),
    (lambda m: decode.plan(tiny_forward(), [4, 0], (), horizon=2, rollouts=3, eos_id=EOS), "Belief State Transformer"),
    (lambda m: decode.belief_states(m, [[4, 0, 1]], torch.tensor([0])), "lengths"),
    (lambda m: decode.belief_states(m, [[4, 0, 1]], torch.tensor([4])), "lengths"),
    (lambda m: decode.probe_future_tokens(m, torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long),
                                          1, [0]), "ks"),
    (lambda m: decode.probe_future_tokens(m, torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, 5, dtype=torch.long),
                                          2, [1, 3]), "position"),
])
def test_bad_decoding_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call(tiny_bst())


def test_decoding_counts_take_numpy_and_torch_integers_and_the_goal_apart():
    import numpy as np

    model = tiny_bst()
    want = decode.sample(model, [4, 0], 3, EOS, temperature=0)
    assert torch.equal(decode.sample(model, [4, 0], np.int64(3), EOS, temperature=0), want)
    assert torch.equal(decode.sample(model, [4, 0], torch.tensor(3), EOS, temperature=0), want)
    # The goal is read by the backward encoder, apart from the prompt: a 20-token prompt and a
    # 3-token goal fit max_len 24 for sampling and beam search alike.
    assert decode.sample(model, [4] * 20, 2, EOS, goal=[1, 2, 0], temperature=0).shape == (1, 2)
    assert decode.beam_search(model, [4] * 20, 2, beams=1, goal=[1, 2, 0], eos_id=EOS)[0].shape == (1, 2)


def test_a_tiny_temperature_samples_the_greedy_token():
    model = tiny_bst(scale=3000.0)  # logits of tens: dividing them by 1e-38 overflowed to inf - inf
    greedy = decode.sample(model, [4, 0, 1], 3, EOS, temperature=0)
    assert torch.equal(decode.sample(model, [4, 0, 1], 3, EOS, temperature=1e-38), greedy)


def test_plan_pruning_keeps_ties_in_vocabulary_order():
    # After 0, 0 the five alternatives tie (priority 1): the full push (rollouts 8) and the pruned one
    # (rollouts 2: room for one alternative) must both take the first of them in vocabulary order.
    V = 6
    table = {(0,): [0.4] + [0.12] * 5}
    table.update({(0, a): [1 / 6] * V for a in range(V)})
    for n in (2, 8):
        stub = TableModel(table, {tuple(s): 0.0 for s in itertools.product([0], range(V), range(V), [1])})
        cands = decode.plan(stub, [0], goal=[1], horizon=2, rollouts=n, eos_id=EOS).candidates
        assert [c.tolist() for c in cands[:2]] == [[0, 0, 0, 1], [0, 0, 1, 1]], n


def test_top_k_sampling_stays_in_top_k():
    model = tiny_bst()
    gen = torch.Generator().manual_seed(0)
    prompts = torch.tensor([[4, 0, 1]] * 64)
    first = decode.sample(model, prompts, 1, EOS, top_k=2, generator=gen)[:, 0]
    allowed = full_next_logits(model, [4, 0, 1], []).topk(2).indices.tolist()
    assert set(first.tolist()) <= set(allowed) and len(set(first.tolist())) == 2


def test_top_k_keeps_exactly_k_of_tied_tokens():
    """A threshold at the k-th logit kept every token tied with it: all equal logits and top_k=1
    drew every token."""
    model = tiny_bst()
    with torch.no_grad():
        model.head.layers[-1].weight.zero_()
        model.head.layers[-1].bias.zero_()  # every Next logit 0: all tied
    for k in (1, 2, 4):  # exactly k, the lowest indices among the tied (topk's own choice is not)
        draws = decode.sample(model, torch.tensor([[4, 0, 1]] * 64), 1, EOS, top_k=k,
                              generator=torch.Generator().manual_seed(0))
        assert set(draws[:, 0].tolist()) == set(range(k))


def test_decoders_run_the_model_in_eval_mode_and_restore_its_modes():
    """With dropout 0.5 in training mode, greedy decoding and beam search were random (18 greedy
    outputs of 20 differed); every decoder now runs in eval mode and hands the modes back."""
    torch.manual_seed(0)
    model = BeliefStateTransformer(ModelConfig(vocab_size=5, max_len=24, n_layer=2, d_model=16, n_head=2,
                                               head_hidden=16, dropout=0.5))
    model.head.eval()  # a submodule's own mode is kept
    with torch.no_grad():
        model.head.layers[-1].weight.mul_(30.0)
    runs = [(decode.sample(model, [4, 0, 1], 4, EOS, temperature=0),
             decode.beam_search(model, [4, 0, 1], 3, beams=3, eos_id=EOS),
             decode.plan(model, [4, 0, 1], [2], horizon=2, rollouts=4, eos_id=EOS).scores,
             decode.belief_states(model, [[4, 0, 1]])) for _ in range(3)]
    flat = [[torch.as_tensor(x) for x in (g, *bs, p, f)] for g, bs, p, f in runs]
    assert all(torch.equal(x, y) for other in flat[1:] for x, y in zip(flat[0], other))
    assert model.training and model.forward_encoder.training and not model.head.training
    # a searcher handed over in the model's place decodes in eval mode too
    search = lambda: decode.searcher(model, EOS)
    assert torch.equal(decode.sample(search(), [4, 0, 1], 4, EOS, temperature=0), runs[0][0])
    assert model.training and not model.head.training


@pytest.mark.parametrize("kind", ["bst", "fim"])
def test_beam_search_equals_exhaustive_search(kind):
    V, depth = 4, 3
    model = tiny_bst(V=V, seed=1) if kind == "bst" else tiny_forward(V=V, seed=1)
    prompt, goal = ([0, 1], [2]) if kind == "bst" else ([2, 0, 1], [])  # FIM: the goal is in the prompt
    with torch.no_grad():
        exhaustive = []
        for u in itertools.product(range(V), repeat=depth):
            logp = sum(float(F.log_softmax(full_next_logits(model, prompt + list(u[:d]), goal), -1)[u[d]])
                       for d in range(depth))
            exhaustive.append((logp, list(u)))
        exhaustive.sort(key=lambda x: -x[0])
        beams = V ** (depth - 1)  # wide enough that pruning never drops a prefix of a top sequence
        seqs, logp = decode.beam_search(model, prompt, depth, beams=beams, goal=goal, eos_id=EOS)
    assert [s.tolist() for s in seqs] == [u for _, u in exhaustive[:beams]]
    assert torch.allclose(logp, torch.tensor([lp for lp, _ in exhaustive[:beams]]), atol=1e-4)


def greedy_by_reencoding(model, prompt, goal, n):
    """n greedy tokens after prompt, the Next head reading B(goal + EOS) (B(EOS) for no goal), every
    step by full re-encoding: no cache and no search interface."""
    b = model.suffix_states(torch.tensor([list(goal) + [EOS]]))[0, 0]
    seq = list(prompt)
    for _ in range(n):
        f = model.prefix_states(torch.tensor([seq]))[0, -1]
        seq.append(int(model.logits(f, b)[0].argmax()))
    return seq[len(prompt):]


def plan_by_reencoding(model, prompt, goal, horizon, rollouts):
    """Algorithm 1's candidates, written out with full re-encoding: pop the highest priority (first
    pushed among equals), extend it greedily given B(goal), push every other token x with priority
    r * p(x) / p(x_max), r the popped priority."""
    b = model.suffix_states(torch.tensor([list(goal) + [EOS]]))[0, 0]
    order = itertools.count()
    queue, candidates = [(1.0, next(order), list(prompt))], []
    for _ in range(rollouts):
        entry = max(queue, key=lambda e: (e[0], -e[1]))
        queue.remove(entry)
        r, _, s = entry
        while len(s) < len(prompt) + horizon:
            p = model.logits(model.prefix_states(torch.tensor([s]))[0, -1], b)[0].softmax(-1)
            x_max = int(p.argmax())
            queue += [(r * float(p[x] / p[x_max]), next(order), s + [x]) for x in range(len(p)) if x != x_max]
            s = s + [x_max]
        candidates.append(s + list(goal))
    return candidates


def test_known_goal_score_and_plan_on_a_real_model():
    # A model whose greedy path depends on the goal: an error that drops the goal (the empty suffix
    # read instead) changes the first roll-out.
    model = tiny_bst(seed=1)
    prompt, horizon = [4, 0], 3
    with torch.no_grad():
        paths = {tuple(goal): greedy_by_reencoding(model, prompt, goal, horizon) for goal in ([], [1], [0])}
    assert len({tuple(p) for p in paths.values()}) == 3, f"the greedy path must depend on the goal: {paths}"
    for goal in ([1], [0]):
        result = decode.plan(model, prompt, goal, horizon=horizon, rollouts=5, eos_id=EOS)
        assert len(result.candidates) == 5 and len({tuple(c.tolist()) for c in result.candidates}) == 5
        # The first roll-out is greedy given B(goal); so is sample at temperature 0 with the goal.
        greedy = paths[tuple(goal)]
        assert result.candidates[0].tolist() == prompt + greedy + goal
        assert decode.sample(model, torch.tensor([prompt]), horizon, EOS, temperature=0, goal=goal)[0].tolist() == greedy
        # Every roll-out reads the goal: all candidates are those of Algorithm 1 given B(goal).
        with torch.no_grad():
            assert [c.tolist() for c in result.candidates] == plan_by_reencoding(model, prompt, goal, horizon, 5)
        # Known-goal score by hand: each goal token given its prefix and the rest of the goal (+ EOS) as suffix.
        want = []
        with torch.no_grad():
            for cand in result.candidates:
                row = torch.tensor([cand.tolist() + [EOS]])
                f, b = model.prefix_states(row)[0], model.suffix_states(row)[0]
                want.append(sum(float(F.log_softmax(model.logits(f[p - 1], b[p + 1])[0], -1)[row[0, p]])
                                for p in range(len(prompt) + horizon, row.shape[1] - 1)))
        for score, w in zip(result.scores.tolist(), want):
            assert math.isclose(score, w, rel_tol=1e-4, abs_tol=1e-5)
        # The plan is a candidate whose hand-computed score is the highest (up to the rounding above).
        chosen = [k for k, c in enumerate(result.candidates) if c.tolist() == result.best.tolist()]
        assert len(chosen) == 1 and want[chosen[0]] >= max(want) - 1e-4 * abs(max(want)) - 1e-5


def test_unknown_goal_score_on_a_real_model_is_the_prev_heads():
    # Without a goal, each candidate's score is the Prev head's log-probability of its last
    # `score_last` tokens, each given the prefix before it and the rest (+ EOS) as suffix.
    model = tiny_bst(seed=1)
    prompt, horizon, last = [4, 0], 3, 2
    result = decode.plan(model, prompt, (), horizon=horizon, rollouts=4, eos_id=EOS, score_last=last)
    end = len(prompt) + horizon
    with torch.no_grad():
        for cand, score in zip(result.candidates, result.scores.tolist()):
            row = torch.tensor([cand.tolist() + [EOS]])
            f, b = model.prefix_states(row)[0], model.suffix_states(row)[0]
            prev = [float(F.log_softmax(model.logits(f[p - 1], b[p + 1])[1], -1)[row[0, p]]) for p in range(end - last, end)]
            nxt = [float(F.log_softmax(model.logits(f[p - 1], b[p + 1])[0], -1)[row[0, p]]) for p in range(end - last, end)]
            assert math.isclose(score, sum(prev), rel_tol=1e-4, abs_tol=1e-5)
            assert not math.isclose(sum(prev), sum(nxt), rel_tol=1e-3)  # the heads differ: the test can tell


def test_belief_states_and_probe_known_cases():
    model = tiny_bst()
    tokens = torch.tensor([[4, 0, 1, 2, 0], [4, 1, 1, 0, 0]])
    lengths = torch.tensor([5, 3])
    with torch.no_grad():
        f = model.prefix_states(tokens)
    states = decode.belief_states(model, tokens, lengths)
    assert torch.allclose(states, torch.stack([f[0, 4], f[1, 2]]))
    # Constant states: the probe can only predict the training majority (class 0, 6 of 10), so its
    # test accuracy is exactly the share of 0s in the test labels.
    zeros = torch.zeros(10, 4)
    acc = decode.probe_accuracy(zeros, torch.tensor([0] * 6 + [1] * 4), zeros, torch.tensor([0] * 3 + [1] * 7))
    assert acc == pytest.approx(0.3)
    # States that hold the label (one-hot): perfect.
    y = torch.arange(20) % 4
    assert decode.probe_accuracy(F.one_hot(y, 4).float(), y, F.one_hot(y, 4).float(), y) == 1.0


def tiny(tmp_path, **changes):
    d = TrainConfig.load(TINY).to_dict()
    d.update(out_dir=str(tmp_path), **{**star_fields_for(changes.get("data", "star")), **changes})
    return TrainConfig.from_dict(d)


TINY_MODEL = {"n_layer": 1, "d_model": 16, "n_head": 2, "head_hidden": 16}


@pytest.mark.parametrize("changes", [{"method": "augment"}, {"method": "fim"}, {"method": "teacherless"},
                                     {"method": "bst", "next_weight": 1.0},
                                     {"method": "bst", "model": {**TINY_MODEL, "backward_encoder": False}}])
def test_each_method_trains(tmp_path, changes):
    # A fixed training set of one batch and a constant learning rate: every step trains on the same
    # graphs (up to the method's random transform), so the loss must fall.
    cfg = tiny(tmp_path, steps=5, eval_every=5, ckpt_every=0, log_every=1, n_train=8, batch_size=8,
               warmup=0, lr=1e-2, min_lr=1e-2, **changes)
    result = train(cfg)
    rows = (tmp_path / "metrics.csv").read_text().splitlines()[1:]
    losses = [float(v) for s, k, v in (r.split(",") for r in rows) if k == "loss"]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, f"the loss did not fall: {losses}"
    assert result["loss"] == losses[-1] and 0.0 <= result["path_accuracy"] <= 1.0


def test_method_data_transforms():
    from bst_fast.tasks import StarTask as _StarTask

    cfg = tiny("/tmp/unused", method="augment", augment_prob=1.0, star_path_len=4, star_nodes=12)
    task = _StarTask(cfg)
    plain = task.stream.batch(0, 8)
    rows, _, _ = task.batch(0, 8)
    ps = task.prefix_start
    assert torch.equal(rows[:, :ps - 1], plain[:, :ps - 1]) and torch.equal(rows[:, ps:], plain[:, ps:])
    assert all(int(r[ps - 1]) in r[ps + 2:ps + 4].tolist() for r in rows)  # an intermediate node n_2 or n_3
    cfg.method = "fim"
    task = _StarTask(cfg)
    rows, lengths, starts = task.batch(0, 8)
    tok = task.tok
    for r, n, s in zip(rows, lengths, starts):
        r = r[:n].tolist()
        assert r[s] == tok.answer_id and r[ps] == tok.edge_sep_id and r[-1] == tok.eos_id
        suffix, path = r[ps + 1:s], r[s + 1:-1]
        assert 1 <= len(suffix) <= 3 and path[-len(suffix):] == suffix
    # The test prompt gives FIM the goal alone as its suffix.
    t = task.test_rows[0].tolist()
    assert t[task.test_start - 1] == t[ps - 1] and t[task.test_start - 2] == tok.edge_sep_id


@pytest.fixture(scope="module")
def star_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("star")
    train(tiny(out, steps=2, eval_every=2, ckpt_every=0))
    return out


def test_generate_cli_star(star_ckpt, capsys, monkeypatch):
    prefix = "0 1 | 1 2 | 0 3 | 3 4 / 0 4 ="
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"prefix:    {prefix}\ngenerated: ") and len(out.splitlines()[1].split()) == 4
    # the tokens as drawn: an <eos> or <pad> among them is shown, not dropped ("generated: 4" for
    # EOS, 4, EOS before)
    monkeypatch.setattr(decode, "sample", lambda *a, **k: torch.tensor([[14, 4, 12]]))  # 12 nodes: PAD 12, EOS 14
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix]) == 0
    assert capsys.readouterr().out.splitlines()[1] == "generated: <eos> 4 <pad>"
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix, "--suffix", "4",
                 "--rollouts", "3", "--horizon", "2"]) == 0
    out = capsys.readouterr().out
    assert "suffix:    4" in out and "search: plan" in out
    # the default horizon with a goal: the path's nodes before it (star_path_len 3, goal 4: 2 nodes)
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix, "--suffix", "4", "--rollouts", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()[1].split()) == 1 + 2


def test_generate_cli_fim_reads_the_suffix_in_its_prompt(tmp_path, capsys):
    """A FIM checkpoint takes --suffix into its prompt and decodes greedily by default (planning
    is for a BST)."""
    train(tiny(tmp_path, method="fim", steps=2, eval_every=2, ckpt_every=0))
    prefix = "0 1 | 1 2 | 0 3 | 3 4 / 0 4 ="
    assert main(["generate", "--checkpoint", str(tmp_path), "--prefix", prefix, "--suffix", "4"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert "| 4 =" in out.splitlines()[0] and len(out.splitlines()[1].split()) == 1 + 3  # the whole path
    # without --suffix it is given the goal (as its evaluation is): the prompt FIM trained on
    assert main(["generate", "--checkpoint", str(tmp_path), "--prefix", prefix]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == out
    for bad in (prefix + " 0", "="):  # path nodes after '=' (never in training); no goal before it
        assert main(["generate", "--checkpoint", str(tmp_path), "--prefix", bad]) == 2
        assert "a fim star-graph prefix" in capsys.readouterr().err
    # a prompt in FIM form already is decoded as it is (it got a second suffix: '| 4 | 4 =')
    fim = prefix[:-1] + "| 4 ="
    assert main(["generate", "--checkpoint", str(tmp_path), "--prefix", fim]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == out
    assert main(["generate", "--checkpoint", str(tmp_path), "--prefix", fim, "--suffix", "4"]) == 2
    assert "carries its suffix already" in capsys.readouterr().err


def test_generate_cli_refuses_what_a_checkpoint_was_not_trained_on(tmp_path, capsys):
    """A teacherless model's prompt ends at '=' (dummies follow it in training); a BST whose Next
    head got no gradient (next_weight 0, or gamma 1) is decoded with its GPT head, forward only, not
    with that head. A star-graph BST run that would evaluate such a head is refused before it trains."""
    train(tiny(tmp_path / "tl", method="teacherless", steps=2, eval_every=2, ckpt_every=0))
    prefix = "0 1 | 1 2 | 0 3 | 3 4 / 0 4 ="
    assert main(["generate", "--checkpoint", str(tmp_path / "tl"), "--prefix", prefix]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "tl"), "--prefix", prefix + " 0"]) == 2
    assert "a teacherless star-graph prefix must end with '='" in capsys.readouterr().err
    with pytest.raises(ValueError, match="config field 'next_weight' must be > 0, or gamma > 0, for a star-graph BST"):
        tiny(tmp_path / "x", next_weight=0.0).check()
    # with gamma > 0 the evaluation decodes with the GPT head, and reads no Next head
    from bst_fast.tasks import StarTask, build_model, model_config

    for changes, want in (({"next_weight": 0.0, "gamma": 0.9}, "gpt"), ({"gamma": 1.0}, "gpt"), ({"gamma": 0.5}, "head")):
        cfg = tiny(tmp_path / "x", **changes).check()
        task = StarTask(cfg)
        model = build_model(model_config(cfg, task))
        calls = {"gpt": 0, "head": 0}
        for name in calls:
            getattr(model, name).register_forward_hook(lambda *a, name=name: calls.__setitem__(name, calls[name] + 1))
        assert 0 <= task.evaluate(model, "cpu")["path_accuracy"] <= 1
        assert calls[want] > 0 and calls[{"gpt": "head", "head": "gpt"}[want]] == 0, (changes, calls)
    corpus = tmp_path / "t.txt"
    corpus.write_text("\n\n".join(f"a cat {w} the ball" for w in ("saw", "found", "lost", "kicked")) + "\n")
    train(tiny(tmp_path / "nw0", data=str(corpus), text_vocab=280, max_len=16, steps=3, batch_size=2, eval_every=0,
               ckpt_every=0, next_weight=0.0, gamma=0.9))  # the paper's improved BST: decoded with its GPT head
    args = ["generate", "--checkpoint", str(tmp_path / "nw0"), "--prefix", "a cat"]
    for flags in (["--suffix", "ball"], ["--search", "plan"], ["--rollouts", "3"]):
        assert main(args + flags) == 2
        assert "Next head was not trained (next_weight 0): generate decodes with its GPT head" in capsys.readouterr().err
    capsys.readouterr()
    assert main(args + ["--search", "greedy", "--horizon", "4"]) == 0, capsys.readouterr().err
    got = capsys.readouterr().out.split("\n")[1]  # not splitlines: a byte token may decode as \\x0b
    # greedy with the GPT head on F(prefix), every step re-encoding the whole row (no cache)
    from bst_fast.checkpoint import load_model
    from bst_fast.data import load_tokenizer

    model, _ = load_model(tmp_path / "nw0")
    tok = load_tokenizer(tmp_path / "nw0" / "tokenizer.json")
    seq = [tok.token_to_id("<bos>")] + tok.encode("a cat", add_special_tokens=False).ids
    new = []
    with torch.no_grad():
        for _ in range(4):
            nxt = int(model.gpt(model.prefix_states(torch.tensor([seq + new]))[0, -1]).argmax())
            new.append(nxt)
    eos = tok.token_to_id("<eos>")
    new = new[:new.index(eos)] if eos in new else new
    assert got == "generated: " + tok.decode(new)
    with pytest.raises(ValueError, match="head='gpt' needs a Belief State Transformer with a GPT head"):
        decode.searcher(tiny_bst(), head="gpt")
    with pytest.raises(ValueError, match="takes no goal"):
        decode.sample(decode.searcher(model, head="gpt"), torch.tensor([seq]), 2, goal=[5])
    with pytest.raises(ValueError, match="pass the model, not a search interface"):
        decode.searcher(decode.searcher(model, eos_id=eos), head="gpt")
    with pytest.raises(ValueError, match="pass the model, not a search interface"):  # a GPT's own head is not a BST's GPT head
        decode.searcher(decode.searcher(tiny_forward()), head="gpt")
    # a search interface's ids are checked against its model's vocabulary (a bare IndexError before)
    with pytest.raises(ValueError, match=r"prefix must hold token ids in 0\.\.4, got 40"):
        decode.sample(decode.searcher(tiny_forward()), [[1, 2, 40]], 2)
    # the model's max_len bounds the GPT head's search as it does the Next head's (max_len 16)
    with pytest.raises(ValueError, match="exceed the model's max_len 16"):
        decode.sample(decode.searcher(model, head="gpt"), torch.tensor([seq]), 40)


def test_generate_cli_errors(star_ckpt, tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path / "missing"), "--prefix", "0 ="]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", "0 1 | banana / 0 1 ="]) == 2
    assert "'banana' is out of the star-graph vocabulary" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", "0 99 ="]) == 2
    assert "'99' is out of the star-graph vocabulary" in capsys.readouterr().err
    prefix = "0 1 | 1 2 | 0 3 | 3 4 / 0 4 ="
    for flags, name in ((["--rollouts", "0"], "rollouts"), (["--search", "beam", "--beams", "0"], "beams"),
                        (["--search", "sample", "--top-k", "0"], "--top-k"),
                        (["--search", "sample", "--temperature", "-1"], "temperature"),
                        # an option of another search is refused, not ignored
                        (["--temperature", "0.5"], "--temperature applies to --search sample"),
                        (["--search", "plan", "--beams", "4"], "--beams applies to --search beam"),
                        (["--search", "beam", "--rollouts", "4"], "--rollouts applies to --search plan"),
                        (["--search", "greedy", "--seed", "1"], "--seed applies"),
                        (["--search", "sample", "--seed", str(10**20)], "--seed must be in [0, 2**63)"),
                        # a suffix longer than the path: an error, not an empty answer
                        (["--suffix", "1 2 3 4 0 1 2 3 4"], "more than a path"),
                        # specials inside the prompt or the goal: rows the model never saw
                        (["--suffix", "3 <eos>"], "--suffix: token 1 encodes as <eos>"),
                        (["--suffix", "<bos> 4"], "--suffix: token 0 encodes as <bos>")):
        assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix, *flags]) == 2, flags
        assert name in capsys.readouterr().err
    for bad, k, name in (("0 1 | 1 2 <pad> | 0 3 | 3 4 / 0 4 =", 5, "<pad>"), ("<bos> 0 1 <bos> =", 3, "<bos>"),
                         ("0 1 | 1 2 / 0 2 = 0 <eos>", 10, "<eos>")):
        assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", bad]) == 2, bad
        assert f"--prefix: token {k} encodes as {name}" in capsys.readouterr().err
    # a star-graph prompt has the rows' form, '/ s g =' then path nodes (review helper-93: one without
    # '=', or with other tokens after it, was decoded into something not a path)
    for bad in ("0 1 | 1 2 | 0 3 | 3 4 / 0 4", "= = =", "0 1 | 1 2 / 0 2 = 1 |", "0 1 | 1 2 / 0 = 2", "0 1 / 0 1 = 1 / 0 1 ="):
        assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", bad]) == 2, bad
        assert "a star-graph prefix is the graph's edges, '/', the start and goal nodes and '='" in capsys.readouterr().err
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", prefix + " 3"]) == 0  # a path node known
    capsys.readouterr()
    # a leading <bos> is the one BOS generate would put there
    assert main(["generate", "--checkpoint", str(star_ckpt), "--prefix", "<bos> " + prefix]) == 0
    capsys.readouterr()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert main(["generate", "--checkpoint", str(broken), "--prefix", "0 ="]) == 2
    assert "cannot load checkpoint" in capsys.readouterr().err


def test_generate_cli_text(tmp_path, capsys):
    corpus = tmp_path / "stories.txt"
    corpus.write_text("\n\n".join(f"Once upon a time a cat named Tom {w} the ball. The end." for w in
                                ("saw", "found", "lost", "kicked", "liked", "wanted")) + "\n")
    train(tiny(tmp_path / "run", data=str(corpus), text_vocab=300, max_len=48, steps=2, batch_size=2, eval_every=2, ckpt_every=0))
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--prefix", "Once upon a time"]
    assert main(args + ["--suffix", " The end.", "--rollouts", "4", "--horizon", "5"]) == 0
    out = capsys.readouterr().out
    assert "prefix:    Once upon a time" in out and "suffix:     The end." in out and "search: plan" in out
    assert main(args + ["--search", "beam", "--beams", "3", "--horizon", "3"]) == 0
    assert "search: beam" in capsys.readouterr().out
    assert main(args + ["--search", "sample", "--top-k", "5", "--horizon", "4"]) == 0
    # without --horizon: 32 tokens would pass max_len 48 after a goal; the default leaves room
    assert main(args + ["--suffix", " The end." * 4, "--rollouts", "2"]) == 0, capsys.readouterr().err
    # a prompt too long for a new token says how long it may be (it said "pass --horizon", which
    # cannot help: review helper-105)
    assert main(args[:-1] + [" cat" * 60]) == 2
    err = capsys.readouterr().err
    assert "leave no room for a new token within max_len 48: shorten the prompt to at most 46 tokens" in err
    # '<eos>' written in a prompt is text, as in a training document, not the EOS id
    assert main(args[:-1] + ["Once <eos> upon", "--search", "greedy", "--horizon", "2"]) == 0, capsys.readouterr().err
    assert "prefix:    Once <eos> upon" in capsys.readouterr().out
    # a middle before a suffix is shown whole, the EOS a candidate holds named: it was cut at the first
    # EOS, showing another text than the one scored (review helper-93)
    tok = load_tokenizer(tmp_path / "run" / "tokenizer.json")
    cat, eos = tok.encode(" cat", add_special_tokens=False).ids, tok.token_to_id("<eos>")
    real_plan = decode.plan

    def plan_with_eos(model, prompt, goal, **kw):
        found = real_plan(model, prompt, goal, **kw)
        best = torch.tensor(list(prompt) + [eos] + cat + list(goal))
        return found._replace(best=best)
    decode.plan, before = plan_with_eos, decode.plan
    try:
        assert main(args + ["--suffix", " The end.", "--rollouts", "2", "--horizon", str(1 + len(cat))]) == 0
    finally:
        decode.plan = before
    assert capsys.readouterr().out.splitlines()[1] == "generated: <eos> cat"
    # without a suffix the text ends at its EOS
    decode.sample, before = (lambda *a, **k: torch.tensor([cat + [eos] + cat])), decode.sample
    try:
        assert main(args + ["--search", "greedy", "--horizon", str(2 * len(cat) + 1)]) == 0
    finally:
        decode.sample = before
    assert capsys.readouterr().out.splitlines()[1] == "generated:  cat"


def test_generate_cli_refuses_a_prompt_its_tokenizer_encodes_as_special_ids(tmp_path, capsys):
    """A WordLevel tokenizer with '<eos>' as a word of its model trains on documents without the
    word, but would make the EOS id of '<eos>' written in a prompt or goal: refused, naming it."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "hello": 4, "world": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True) for name in ("<pad>", "<bos>", "<eos>")])
    tok.save(str(tmp_path / "wl.json"))
    (tmp_path / "ok.txt").write_text("\n\n".join(["hello world world", "world hello", "hello hello world"] * 4))
    train(tiny(tmp_path / "run", data=str(tmp_path / "ok.txt"), tokenizer=str(tmp_path / "wl.json"), max_len=8,
               steps=2, batch_size=2, eval_every=0, ckpt_every=0))
    args = ["generate", "--checkpoint", str(tmp_path / "run"), "--search", "greedy", "--horizon", "2"]
    assert main(args + ["--prefix", "hello world"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(args + ["--prefix", "hello <eos> world"]) == 2
    assert "--prefix: token 1 encodes as <eos> (id 2)" in capsys.readouterr().err
    assert main(args[:3] + ["--prefix", "hello", "--suffix", "world <pad>"]) == 2
    assert "--suffix: token 1 encodes as <pad> (id 0)" in capsys.readouterr().err


class CountingTable(TableModel):
    """TableModel counting step() calls; every prefix not listed gives uniform probabilities."""

    def __init__(self, next_probs):
        super().__init__(next_probs, {})
        self.steps = 0

    def _logits(self):
        return torch.tensor([self.next_probs.get(tuple(s), [1 / 3] * 3) for s in self.rows]).log()

    def step(self, tokens):
        self.steps += 1
        return super().step(tokens)


def test_sample_stops_each_row_at_the_stop_token():
    """Greedy: row 0 draws 2 (the stop token) at its second step, row 1 at its third; a finished row
    holds the stop token, and no step runs once every row has finished."""
    probs = {(0,): [0.6, 0.3, 0.1], (1,): [0.1, 0.8, 0.1], (0, 0): [0.1, 0.1, 0.8], (1, 1): [0.7, 0.2, 0.1],
             (1, 1, 0): [0.1, 0.1, 0.8], (0, 0, 2): [0.9, 0.05, 0.05]}
    stub = CountingTable(probs)
    out = decode.sample(stub, torch.tensor([[0], [1]]), 6, EOS, temperature=0, stop_token=2)
    assert out.tolist() == [[0, 2, 2, 2, 2, 2], [1, 0, 2, 2, 2, 2]]
    assert stub.steps == 2  # after the third token every row had stopped
    # without stop_token the rows run on (row 0 draws 0 after its 2)
    assert decode.sample(CountingTable(probs), torch.tensor([[0], [1]]), 3, EOS, temperature=0).tolist()[0] == [0, 2, 0]


@pytest.mark.parametrize("bad", [-1, 2.0, True, "eos"])
def test_sample_refuses_a_bad_stop_token(bad):
    with pytest.raises(ValueError, match="stop_token"):
        decode.sample(CountingTable({}), torch.tensor([[0]]), 2, EOS, temperature=0, stop_token=bad)


def test_decoders_take_uint16_and_uint32_ids():
    """A prepared corpus's ids (a uint16/uint32 memmap slice) decode as their int64 values: torch
    compares no uint16/32 tensor, so the id check casts them first (the first fix refused them)."""
    import numpy as np

    model = tiny_bst()
    want = decode.plan(model, [4, 0], [1], horizon=2, eos_id=EOS)
    for dt in (np.uint16, np.uint32):
        got = decode.plan(model, np.array([4, 0], dtype=dt), np.array([1], dtype=dt), horizon=2, eos_id=EOS)
        assert torch.equal(got.best, want.best) and torch.equal(got.scores, want.scores)
    greedy = decode.sample(model, [4, 0], 3, EOS, temperature=0)
    assert torch.equal(decode.sample(model, torch.tensor([4, 0], dtype=torch.uint16), 3, EOS, temperature=0), greedy)


def test_a_goal_is_refused_by_a_bst_without_a_backward_encoder():
    """Its suffix state is one learned vector: a goal was accepted and changed nothing (helper-93)."""
    torch.manual_seed(0)
    model = BeliefStateTransformer(ModelConfig(vocab_size=5, max_len=24, n_layer=1, d_model=16, n_head=2,
                                               backward_encoder=False)).eval()
    for call in (lambda: decode.sample(model, [0, 1], 2, eos_id=4, goal=[3]),
                 lambda: decode.beam_search(model, [0, 1], 2, beams=2, goal=[3], eos_id=4),
                 lambda: decode.plan(model, [0, 1], [3], horizon=1, rollouts=2, eos_id=4)):
        with pytest.raises(ValueError, match="no backward encoder"):
            call()
    assert decode.sample(model, [0, 1], 2, eos_id=4).shape == (1, 2)  # without a goal it decodes


def test_a_search_interface_refuses_another_eos_id():
    s = decode.searcher(tiny_bst(), 4)
    for call in (lambda: decode.plan(s, [0, 1], [3], horizon=1, rollouts=2, eos_id=2),
                 lambda: decode.sample(s, [0, 1], 2, eos_id=2), lambda: decode.beam_search(s, [0, 1], 2, eos_id=2)):
        with pytest.raises(ValueError, match=r"eos_id 2 differs from the search interface's own \(4\)"):
            call()
    assert decode.sample(s, [0, 1], 2, eos_id=4).shape == decode.sample(s, [0, 1], 2).shape == (1, 2)


def test_beam_search_breaks_ties_by_index():
    model = tiny_bst(V=5)
    with torch.no_grad():  # every continuation equally likely
        model.head.layers[-1].weight.zero_()
        model.head.layers[-1].bias.zero_()
    seqs, _ = decode.beam_search(model, [0, 1], 2, beams=4, eos_id=4)
    assert seqs.tolist() == [[0, 0], [0, 1], [0, 2], [0, 3]]


def test_beam_search_keeps_its_beams_when_a_broken_model_scores_nan():
    """NaN reaches no threshold: the tie-break's candidate set was empty (an IndexError, or no beam)."""
    model = tiny_bst()
    with torch.no_grad():
        model.forward_encoder.ln.bias[0] = float("nan")
    seqs, logp = decode.beam_search(model, [0, 1], 3, beams=3, eos_id=4)
    assert seqs.shape == (3, 3) and torch.isnan(logp).all()


def test_sample_refuses_a_generator_that_is_not_one():
    with pytest.raises(ValueError, match="generator must be a torch.Generator or None, got int"):
        decode.sample(tiny_bst(), [0, 1], 2, eos_id=4, generator=123)


def test_probe_checks_every_checkpoint_before_the_first_probe(star_ckpt, tmp_path, capsys):
    assert main(["probe", "--checkpoint", str(star_ckpt), "--checkpoint", str(tmp_path / "missing")]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "does not exist" in out.err
