"""Packed rows in the model's encoders: a row holding several documents (document ids, runs of one
id) encodes each document exactly as a row of its own, forward and backward (the loss's side of
packing, pairs within documents, is not built yet)."""
import pytest
import torch

from bst_fast.model import BeliefStateTransformer, ModelConfig, document_positions


def test_document_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


@pytest.mark.parametrize("shared", [False, True])
def test_a_packed_row_encodes_each_document_as_its_own_row(shared):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, max_len=24, n_layer=2, d_model=16, n_head=2, head_hidden=16,
                      shared_encoders=shared)
    model = BeliefStateTransformer(cfg).double().eval()
    pieces = [torch.randint(3, 20, (n,)) for n in (5, 2, 6)]
    pieces = [torch.cat([torch.tensor([1]), p, torch.tensor([2])]) for p in pieces]  # BOS .. EOS
    row = torch.cat(pieces + [torch.zeros(3, dtype=torch.long)])[None]
    docs = torch.cat([torch.full((len(p),), k) for k, p in enumerate(pieces)] + [torch.full((3,), 2)])[None]
    length = sum(len(p) for p in pieces)
    f = model.prefix_states(row, docs)
    b = model.suffix_states(row, torch.tensor([length]), docs)
    start = 0
    for p in pieces:
        alone = p[None]
        assert torch.allclose(f[0, start:start + len(p)], model.prefix_states(alone)[0], atol=1e-12)
        assert torch.allclose(b[0, start:start + len(p)], model.suffix_states(alone)[0], atol=1e-12)
        start += len(p)
    # one row without documents reads across the boundary: the documents change the states
    assert not torch.allclose(model.prefix_states(row)[0, 7:9], f[0, 7:9])


def test_flex_attention_reads_the_documents_as_sdpa_does():
    """model.attention "flex" (flex_attention with a block mask, compiled) gives the states of the
    dense-mask SDPA path on packed rows, new documents reusing the one compiled graph (T = 40, a
    partial block: torch 2.13's compiled CPU flex read past it, errors of order 1 and NaNs varying
    run to run, until the mask and q, k, v were padded to whole blocks); on the CPU,
    where flex has no backward, a training call is a clear error."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=20, max_len=40, n_layer=2, d_model=16, n_head=2, head_hidden=16)
    sdpa = BeliefStateTransformer(cfg).eval()
    flex = BeliefStateTransformer(ModelConfig(**{**cfg.__dict__, "attention": "flex"})).eval()
    flex.load_state_dict(sdpa.state_dict())
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        docs = torch.sort(torch.randint(0, 4, (3, 40), generator=g), 1).values
        tokens = torch.randint(0, 20, (3, 40), generator=g)
        with torch.no_grad():
            for side in ("prefix", "suffix"):
                want = getattr(sdpa, f"{side}_states")(tokens, documents=docs)
                got = getattr(flex, f"{side}_states")(tokens, documents=docs)
                assert torch.allclose(got, want, atol=1e-5), side
    with pytest.raises(ValueError, match="flex.*CUDA GPU only"):
        flex.train()(tokens, documents=docs)


@pytest.mark.parametrize("change,error", [({"attention": "flash"}, "one of"),
                                          ({"attention": "flex", "dropout": 0.1}, "dropout")])
def test_attention_field_is_checked(change, error):
    with pytest.raises(ValueError, match=f"model.attention.*{error}"):
        ModelConfig(**change).check()
