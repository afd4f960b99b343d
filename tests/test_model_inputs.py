"""The models' own inputs: padding is never read, whatever id it holds (docs/contract.md §1); the
totals, prefix_start, keywords, documents (§10) and eos_id they take are checked, a ValueError (or a
TypeError for an unknown keyword) naming the argument; the MLP width is never clamped."""
import pytest
import torch

from bst_fast.model import (BeliefStateTransformer, Block, ForwardOnly, ModelConfig, Teacherless,
                            next_token_loss)
from bst_fast.tasks import Objective

V = 11
TOKENS = torch.tensor([[1, 5, 6, 2, 1, 7, 2, 0], [1, 3, 3, 4, 2, 0, 0, 0]])
LENGTHS = torch.tensor([7, 5])
DOCS = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])


def _cfg(**kw):
    return ModelConfig(**{**dict(vocab_size=V, max_len=16, n_layer=1, d_model=8, n_head=2, head_hidden=8), **kw})


def _model(cls=BeliefStateTransformer, **kw):
    torch.manual_seed(0)
    return cls(_cfg(**kw)).double()


def _padded(pad):
    return TOKENS.masked_fill(torch.arange(TOKENS.shape[1])[None] >= LENGTHS[:, None], pad)


def _loss_and_grads(model, tokens, **kw):
    model.zero_grad(set_to_none=True)
    out = model(tokens, LENGTHS, **kw)
    out["total"].backward()
    return out["total"].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pad", [-1, V, 2**40])
@pytest.mark.parametrize("case", ["bst", "bst_shared_docs", "forward", "forward_docs", "teacherless"])
def test_padding_of_any_id_is_never_read(case, pad):
    """Ids outside [0, V) at padding give the loss and gradients of padding 0 (an IndexError in the
    embedding and the next-token cross-entropy before)."""
    cls = {"bst": BeliefStateTransformer, "forward": ForwardOnly, "teacherless": Teacherless}[case.split("_")[0]]
    model = _model(cls, **({"gpt_head": True, "shared_encoders": "shared" in case} if cls is BeliefStateTransformer
                           else {}))
    kw = {"gamma": 0.5} if cls is BeliefStateTransformer else {"prefix_start": 1}
    if "docs" in case:
        kw["documents"] = DOCS
    loss0, grads0 = _loss_and_grads(model, _padded(0), **kw)
    loss, grads = _loss_and_grads(model, _padded(pad), **kw)
    assert loss == loss0 and grads.keys() == grads0.keys()
    for name in grads0:
        assert torch.equal(grads[name], grads0[name]), name


@pytest.mark.parametrize("pad", [-1, V])
def test_states_and_next_token_loss_do_not_read_padding(pad):
    model = _model(gpt_head=True)
    with torch.no_grad():
        f0 = model.prefix_states(_padded(0), lengths=LENGTHS)
        b0 = model.suffix_states(_padded(0), LENGTHS)
        f, b = model.prefix_states(_padded(pad), lengths=LENGTHS), model.suffix_states(_padded(pad), LENGTHS)
        assert torch.equal(f, f0) and torch.equal(b, b0)


@pytest.mark.parametrize("pad", [-1, V])
def test_next_token_loss_does_not_read_padding(pad):
    """The loss function alone: a target past a row's end is not read by the cross-entropy (an
    IndexError "Target -1 is out of bounds" before)."""
    f, head = torch.randn(2, 8, 8, generator=torch.Generator().manual_seed(0)), _model(gpt_head=True).gpt.float()
    assert next_token_loss(head, f, _padded(pad), LENGTHS) == next_token_loss(head, f, _padded(0), LENGTHS)


BAD_TOTALS = [0, 0.0, -3, float("inf"), float("nan"), True, "7", torch.tensor(0.0), torch.tensor([5.0, 1.0]),
              torch.tensor(True)]


@pytest.mark.parametrize("value", BAD_TOTALS, ids=repr)
@pytest.mark.parametrize("name", ["pair_total", "token_total", "row_total"])
def test_the_totals_are_finite_numbers_above_zero(name, value):
    """0 gave an inf loss, -3 a negative one, inf a loss of 0; True was read as 1, '7' a raw TypeError."""
    model = _model(gpt_head=True)
    with pytest.raises(ValueError, match=f"^{name} must be .*finite number"):
        model(TOKENS, LENGTHS, gamma=0.5, reduction="row_mean" if name == "row_total" else "mean", **{name: value})
    if name == "token_total":
        for cls in (ForwardOnly, Teacherless):
            with pytest.raises(ValueError, match="^token_total must be a finite number > 0"):
                _model(cls)(TOKENS, LENGTHS, token_total=value)


def test_good_totals_still_divide_the_loss():
    model = _model(gpt_head=True)
    with torch.no_grad():
        out = model(TOKENS, LENGTHS, gamma=0.5, pair_total=2.5, token_total=3, row_total=4.0)
        # an all-reduced count, a one-element tensor, as before
        same = model(TOKENS, LENGTHS, gamma=0.5, pair_total=torch.tensor(2.5), token_total=torch.tensor([3]),
                     row_total=torch.tensor(4.0, dtype=torch.float64))
    assert torch.isfinite(out["total"]) and float(out["total"]) > 0
    assert same["total"].shape == () and torch.allclose(same["total"], out["total"])  # 0-d, as the loss is
    total = torch.tensor([[2.5]], requires_grad=True)
    model(TOKENS, LENGTHS, gamma=0.5, pair_total=total)["total"].backward()
    assert total.grad is None  # a count, not a parameter


@pytest.mark.parametrize("cls", [ForwardOnly, Teacherless])
def test_next_token_models_refuse_unknown_keywords(cls):
    """A typo's `document=docs` trained packed rows as one document, unseen (**_ took every keyword)."""
    model = _model(cls)
    with pytest.raises(TypeError, match="unexpected keyword argument 'document'"):
        model(TOKENS, LENGTHS, document=DOCS)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'row_mean'"):
        model(TOKENS, LENGTHS, reduction="bogus")
    # every keyword Objective passes a model is taken (and the belief loss's ignored)
    objective = Objective(pairs=0.5, next_weight=0.3, gamma=0.9, backend="torch", min_gap=1, max_gap=4, meet_token=2,
                          reduction="row_mean")
    out = objective(model, TOKENS, LENGTHS, prefix_start=1, generator=torch.Generator(), pair_total=0.0,
                    token_total=7.0, row_total=2)
    assert out["total"] == model(TOKENS, LENGTHS, prefix_start=1, token_total=7.0)["total"]


@pytest.mark.parametrize("cls", [ForwardOnly, Teacherless])
@pytest.mark.parametrize("value, match", [(-1, "must be >= 0"), (torch.tensor([0, -2]), "must be >= 0"),
                                          (2.5, "an int or a"), (True, "got a bool"),
                                          (torch.tensor([0, 1, 2]), r"shape \(2,\)"),
                                          (torch.tensor([0.0, 1.0]), "integer tensor")])
def test_next_token_models_check_prefix_start_as_the_bst(cls, value, match):
    with pytest.raises(ValueError, match=f"^prefix_start .*{match}"):
        _model(cls)(TOKENS, LENGTHS, prefix_start=value)
    with pytest.raises(ValueError, match=f"^prefix_start .*{match}"):  # the BST's own words
        _model()(TOKENS, LENGTHS, prefix_start=value)


BAD_DOCUMENTS = [(torch.tensor([[0, 1] * 4] * 2), "non-decreasing"), (DOCS.flip(1), "non-decreasing"),
                 (DOCS[:, :7], r"shape \(B, L\)"), (DOCS.double(), "integer tensor"), ([DOCS], "pair")]


@pytest.mark.parametrize("documents, match", BAD_DOCUMENTS)
def test_the_states_check_their_documents_as_forward(documents, match):
    """prefix_states and suffix_states took interleaved, decreasing, misshapen and float documents."""
    model = _model()
    full = torch.tensor([8, 8])
    for call in (lambda: model.prefix_states(TOKENS, documents), lambda: model.suffix_states(TOKENS, full, documents),
                 lambda: model(TOKENS, full, documents=documents)):
        with pytest.raises(ValueError, match=f"^documents.*{match}"):
            call()


def test_the_states_check_their_tokens_and_read_documents_only_at_valid_positions():
    model = _model()
    with pytest.raises(IndexError, match=r"tokens must lie in \[0, vocab_size=11\).*tokens\[0, 5\] = 11"):
        model.prefix_states(TOKENS.masked_fill(TOKENS == 7, V))  # a raw "index out of range in self" before
    with pytest.raises(IndexError, match=r"tokens\[0, 5\] = 11"):
        model.suffix_states(TOKENS.masked_fill(TOKENS == 7, V))
    # the padding's document ids may go down, as in forward: lengths say where the padding is
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 0], [3, 3, 3, 3, 3, 0, 0, 0]])
    with torch.no_grad():
        f, b = model.prefix_states(TOKENS, docs, lengths=LENGTHS), model.suffix_states(TOKENS, LENGTHS, docs)
        f1, b1 = model.prefix_states(TOKENS[1:, :5]), model.suffix_states(TOKENS[1:, :5])
    torch.testing.assert_close(f[1, :5], f1[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b[1, :5], b1[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eos_id", [2.7, True, -1, V, "2", None])
def test_empty_suffix_checks_eos_id(eos_id):
    """2.7 was truncated to 2 and True read as 1."""
    with pytest.raises(ValueError, match="^eos_id must"):
        _model().empty_suffix(eos_id)


def test_empty_suffix_reads_eos_alone():
    model = _model()
    with torch.no_grad():
        assert torch.equal(model.empty_suffix(2), model.suffix_states(torch.tensor([[2]]))[0, 0])


def test_an_mlp_width_rounding_to_zero_is_refused_not_clamped():
    """mlp_ratio * d_model under 0.5 built an MLP of width 1; the width is rounded, as documented."""
    for ratio in (0.01, 0.06, 1e-300):
        with pytest.raises(ValueError, match=r"'model.mlp_ratio' must be .*round\(mlp_ratio \* d_model\)"):
            _cfg(mlp_ratio=ratio).check()
    assert _model(mlp_ratio=0.07).forward_encoder.blocks[0].mlp[0].out_features == 1  # 0.56 units rounds to 1
    assert Block(8, 2, 1.3, 0.0).mlp[0].out_features == 10  # 10.4 units, rounded


def test_teacherless_trains_on_the_input_its_generate_reads():
    """Training feeds the row up to and including '=' at prefix_start, then a dummy at every answer
    position: exactly the prompt and dummies generate (the path accuracy's decoder) reads, so the
    trained predictions are the generated ones."""
    from bst_fast.data import StarGraphData, StarGraphTokenizer

    tok = StarGraphTokenizer(12)
    data = StarGraphData(2, 3, 12, n_train=4, n_test=4, seed=0)
    rows, ps, l = data.test_tokens, data.prefix_start, data.path_len
    torch.manual_seed(0)
    model = Teacherless(_cfg(vocab_size=tok.vocab_size + 1, max_len=rows.shape[1])).eval()
    read = []
    model.forward_encoder.register_forward_pre_hook(lambda module, args: read.append(args[0].clone()))
    model(rows, prefix_start=ps)
    new = model.generate(rows[:, :ps + 1], l)
    trained, generated = read
    assert (rows[:, ps] == tok.answer_id).all()
    assert torch.equal(trained[:, :ps + 1], rows[:, :ps + 1]) and (trained[:, ps + 1:] == model.dummy_id).all()
    assert torch.equal(generated, trained[:, :generated.shape[1]]) and generated.shape[1] == ps + l
    assert torch.equal(new, model.lm_head(model.forward_encoder(trained))[:, ps:ps + l].argmax(-1))


@pytest.mark.parametrize("cls", [BeliefStateTransformer, ForwardOnly])
def test_a_model_keeps_its_own_copy_of_the_config(cls):
    """A config changed after the model was built no longer described its layers: the logits were
    split at the new vocab_size (review helper-94)."""
    cfg = _cfg()
    model = cls(cfg)
    cfg.vocab_size, cfg.head_type = 3, "swiglu"
    assert model.cfg.vocab_size == V and model.cfg.head_type == "mlp" and model.cfg is not cfg
    if cls is BeliefStateTransformer:
        assert [t.shape[-1] for t in model.logits(torch.randn(8), torch.randn(8))] == [V, V]


@pytest.mark.parametrize("cls", [BeliefStateTransformer, ForwardOnly])
def test_a_batch_of_no_position_is_a_clear_error(cls):
    model = _model(cls, gpt_head=True) if cls is BeliefStateTransformer else _model(cls)
    with pytest.raises(ValueError, match="no next-token position" if cls is ForwardOnly else "no valid pair|no next"):
        model(torch.zeros(2, 0, dtype=torch.long), **({"gamma": 0.5} if cls is BeliefStateTransformer else {}))


def test_a_batch_wider_than_max_len_names_the_padding():
    with pytest.raises(ValueError, match=r"17 positions \(padding included\) exceed the encoder's max_len 16"):
        _model()(torch.zeros(2, 17, dtype=torch.long), torch.tensor([8, 6]))


def test_the_batch_checks_name_the_batch_not_f():
    with pytest.raises(ValueError, match=r"lengths must have shape \(2,\), one value per row of the batch"):
        _model()(TOKENS, torch.tensor([7, 5, 3]))
    with pytest.raises(ValueError, match=r"documents must have shape \(B, L\) = \(2, 8\), the batch's"):
        _model().prefix_states(TOKENS, LENGTHS)  # lengths given where documents go


def test_a_cached_encoder_takes_the_next_position_only():
    """An offset past the cached positions was read at that position, silently (review helper-94)."""
    enc = _model().forward_encoder
    caches = [dict() for _ in enc.blocks]
    enc(TOKENS[:, :3], 0, caches)
    with pytest.raises(ValueError, match=r"offset must be the number of positions the caches hold \(3\), got 5"):
        enc(TOKENS[:, 3:4], 0, caches, offset=5)
    full = enc(TOKENS[:, :4])
    assert torch.allclose(enc(TOKENS[:, 3:4], 0, caches, offset=3)[:, 0], full[:, 3], atol=1e-12)


def test_teacherless_refuses_its_dummy_id_in_the_data_and_in_a_prompt():
    model = _model(Teacherless)  # dummy id V - 1
    with pytest.raises(IndexError, match=rf"tokens must not hold the teacherless dummy id {V - 1}"):
        model(TOKENS.masked_fill(TOKENS == 7, V - 1), LENGTHS)
    model(TOKENS.masked_fill(TOKENS == 0, V - 1), LENGTHS)  # at padding it is never read
    with pytest.raises(IndexError, match=rf"prefix must not hold the teacherless dummy id {V - 1}"):
        model.generate(torch.tensor([[1, V - 1]]), 3)
    with pytest.raises(IndexError, match=rf"tokens must lie in \[0, vocab_size={V}\)"):
        model.generate(torch.tensor([[1, V]]), 3)


@pytest.mark.parametrize("bias", ["no", 1, None])
def test_the_swiglu_heads_bias_is_true_or_false(bias):
    from bst_fast import ResidualSwiGLUHead

    with pytest.raises(ValueError, match="bias must be True or False"):
        ResidualSwiGLUHead(4, 3, bias=bias)
    import numpy as np

    assert ResidualSwiGLUHead(4, 3, bias=np.bool_(True)).bias is True
