"""Shared encoders run both directions in one encoder call: BeliefStateTransformer.forward stacks
the tokens (segment 0) on their reversed valid parts (segment 1), 2B rows through one Encoder call,
and splits f and b back. Same f, b, losses and gradients as the two calls (prefix_states, then
suffix_states) to rounding; separate encoders are untouched."""
import pytest
import torch

import bst_fast
from bst_fast.loss import belief_state_loss
from bst_fast.model import BeliefStateTransformer, ModelConfig, next_token_loss

PAD, BOS, SEP = 0, 1, 2  # SEP: the EOS, also the separator of the official packed layout
V, L = 11, 14
LENGTHS = [14, 11, 6, 3]
# packed rows' document ids (runs of one id along the valid positions; padding ids anything)
IDS = [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2],
       [0, 1, 1, 4, 4, 4, 6, 6, 7, 7, 7, 0, 0, 0],
       [3] * L,
       [5] * L]
SEPS = [[4, 9], [1, 2, 6], [], []]  # separator positions of the official layout, per row
TOL = dict(rtol=1e-12, atol=1e-12)


def _model(shared=True, gpt=False, seed=0, **kw):
    cfg = ModelConfig(vocab_size=V, max_len=16, n_layer=2, d_model=16, n_head=2, head_hidden=16,
                      shared_encoders=shared, gpt_head=gpt, dropout=0.0, **kw)
    torch.manual_seed(seed)
    return BeliefStateTransformer(cfg).double()


def _batch(layout=None, seed=1):
    """(tokens, lengths, documents): ragged rows [BOS, content, EOS, PAD ...], documents per layout
    (None, "ids": a (B, L) tensor, "separated": separated_documents' pair)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.full((len(LENGTHS), L), PAD, dtype=torch.long)
    for r, n in enumerate(LENGTHS):
        tokens[r, :n] = torch.randint(3, V, (n,), generator=g)
        tokens[r, 0], tokens[r, n - 1] = BOS, SEP
    documents = None
    if layout == "ids":
        documents = torch.tensor(IDS)
    elif layout == "separated":
        for r, seps in enumerate(SEPS):
            tokens[r, seps] = SEP
        documents = bst_fast.separated_documents(tokens, SEP)
    return tokens, torch.tensor(LENGTHS), documents


def _two_calls(model, tokens, lengths, documents, *, prefix_start=0, gamma=0.0, pairs=None, seed=None, **opts):
    """The model's loss the pre-batching way: prefix_states, suffix_states, belief_state_loss,
    next_token_loss, combined as forward does (dict(total, belief, gpt, f, b))."""
    f = model.prefix_states(tokens, documents, lengths=lengths)  # the padding's ids may go down
    b = model.suffix_states(tokens, lengths, documents)
    g = None if seed is None else torch.Generator().manual_seed(seed)
    belief = belief_state_loss(f, b, tokens, model.head, lengths=lengths, prefix_start=prefix_start,
                               documents=documents, pairs=pairs, generator=g, **opts)
    out = {"belief": belief, "gpt": None, "total": belief, "f": f, "b": b}
    if gamma > 0:
        out["gpt"] = next_token_loss(model.gpt, f, tokens, lengths, prefix_start, None, documents)
        out["total"] = gamma * out["gpt"] + (1 - gamma) * belief
    return out


def _grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}


CASES = {
    "ragged": dict(),
    "prefix_start": dict(prefix_start=2),
    "prefix_start_rows_gpt": dict(prefix_start=torch.tensor([1, 0, 2, 0]), gamma=0.7, gpt=True),
    "gpt_fraction": dict(gamma=0.3, gpt=True, pairs=0.5, seed=5, min_gap=1, meet_token=SEP),
    "row_mean_gpt": dict(gamma=0.9, gpt=True, reduction="row_mean", next_weight=0.0),
}


@pytest.mark.parametrize("layout", [None, "ids", "separated"])
@pytest.mark.parametrize("case", list(CASES))
def test_batched_forward_equals_the_two_calls(case, layout):
    opts = dict(CASES[case])
    gpt = opts.pop("gpt", False)
    model = _model(gpt=gpt)
    tokens, lengths, documents = _batch(layout)
    calls = []
    hook = model.forward_encoder.register_forward_pre_hook(lambda mod, args, kw: calls.append(args[0].shape[0]),
                                                           with_kwargs=True)
    # f and b of the one call
    f, b = model._states(tokens, lengths, documents)
    assert calls == [2 * len(LENGTHS)]
    ref = _two_calls(model, tokens, lengths, documents, **opts)
    hook.remove()
    torch.testing.assert_close(f, ref["f"], **TOL)
    torch.testing.assert_close(b, ref["b"], **TOL)
    # the losses and every parameter's gradient
    seed = opts.pop("seed", None)
    g = None if seed is None else torch.Generator().manual_seed(seed)
    out = model(tokens, lengths, documents=documents, generator=g, **opts)
    want_grads = _grads(model, ref["total"])
    got_grads = _grads(model, out["total"])
    for key in ("belief", "gpt", "total"):
        if ref[key] is None:
            assert out[key] is None
        else:
            torch.testing.assert_close(out[key], ref[key], **TOL)
    assert set(got_grads) == set(want_grads) and "forward_encoder.seg.weight" in got_grads
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("shared", [True, False])
def test_one_encoder_call_per_forward_when_shared(shared):
    """Shared: one forward_encoder call over 2B rows per model forward (fails if the passes are not
    batched). Separate: one call of B rows to each encoder."""
    model = _model(shared=shared)
    tokens, lengths, _ = _batch()
    calls = {"forward": [], "backward": []}
    model.forward_encoder.register_forward_pre_hook(lambda mod, args: calls["forward"].append(args[0].shape))
    if not shared:
        model.backward_encoder.register_forward_pre_hook(lambda mod, args: calls["backward"].append(args[0].shape))
    model(tokens, lengths)["total"].backward()
    B = len(LENGTHS)
    if shared:
        assert calls == {"forward": [(2 * B, L)], "backward": []}
    else:
        assert calls == {"forward": [(B, L)], "backward": [(B, L)]}


def test_separate_encoders_unchanged():
    """Separate encoders: still two encoders (no segments), and forward's losses and gradients are
    those of prefix_states + suffix_states exactly as before."""
    model = _model(shared=False, gpt=True)
    assert model.backward_encoder is not None and model.forward_encoder.seg is None
    for layout in (None, "ids"):
        tokens, lengths, documents = _batch(layout)
        ref = _two_calls(model, tokens, lengths, documents, prefix_start=1, gamma=0.5)
        out = model(tokens, lengths, documents=documents, prefix_start=1, gamma=0.5)
        want, got = _grads(model, ref["total"]), _grads(model, out["total"])
        for key in ("belief", "gpt", "total"):
            assert torch.equal(out[key], ref[key])
        assert set(got) == set(want) and any(n.startswith("backward_encoder.") for n in got)
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_no_backward_encoder_unchanged():
    """backward_encoder=False (b a learned constant): one encoder call of B rows, as before."""
    model = _model(shared=True, backward_encoder=False)
    tokens, lengths, _ = _batch()
    calls = []
    model.forward_encoder.register_forward_pre_hook(lambda mod, args: calls.append(args[0].shape))
    out = model(tokens, lengths)
    assert calls == [(len(LENGTHS), L)]
    ref = _two_calls(model, tokens, lengths, None)
    assert torch.equal(out["total"], ref["total"])


def test_segment_per_row_equals_one_segment_per_call():
    """Encoder.forward with a (rows,) segment tensor gives each row its segment's states."""
    model = _model().eval()
    tokens, _, _ = _batch()
    enc = model.forward_encoder
    seg = torch.tensor([1, 0, 0, 1])
    with torch.no_grad():
        got = enc(tokens, segment=seg)
        for s in (0, 1):
            rows = (seg == s).nonzero()[:, 0]
            torch.testing.assert_close(got[rows], enc(tokens[rows], segment=s), **TOL)
