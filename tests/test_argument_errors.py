"""One exception type for one kind of bad argument across the public API (review helper-104): a
token id outside the vocabulary is an IndexError and a ValueError wherever it is met (the decoders
raised ValueError, the model and the loss IndexError); an argument of the wrong type a TypeError
and a ValueError; a missing checkpoint a FileNotFoundError and a ValueError."""
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

import bst_fast
from bst_fast import decode
from bst_fast.model import Teacherless

V = 10
CFG = dict(vocab_size=V, max_len=16, n_layer=1, d_model=16, n_head=2, head_hidden=16)
BAD = torch.tensor([[1, 2, 3, 4, V + 89, 2]])


def _bst():
    torch.manual_seed(0)
    return bst_fast.BeliefStateTransformer(bst_fast.ModelConfig(**CFG))


def _token_id_calls():
    m = _bst()
    f = torch.randn(1, BAD.shape[1], 16)
    return {
        "forward": lambda: m(BAD),
        "prefix_states": lambda: m.prefix_states(BAD),
        "suffix_states": lambda: m.suffix_states(BAD),
        "ForwardOnly": lambda: bst_fast.ForwardOnly(bst_fast.ModelConfig(**CFG))(BAD),
        "belief_states": lambda: decode.belief_states(m, BAD),
        "sample": lambda: bst_fast.sample(m, BAD, 2, 2),
        "plan": lambda: bst_fast.plan(m, BAD[0], eos_id=2),
        "beam_search": lambda: bst_fast.beam_search(m, BAD[0], 2, eos_id=2),
        "sample eos_id": lambda: bst_fast.sample(m, BAD[:, :4], 2, V),
        "loss cpp": lambda: bst_fast.belief_state_loss(f, f, BAD, m.head, backend="cpp"),
        "loss torch": lambda: bst_fast.belief_state_loss(f, f, BAD, m.head, backend="torch"),
        "teacherless dummy": lambda: Teacherless(bst_fast.ModelConfig(**CFG)).generate(torch.tensor([[1, V - 1]]), 2),
    }


@pytest.mark.parametrize("name", list(_token_id_calls()))
def test_a_token_id_outside_the_vocabulary_is_an_index_error_and_a_value_error(name):
    with pytest.raises(IndexError) as e:
        _token_id_calls()[name]()
    assert isinstance(e.value, ValueError), e.value


def test_wrong_types_are_type_errors_and_value_errors(tmp_path):
    m = _bst()
    f = torch.randn(1, 4, 16)
    tokens = torch.tensor([[1, 2, 3, 4]])
    calls = {
        "head": (lambda: bst_fast.belief_state_loss(f, f, tokens, "head"), "head must be an nn.Module"),
        "f": (lambda: bst_fast.belief_state_loss([[0.0]], f, tokens, m.head), "f must be a"),
        "b": (lambda: bst_fast.belief_state_loss(f, 1.0, tokens, m.head), "b must have the shape of f"),
        "generator": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, pairs=0.5, generator=5), "generator"),
        "pairs": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, pairs="all"), "pairs must be"),
        "deterministic": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, deterministic="yes"), "deterministic"),
        "module options": (lambda: bst_fast.BeliefStateLoss(m.head, foo=1), r"unknown options \['foo'\]"),
        "module head": (lambda: bst_fast.BeliefStateLoss("head"), "head must be an nn.Module"),
        "n_new": (lambda: bst_fast.sample(m, tokens, "2", 2), "n_new must be an int"),
        "eos_id list": (lambda: bst_fast.sample(m, tokens, 1, [2]), r"eos_id must be an int >= 0, got \[2\]"),
        "eos_id float": (lambda: bst_fast.plan(m, tokens[0], eos_id=2.0), "eos_id must be an int >= 0, got 2.0"),
        "resume": (lambda: bst_fast.train(out_dir=str(tmp_path / "r"), resume="yes"), "resume must be True or False"),
        "load_model": (lambda: bst_fast.load_model(5), "path must be a checkpoint or run folder"),
        "separator": (lambda: bst_fast.separated_documents(tokens, 2.5), "separator must be an int"),
        "swiglu bias": (lambda: bst_fast.ResidualSwiGLUHead(8, V, bias="no"), "bias must be True or False"),
        "ks": (lambda: decode.probe_future_tokens(m, tokens.repeat(2, 1), tokens.repeat(2, 1), 1, 2), "ks must be a sequence"),
        "min_gap": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, min_gap="2"), "min_gap must be"),
        "max_gap": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, max_gap=3.0), "max_gap must be"),
        "next_weight": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, next_weight="0.5"), "next_weight"),
        "documents": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, documents=[[0] * 4, [0] * 4]),
                      "documents must be"),
        "pairs list": (lambda: bst_fast.belief_state_loss(f, f, tokens, m.head, pairs=([0], [0], [2])), "pairs given"),
    }
    for name, (call, message) in calls.items():
        with pytest.raises(TypeError, match=message) as e:
            call()
        assert isinstance(e.value, ValueError), name
    # a bad value of the right type stays a ValueError only
    with pytest.raises(ValueError) as e:
        bst_fast.sample(m, tokens, -1, 2)
    assert not isinstance(e.value, TypeError)


def test_a_missing_checkpoint_is_a_file_not_found_error_and_a_value_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        bst_fast.load_model(tmp_path / "nope")
    assert isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="device must be 'auto' or a torch device"):
        bst_fast.load_model(tmp_path, device="gpu")


def test_load_model_takes_device_auto_as_the_config_does(tmp_path):
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny_test.yaml"
    bst_fast.train(tiny, out_dir=str(tmp_path / "run"), steps=1, eval_every=0, ckpt_every=0)
    model, _ = bst_fast.load_model(tmp_path / "run", device="auto")
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert next(model.parameters()).device.type == want
    model, _ = bst_fast.load_model(tmp_path / "run", device=None)  # as .to(None) left it: the CPU
    assert next(model.parameters()).device.type == "cpu"


def test_teacherless_generate_runs_in_eval_mode_and_takes_one_prompt():
    """It ran in the model's own mode (dropout on, so greedy answers differed call to call) and took
    an eos_id it never used."""
    torch.manual_seed(0)
    model = Teacherless(bst_fast.ModelConfig(**{**CFG, "dropout": 0.5})).train()
    prompt = torch.tensor([1, 2, 3])
    answers = [model.generate(prompt, 4) for _ in range(5)]
    assert answers[0].shape == (1, 4) and all(torch.equal(answers[0], a) for a in answers)
    assert model.training and all(mod.training for mod in model.modules())
    model.eval()
    assert torch.equal(model.generate(prompt[None], 4), answers[0])
    with pytest.raises(TypeError, match="eos_id"):
        model.generate(prompt, 4, eos_id=3)


def test_probes_check_their_labels_and_name_the_bad_position():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="train_y must hold integer classes >= 0, got torch.float32"):
        decode.probe_accuracy(x, torch.tensor([0.5, 1.0, 0.0, 1.0]), x, torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="test_y must hold integer classes >= 0, got -1"):
        decode.probe_accuracy(x, torch.tensor([0, 1, 0, 1]), x, torch.tensor([0, -1, 0, 1]))
    m = _bst()
    rows = torch.randint(0, V, (4, 8))
    with pytest.raises(ValueError, match="position must be below L - 1 = 7"):
        decode.probe_future_tokens(m, rows, rows, 10, [1])
    import numpy as np  # any iterable of steps, as before (review helper-106)

    assert set(decode.probe_future_tokens(m, rows, rows, 2, np.array([1, 2]), steps=2)) == {1, 2}


def test_separated_documents_refuses_float_ids():
    with pytest.raises(ValueError, match="tokens must be an integer tensor"):
        bst_fast.separated_documents(torch.tensor([[1.0, 0.0, 2.0]]), 0)


def test_max_doc_tokens_zero_keeps_every_document_in_text_data_as_in_the_config():
    from bst_fast.data.text import TextData

    docs = [list(range(3, 3 + n)) for n in (2, 9, 4)]
    kw = dict(vocab_size=20, max_len=16)
    every = TextData.from_ids(docs, **kw, max_doc_tokens=0)
    assert every.dropped_documents == 0 and TextData.from_ids(docs, **kw).dropped_documents == 0
    assert TextData.from_ids(docs, **kw, max_doc_tokens=5).dropped_documents == 1


@pytest.mark.parametrize("value", [8, 0])
def test_the_configs_pairs_is_a_fraction_not_a_count(value):
    with pytest.raises(ValueError, match=rf"fraction in \(0, 1\] of each row's pairs, got {value} \(a count"):
        bst_fast.TrainConfig.from_dict({"pairs": value})
    assert bst_fast.TrainConfig.from_dict({"pairs": 1}).pairs == 1.0


def test_meta_pair_set_arguments_and_a_differentiable_op_weight_are_named():
    """Meta lengths, prefix_start or listed pairs beside a CPU batch raised torch's "Cannot copy out
    of meta tensor", naming nothing; a raw op call with a weight that requires grad got no
    gradient for it, silently (review helper-103)."""
    head = bst_fast.TextHead(8, 6, 8)
    f, tokens = torch.randn(2, 9, 8), torch.randint(0, 6, (2, 9))
    meta = {"lengths": dict(lengths=torch.tensor([9, 4]).to("meta")),
            "prefix_start": dict(prefix_start=torch.tensor([0, 1]).to("meta")),
            r"pairs\[0\] \(row\)": dict(pairs=(torch.tensor([0]).to("meta"), torch.tensor([0]), torch.tensor([3])))}
    for backend in ("cpp", "torch"):
        for name, kw in meta.items():
            with pytest.raises(ValueError, match=f"{name} is on the meta device"):
                bst_fast.belief_state_loss(f, f, tokens, head, backend=backend, **kw)
    with pytest.raises(ValueError, match=r"sample_pairs takes lengths, prefix_start and k on the CPU, got \['meta'"):
        torch.ops.bst_fast.sample_pairs(torch.tensor([7, 5]).to("meta"), torch.tensor([0, 1]), 2, 7,
                                        torch.tensor([3, 2]), 0)
    A = torch.randn(1, 5, 4, requires_grad=True)
    args = (A, torch.randn(1, 5, 4), [torch.randn(6, 4)], [torch.randn(6)], torch.randint(0, 3, (1, 5)),
            torch.tensor([5]), torch.tensor([0]), 2, 5, None, None, None)
    torch.ops.bst_fast.pair_loss(*args, torch.tensor(0.5, dtype=torch.float64), 0.5, "gelu", True)[0].backward()
    with pytest.raises(ValueError, match="weight .* takes no gradient through the pair-loss op"):
        torch.ops.bst_fast.pair_loss(*args, torch.tensor(0.5, dtype=torch.float64, requires_grad=True), 0.5, "gelu", True)


@pytest.mark.parametrize("changes, message", [
    (dict(vocab_pad=-4), "switch vocab_pad must be an int >= 0, got -4"),
    (dict(chunk_pairs=-1), "switch chunk_pairs must be None or an int >= 1, got -1"),
    (dict(chunk_pairs=2.5), "switch chunk_pairs must be None or an int >= 1, got 2.5"),
    (dict(triton_chunk_bytes=0), "switch triton_chunk_bytes must be an int >= 1, got 0"),
    (dict(fused_ce="yes"), "switch fused_ce must be True or False, got 'yes'"),
    (dict(triton_ops=1), "switch triton_ops must be None, True or False, got 1"),
    (dict(window_rows=-1), "switch window_rows must be None or an int >= 0, got -1"),
])
def test_switches_set_in_code_are_checked(changes, message):
    """The environment's values were checked, switched()'s were not: vocab_pad=-4 failed deep in the
    backend, chunk_pairs=-1 ran one pair a chunk, silently (review helper-102)."""
    from bst_fast.backends import runtime

    with pytest.raises(ValueError, match=message):
        with runtime.switched(**changes):
            pass
    import numpy as np

    with runtime.switched(chunk_pairs=np.int64(3), window_rows=0, triton_ops=None, fused_ce=np.True_) as on:
        assert type(on.chunk_pairs) is int and on.fused_ce is True
    # a switch's kind comes from its annotation: a field added later is checked by its own type
    assert [runtime.switch_kind(f) for f in dataclasses.fields(runtime.Switches)
            if f.name in ("triton_ops", "chunk_pairs", "vocab_pad", "fused_ce")] == \
        [("int", True), ("bool", True), ("int", False), ("bool", False)]
    # and a subclass's own fields by its own hints (they were read from Switches': review helper-109)
    More = dataclasses.make_dataclass("More", [("extra", bool, False), ("vocab_pad", typing.Optional[int], None)],
                                      bases=(runtime.Switches,), frozen=True)
    assert More().extra is False and More(vocab_pad=None).vocab_pad is None
    with pytest.raises(ValueError, match="switch extra must be True or False, got 1"):
        More(extra=1)
