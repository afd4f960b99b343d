"""ModelConfig.activation_checkpointing: each encoder block's activations are recomputed in the
backward instead of kept. In eager mode the numbers are the same, bitwise (the dropout masks of
the forward are drawn again: the RNG state is restored); what the forward keeps shrinks to one
(B, T, m) input a block; a resume may switch it and retraces the run."""
import pytest
import torch

from bst_fast import load_model, train
from bst_fast.config import TrainConfig
from bst_fast.decode import sample
from bst_fast.model import Block, BeliefStateTransformer, ForwardOnly, ModelConfig, Teacherless

V, L = 13, 12
TOKENS = torch.randint(1, V, (4, L), generator=torch.Generator().manual_seed(5))
LENGTHS = torch.tensor([12, 9, 4, 12])
DOCS = torch.tensor([[0] * 5 + [1] * 7, [0] * 12, [0] * 12, [0] * 3 + [1] * 4 + [2] * 5])

CASES = {  # model class, config changes, forward options
    "bst": (BeliefStateTransformer, {}, {}),
    "bst_shared_gpt": (BeliefStateTransformer, {"shared_encoders": True, "gpt_head": True}, {"gamma": 0.3}),
    "bst_swiglu_docs": (BeliefStateTransformer, {"head_type": "swiglu"}, {"documents": DOCS}),
    "forward": (ForwardOnly, {}, {}),
    "teacherless": (Teacherless, {}, {}),
}


def _run(case, checkpointing, calls=None):
    """(loss, {name: grad}) of one forward and backward, dropout on, the same seeds either way."""
    cls, changes, options = CASES[case]
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V + (cls is Teacherless), max_len=L, n_layer=3, d_model=16, n_head=2,
                      head_hidden=16, dropout=0.2, activation_checkpointing=checkpointing, **changes).check()
    model = cls(cfg).train()
    torch.manual_seed(1)
    loss = model(TOKENS, LENGTHS, **options)["total"]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_loss_and_gradients_are_the_same_bitwise_and_the_blocks_run_again(case, monkeypatch):
    runs = {}
    forward = Block.forward
    for checkpointing in (False, True):
        calls = []
        monkeypatch.setattr(Block, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
        runs[checkpointing] = (*_run(case, checkpointing), len(calls))
    (loss0, grads0, calls0), (loss1, grads1, calls1) = runs[False], runs[True]
    assert calls1 == 2 * calls0 > 0  # every block ran again in the backward: it kept nothing
    assert torch.equal(loss0, loss1) and grads0.keys() == grads1.keys() and len(grads0) > 0
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def _kept_bytes(n_layer, checkpointing, B=3, T=10, m=16):
    """Bytes of the tensors the encoders' forward keeps for the backward (autograd's saved tensors,
    each storage once)."""
    torch.manual_seed(0)
    model = BeliefStateTransformer(ModelConfig(vocab_size=V, max_len=T, n_layer=n_layer, d_model=m, n_head=2,
                                               activation_checkpointing=checkpointing).check())
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # the states held (and so their graphs, and every storage counted): none is freed and reused
        states = model.prefix_states(TOKENS[:B, :T]), model.suffix_states(TOKENS[:B, :T], LENGTHS[:B].clamp(max=T))
    assert all(s.requires_grad for s in states)
    return sum(kept.values())


def test_an_encoder_keeps_one_input_a_block():
    B, T, m = 3, 10, 16
    per_block = B * T * m * 4  # float32
    on = [_kept_bytes(n, True) for n in (1, 2, 4)]
    off = [_kept_bytes(n, False) for n in (1, 2, 4)]
    # each block more keeps exactly its input, in each of the two encoders
    assert on[1] - on[0] == 2 * per_block and on[2] - on[1] == 4 * per_block
    # without it a block keeps its LayerNorms', attention's and MLP's activations: several times more
    assert off[1] - off[0] > 5 * 2 * per_block


def _tiny(out, **changes):
    model = {"n_layer": 2, "d_model": 16, "n_head": 2, "head_hidden": 16, "dropout": 0.1}
    return TrainConfig.from_dict({**TrainConfig.load("configs/tiny_test.yaml").to_dict(), "out_dir": str(out),
                                  "ckpt_every": 0, "pairs": 0.5, **changes,
                                  "model": {**model, **changes.pop("model", {})}})


def test_a_resume_may_switch_it_and_retraces_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    train(_tiny(tmp_path / "full"))
    train(_tiny(tmp_path / "cut"), stop_at=3)
    train(_tiny(tmp_path / "cut", model={"activation_checkpointing": True}), resume=True)
    (a, _), (b, cfg) = load_model(tmp_path / "full"), load_model(tmp_path / "cut")
    assert cfg.model.activation_checkpointing is True
    assert all(torch.equal(x, b.state_dict()[k]) for k, x in a.state_dict().items())
    # another model field is still refused on a resume
    with pytest.raises(ValueError, match="model.dropout"):
        train(_tiny(tmp_path / "cut", steps=8, model={"activation_checkpointing": True, "dropout": 0.2}), resume=True)


def test_a_model_trained_with_it_decodes_as_one_without():
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, max_len=L, n_layer=2, d_model=16, n_head=2)
    a = BeliefStateTransformer(ModelConfig(**cfg))
    b = BeliefStateTransformer(ModelConfig(**cfg, activation_checkpointing=True))
    b.load_state_dict(a.state_dict())
    prompt = TOKENS[0, :4]
    with torch.enable_grad():  # the KV cache path is never checkpointed, grad or not
        assert torch.equal(sample(a, prompt, 6, eos_id=0, temperature=0)[0],
                           sample(b, prompt, 6, eos_id=0, temperature=0)[0])


@pytest.mark.parametrize("value", [1, "true", None])
def test_a_value_other_than_true_or_false_is_refused(value):
    with pytest.raises(ValueError, match="model.activation_checkpointing"):
        ModelConfig(activation_checkpointing=value).check()
    with pytest.raises(ValueError, match="activation_checkpointing"):
        TrainConfig.from_dict({"model": {"activation_checkpointing": value}})


def test_functional_call_and_torch_func_grad_get_the_same_gradients():
    """The recompute ran the blocks with the module's own parameters, which a functional_call had
    put back by the backward: its gradients were silently wrong; torch.func.grad raised (its
    transforms refuse saved-tensor hooks). Review helper-95."""
    from torch.func import functional_call, grad

    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = BeliefStateTransformer(ModelConfig(vocab_size=V, max_len=L, n_layer=2, d_model=16, n_head=2,
                                                   head_hidden=16, activation_checkpointing=checkpointing))
        params = {k: (v.detach() * 1.5).requires_grad_() for k, v in model.named_parameters()}
        loss = functional_call(model, params, (TOKENS, LENGTHS))["total"]
        grads = torch.autograd.grad(loss, list(params.values()))
        func = grad(lambda p: functional_call(model, p, (TOKENS, LENGTHS), {"backend": "reference"})["total"])(
            {k: v.detach() for k, v in params.items()})
        runs[checkpointing] = loss.detach(), grads, [func[k] for k in params]
    (l0, g0, f0), (l1, g1, f1) = runs[False], runs[True]
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1)) and all(torch.equal(a, b) for a, b in zip(f0, f1))
    # and they are the functional call's: not the module's own parameters' gradients
    torch.manual_seed(0)
    own = BeliefStateTransformer(ModelConfig(vocab_size=V, max_len=L, n_layer=2, d_model=16, n_head=2, head_hidden=16))
    own(TOKENS, LENGTHS)["total"].backward()
    assert not torch.allclose(own.forward_encoder.blocks[0].qkv.weight.grad, g1[list(params).index(
        "forward_encoder.blocks.0.qkv.weight")])
