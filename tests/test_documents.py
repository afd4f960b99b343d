"""Packed rows in the loss (docs/contract.md §10): `documents` as one tensor of ids per row, as
the official layout's (prefix_ids, suffix_ids) of documents joined by a separator, or as a general
(prefix_ids, suffix_ids) pair, on every backend, against a brute-force loop over pairs whose pair
set is written from the definitions (a pair's ends in one document; no separator strictly between
i and j; prefix id of i equal to suffix id of j), not from _pairs."""
import copy
import functools
from collections import Counter

import pytest
import torch

from _helpers import TOL, brute_force, checked_draw, contract_weights, grads_of, make_head, random_grad_out, rel_err, switch
from bst_fast import BeliefStateTransformer, ModelConfig, belief_state_loss, separated_documents
from bst_fast import _pairs

B, L, m, V = 4, 14, 5, 9
SEP, MEET = 2, 2  # the separator (an EOS), also the meet token as in the official 'eos' mode
LENGTHS = [14, 11, 6, 1]
# ids: row 0 three documents; row 1 five (of 1, 2, 3, 2, 3 positions), then padding whose ids go
# down (padding is never read); row 2 one document; row 3 no pair at all
IDS = [[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2],
       [0, 1, 1, 4, 4, 4, 6, 6, 7, 7, 7, 0, 0, 0],
       [3] * L,
       [0] * L]
# separator positions of the official layout, per row (row 2: none, one document)
SEPS = [[4, 9], [1, 2, 6, 8], [], []]
# a general (prefix_ids, suffix_ids) pair, each non-decreasing: a document's suffix run may start
# past i + min_gap (row 0's second document: i from 6, j from 9), end before its prefix run starts
# (row 1's document 1: j = 5 only) or hold an id no prefix has (row 1's 2)
PRE = [[0] * 6 + [1] * 8,
       [0, 0, 1, 1, 1, 1, 3, 3, 3, 3, 3, 0, 0, 0],
       [0, 0, 0, 1, 1, 1] + [1] * 8,
       [0] * L]
SUF = [[0] * 9 + [1] * 5,
       [0, 0, 0, 0, 0, 1, 2, 2, 2, 3, 3, 0, 0, 0],
       [0, 0, 0, 0, 0, 1] + [1] * 8,
       [0] * L]

CASES = {
    "all": dict(),
    "all_row_mean": dict(reduction="row_mean"),
    "meet_sum_max_gap": dict(min_gap=1, meet_token=MEET, max_gap=4, reduction="sum", next_weight=0.3),
    "meet_row_mean_start": dict(min_gap=1, meet_token=MEET, reduction="row_mean", prefix_start=[1, 0, 2, 0]),
    "gap3": dict(min_gap=3),
    "explicit": dict(min_gap=1, meet_token=MEET, pairs="listed"),
    "fraction_row_mean": dict(min_gap=1, meet_token=MEET, pairs=0.4, reduction="row_mean", seed=3),
    "count": dict(pairs=3, seed=4),
}
LAYOUTS = ["ids", "separated", "general"]
BACKENDS = [("reference", "reference", torch.float64, None), ("torch", "torch", torch.float64, None),
            ("torch_triton_ops", "torch", torch.float32, True), ("cpp", "cpp", torch.float32, None),
            ("triton", "triton", torch.float32, None)]


def inputs(layout, seed=0):
    """(f, b, tokens, head, documents) in float64 holding float32 values. In the separated layout the
    separator appears exactly at SEPS; elsewhere tokens avoid it."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, L, m, generator=g).double()
    b = torch.randn(B, L, m, generator=g).double()
    tokens = torch.randint(3, V, (B, L), generator=g)
    if layout == "ids":
        tokens[0, 5] = SEP  # an ordinary token here: documents come from the ids alone
        documents = torch.tensor(IDS)
    elif layout == "general":
        documents = (torch.tensor(PRE), torch.tensor(SUF))
    else:
        for r, seps in enumerate(SEPS):
            tokens[r, seps] = SEP
        documents = separated_documents(tokens, SEP)
    head = make_head(m, V, hidden=[6, 5], n_layers=3, seed=seed).double()
    return f, b, tokens, head, documents


def together(layout, r, i, j):
    """The definition of §10: ids - one id at both ends; separated - no separator strictly between;
    general - prefix id of i equal to suffix id of j."""
    if layout == "ids":
        return IDS[r][i] == IDS[r][j]
    if layout == "general":
        return PRE[r][i] == SUF[r][j]
    return not any(i < s < j for s in SEPS[r])


def pair_set(layout, r, min_gap, max_gap, prefix_start=0):
    top = L if max_gap is None else max_gap
    return [(i, j) for i in range(prefix_start, L) for j in range(L)
            if i + min_gap <= j <= min(i + top, LENGTHS[r] - 1) and together(layout, r, i, j)]


def starts(spec):
    return spec.get("prefix_start", [0] * B)


def listed_pairs(layout):
    """Some pairs of each layout's set, one listed twice, gap-1 pairs in."""
    chosen = [(r, i, j) for r in range(B) for i, j in pair_set(layout, r, 1, None)][::3]
    return chosen + chosen[:1]


def opts_of(case, layout, documents):
    spec = dict(CASES[case])
    if spec.get("pairs") == "listed":
        spec["pairs"] = tuple(torch.tensor(x) for x in zip(*listed_pairs(layout)))
    if "seed" in spec:
        spec["generator"] = torch.Generator().manual_seed(spec.pop("seed"))
    spec["prefix_start"] = torch.tensor(starts(spec))
    return dict(lengths=torch.tensor(LENGTHS), documents=documents, **spec)


def chosen_pairs(case, layout, f, b, tokens, documents):
    """(r, i, j) and weights from the contract: all pairs (§4), listed, or the sampler's draw (§5,
    checked here: k_r distinct pairs of P_r), each weighted as §4, §5 and §9 say."""
    spec = CASES[case]
    min_gap, max_gap, reduction = spec.get("min_gap", 2), spec.get("max_gap"), spec.get("reduction", "mean")
    sets = [pair_set(layout, r, min_gap, max_gap, starts(spec)[r]) for r in range(B)]
    full = [len(s) for s in sets]
    pairs = spec.get("pairs")
    if pairs is None:
        chosen = [(r, i, j) for r in range(B) for i, j in sets[r]]
    elif pairs == "listed":
        chosen = listed_pairs(layout)
    else:
        o = opts_of(case, layout, documents)
        p = _pairs.prepare(f, b, tokens, V, **{k: o.get(k) for k in ("lengths", "prefix_start", "max_gap",
                                                                         "generator", "documents")},
                           min_gap=min_gap, meet_token=spec.get("meet_token"), pairs=pairs, next_weight=0.5,
                           reduction=reduction)
        chosen = checked_draw(p, sets, pairs)
    kind = "all" if pairs is None else "sampled" if isinstance(pairs, (int, float)) else "listed"
    weights = contract_weights(chosen, full, kind, reduction, B)
    return chosen, weights


@functools.lru_cache(maxsize=None)
def expected(case, layout):
    f, b, tokens, head, documents = inputs(layout)
    chosen, weights = chosen_pairs(case, layout, f, b, tokens, documents)
    f, b = f.requires_grad_(), b.requires_grad_()
    spec = CASES[case]
    loss = brute_force(f, b, tokens, head, chosen, weights, spec.get("meet_token"), spec.get("next_weight", 0.5))
    return grads_of(loss, f, b, head, random_grad_out(len(case)))


@pytest.mark.parametrize("name,backend,dtype,triton_ops", BACKENDS, ids=[x[0] for x in BACKENDS])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", list(CASES))
def test_against_brute_force(case, layout, name, backend, dtype, triton_ops, monkeypatch):
    if triton_ops or backend == "triton":
        pytest.importorskip("triton")
    switch(monkeypatch, triton_ops=triton_ops, chunk_pairs=13)  # chunk boundaries inside rows
    f, b, tokens, head, documents = inputs(layout)
    f, b, head = f.to(dtype).requires_grad_(), b.to(dtype).requires_grad_(), copy.deepcopy(head).to(dtype)
    loss = belief_state_loss(f, b, tokens, head, backend=backend, **opts_of(case, layout, documents))
    got = grads_of(loss, f, b, head, random_grad_out(len(case)))
    want = expected(case, layout)
    tol_loss, tol_grad = TOL[dtype]
    assert rel_err(got[0], want[0]) < tol_loss, (got[0], want[0])
    names = ["f", "b"] + [n for n, _ in head.named_parameters()]
    for n, g, w in zip(names, got[1:], want[1:]):
        assert g.dtype == dtype and rel_err(g, w) < tol_grad, (n, rel_err(g, w))


@pytest.mark.parametrize("n_docs", [1, 2, 3, 4, 5])
def test_a_packed_row_is_the_sum_of_its_documents(n_docs):
    """reduction="sum": a row packed with n documents (random lengths, each its own ids) gives the
    loss of those documents as rows of their own, and the same gradients; the pair count is the sum
    of their triangles, not the packed row's."""
    g = torch.Generator().manual_seed(n_docs)
    sizes = (torch.randint(2, 7, (n_docs,), generator=g)).tolist()
    T = sum(sizes) + 2  # two positions of padding
    f = torch.randn(1, T, m, generator=g, dtype=torch.float64)
    b = torch.randn(1, T, m, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (1, T), generator=g)
    head = make_head(m, V, seed=n_docs).double()
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(sizes)] + [torch.zeros(2, dtype=torch.long)])[None]
    opts = dict(min_gap=1, meet_token=MEET, reduction="sum")
    packed = belief_state_loss(f, b, tokens, head, lengths=sum(sizes), documents=ids, **opts)
    alone, s = 0.0, 0
    for n in sizes:
        if n >= 2:  # a document of one position has no pair
            alone = alone + belief_state_loss(f[:, s:s + n], b[:, s:s + n], tokens[:, s:s + n], head, **opts)
        s += n
    assert torch.allclose(packed, alone, rtol=1e-12)
    counts = _pairs.pair_counts(torch.tensor([sum(sizes)]), torch.tensor([0]), 1, T, T, documents=ids)
    assert counts.tolist() == [sum(n * (n - 1) // 2 for n in sizes)]


def test_sampler_draws_uniformly_within_documents():
    """The packed-row sampler: k_r distinct pairs of P_r, each with probability k_r / |P_r| (5 standard
    deviations over 2000 draws), reproducible from the generator."""
    f, b, tokens, head, documents = inputs("separated")
    sets = [pair_set("separated", r, 1, None) for r in range(B)]
    lengths = torch.tensor(LENGTHS)
    hits, n = Counter(), 2000
    k = 4
    for seed in range(n):
        p = _pairs.prepare(f, b, tokens, V, lengths=lengths, prefix_start=0, min_gap=1, max_gap=None,
                           meet_token=MEET, pairs=k, next_weight=0.5, reduction="mean",
                           generator=torch.Generator().manual_seed(seed), documents=documents)
        drawn = list(zip(p.row.tolist(), p.i.tolist(), p.j.tolist()))
        assert drawn == sorted(set(drawn))
        for r in range(B):
            got = [(i, j) for rr, i, j in drawn if rr == r]
            assert len(got) == min(k, len(sets[r])) and set(got) <= set(sets[r])
        hits.update(drawn)
    for r in range(B):
        p_in = min(k, len(sets[r])) / max(len(sets[r]), 1)
        sd = (n * p_in * (1 - p_in)) ** 0.5
        for i, j in sets[r]:
            assert abs(hits[(r, i, j)] - n * p_in) <= 5 * sd + 1e-9, (r, i, j, hits[(r, i, j)], n * p_in)
    again = [_pairs.prepare(f, b, tokens, V, lengths=lengths, prefix_start=0, min_gap=1, max_gap=None,
                            meet_token=MEET, pairs=k, next_weight=0.5, reduction="mean",
                            generator=torch.Generator().manual_seed(7), documents=documents).j for _ in range(2)]
    assert torch.equal(*again)


def test_one_document_per_row_changes_nothing():
    """documents with one id per row is the unpacked objective, bitwise, on the fused CPU engine."""
    f, b, tokens, head, _ = inputs("ids")
    f, b, head = f.float(), b.float(), copy.deepcopy(head).float()
    opts = dict(lengths=torch.tensor(LENGTHS), min_gap=1, meet_token=MEET, backend="cpp")
    plain = belief_state_loss(f, b, tokens, head, **opts)
    one = belief_state_loss(f, b, tokens, head, documents=torch.zeros(B, L, dtype=torch.long), **opts)
    assert torch.allclose(plain, one, rtol=1e-6)


def test_model_packed_loss_is_its_documents_loss():
    """The model on a packed row (encoders within documents, pairs within documents, GPT head's
    targets within documents) gives, with reduction sum, the sum of its documents' losses as rows."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, max_len=24, n_layer=1, d_model=8, n_head=2, head_hidden=8, gpt_head=True)
    model = BeliefStateTransformer(cfg).double().eval()
    docs = [torch.randint(3, V, (n,)) for n in (5, 3, 6)]
    row = torch.cat(docs)[None]
    ids = torch.cat([torch.full((len(d),), k) for k, d in enumerate(docs)])[None]
    out = model(row, documents=ids, gamma=0.5, pair_total=1.0, token_total=1.0)
    alone = [model(d[None], gamma=0.5, pair_total=1.0, token_total=1.0) for d in docs]
    # a float64 model's GPT head loss stays float64 (next_token_loss rounded it to float32 before
    # stop 38: 1e-6 was the bound here), so both agree to float64's reassociation
    for key in ("belief", "gpt"):
        assert out[key].dtype == torch.float64, key
        assert torch.allclose(out[key], sum(a[key] for a in alone), rtol=1e-10), key



@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpt_head_targets_are_the_next_tokens_within_a_document(layout):
    """gamma > 0: the GPT head's loss is the mean CE of gpt(f_i) against tokens[i + 1] over the
    positions prefix_start <= i <= len - 2 whose (i, i + 1) is a pair of §10 (`together`, not
    next_token_mask): in the official layout each one, a separator (the EOS) as target included."""
    _, _, tokens, _, documents = inputs(layout)
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=V, max_len=16, n_layer=1, d_model=8, n_head=2, head_hidden=8, gpt_head=True)
    model = BeliefStateTransformer(cfg).double().eval()
    start, lengths = [1, 0, 2, 0], torch.tensor(LENGTHS)
    out = model(tokens, lengths, documents=documents, gamma=0.5, prefix_start=torch.tensor(start))
    trained = [(r, i) for r in range(B) for i in range(start[r], LENGTHS[r] - 1) if together(layout, r, i, i + 1)]
    rows, at = (torch.tensor(x) for x in zip(*trained))
    f = model.prefix_states(tokens, documents, lengths=lengths)
    want = torch.nn.functional.cross_entropy(model.gpt(f[rows, at]), tokens[rows, at + 1])
    assert torch.allclose(out["gpt"], want, rtol=1e-12, atol=0), (out["gpt"], want)
    if layout == "separated":
        eos = [(r, s - 1) for r in range(B) for s in SEPS[r] if start[r] <= s - 1 and s <= LENGTHS[r] - 1]
        assert eos and set(eos) <= set(trained)


BAD = [
    (lambda d: d.flip(1), "documents must be non-decreasing along each row's valid positions"),
    (lambda d: d.float(), "documents must be a \\(B, L\\) integer tensor"),
    (lambda d: d[:, :-1], "documents must have shape \\(B, L\\)"),
    (lambda d: (d, d, d), "documents must be a \\(B, L\\) tensor of ids or a \\(prefix_ids, suffix_ids\\) pair"),
    (lambda d: (d, d.flip(1)), "documents\\[1\\] \\(suffix ids\\) must be non-decreasing"),
    (lambda d: [1, 2], "documents must be a \\(B, L\\) tensor of ids or a \\(prefix_ids, suffix_ids\\) pair, got a "
                       "list of 2 that are not all tensors"),
]


@pytest.mark.parametrize("backend", ["reference", "cpp"])
@pytest.mark.parametrize("bad,error", BAD, ids=["unsorted", "float", "shape", "triple", "suffix_unsorted", "list"])
def test_bad_documents(bad, error, backend):
    f, b, tokens, head, documents = inputs("ids")
    f, b, head = f.float(), b.float(), copy.deepcopy(head).float()
    with pytest.raises(ValueError, match=error):
        belief_state_loss(f, b, tokens, head, lengths=torch.tensor(LENGTHS), documents=bad(documents), backend=backend)


@pytest.mark.parametrize("compiling", [False, True])
def test_listed_pair_across_documents_is_refused(monkeypatch, compiling):
    """Also under torch.compile, where the op repeats the other checks but never sees the documents
    (review helper-36: the compiled cpp call computed a loss over the pair)."""
    f, b, tokens, head, documents = inputs("ids")
    f, b, head = f.float(), b.float(), head.float()  # cpp's dtype
    pairs = (torch.tensor([0]), torch.tensor([2]), torch.tensor([5]))  # ids 0 and 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    for backend in ("cpp", "torch"):
        with pytest.raises(ValueError, match="i and j in one document"):
            belief_state_loss(f, b, tokens, head, lengths=torch.tensor(LENGTHS), documents=documents, pairs=pairs,
                              backend=backend)
