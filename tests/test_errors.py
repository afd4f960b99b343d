"""Bad input (issue 2 §6): a ValueError (IndexError for token ids) naming the argument, through every
backend; NaN/inf propagate; the raw ops raise RuntimeError (ValueError or IndexError where their
value checks stand in for prepare's under torch.compile: lengths, prefix_start, listed pairs, tokens,
weights, a batch with no pair) and never crash."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import bst_fast.backends.cpp_backend  # noqa: F401  (registers the ops' Python rules)
from bst_fast import BACKENDS, BeliefStateLoss, ResidualSwiGLUHead, belief_state_loss

from _helpers import make_head, make_inputs

B, L, m, V = 3, 11, 5, 7
BACKENDS_CPU = ["reference", "torch", "cpp"]


def _randn(*shape, dtype=torch.float32):
    """A seeded normal draw: the bad-input cases' values do not matter, but no test draws unseeded."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


@pytest.fixture
def inputs():
    return make_inputs(B=B, L=L, m=m, V=V, hidden=6, seed=0)


def _call(inputs, backend, **overrides):
    f, b, tokens, head = inputs
    args = dict(f=f, b=b, tokens=tokens, head=head)
    opts = {k: v for k, v in overrides.items() if k not in args}
    args.update({k: v for k, v in overrides.items() if k in args})
    return belief_state_loss(args["f"], args["b"], args["tokens"], args["head"], backend=backend, **opts)


def _tok(tokens, r, t, value):
    tokens = tokens.clone()
    tokens[r, t] = value
    return tokens


def _bad_pairs():
    row, i, j = torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 3]), torch.tensor([2, 5, 3, 10])
    return row, i, j  # pairs[2] = (2, 2, 3) has a gap of 1


# name -> (overrides(inputs) -> dict, exception, regex the message must match)
BAD = {
    "token_negative": (lambda x: dict(tokens=_tok(x[2], 1, 4, -1)), IndexError, r"tokens.*\[1, 4\].*-1"),
    "token_too_big": (lambda x: dict(tokens=_tok(x[2], 2, 0, V)), IndexError, r"tokens.*\[2, 0\].*7"),
    "token_too_big_last_valid": (lambda x: dict(tokens=_tok(x[2], 0, 6, 100), lengths=torch.tensor([7, 11, 11])),
                                 IndexError, r"tokens.*\[0, 6\]"),
    "tokens_float": (lambda x: dict(tokens=x[2].float()), ValueError, "tokens"),
    "tokens_shape": (lambda x: dict(tokens=x[2][:, :-1]), ValueError, "tokens"),
    "tokens_batch": (lambda x: dict(tokens=x[2][:2]), ValueError, "tokens"),
    "f_not_3d": (lambda x: dict(f=x[0][0], b=x[1][0]), ValueError, r"\bf\b"),
    "b_shape": (lambda x: dict(b=x[1][:, :-1]), ValueError, r"\bb\b"),
    "b_width": (lambda x: dict(b=_randn(B, L, m + 1)), ValueError, r"\bb\b"),
    "head_d_model": (lambda x: dict(head=make_head(m + 1, V, hidden=6)), ValueError, "d_model"),
    "swiglu_head_d_model": (lambda x: dict(head=ResidualSwiGLUHead(m + 1, V, hidden=6)), ValueError, "d_model"),
    "f_int": (lambda x: dict(f=x[0].long(), b=x[1].long()), ValueError, "f must be floating point"),
    "b_dtype": (lambda x: dict(b=x[1].double()), ValueError, r"\bb\b.*dtype"),
    "head_dtype": (lambda x: dict(head=make_head(m, V, hidden=6).double()), ValueError, "head.*dtype"),
    "head_not_module": (lambda x: dict(head=lambda z: z), ValueError, "head"),
    "lengths_above_L": (lambda x: dict(lengths=torch.tensor([11, 12, 3])), ValueError, r"lengths\[1\].*12"),
    "lengths_negative": (lambda x: dict(lengths=torch.tensor([11, 5, -1])), ValueError, r"lengths\[2\]"),
    "lengths_int_above_L": (lambda x: dict(lengths=L + 1), ValueError, "lengths"),
    "lengths_shape": (lambda x: dict(lengths=torch.tensor([11, 5])), ValueError, "lengths"),
    "lengths_float": (lambda x: dict(lengths=torch.tensor([11.0, 5.0, 3.0])), ValueError, "lengths"),
    "prefix_start_negative": (lambda x: dict(prefix_start=torch.tensor([0, -2, 0])), ValueError, r"prefix_start\[1\]"),
    "prefix_start_shape": (lambda x: dict(prefix_start=torch.tensor([0, 1])), ValueError, "prefix_start"),
    "min_gap_1": (lambda x: dict(min_gap=1), ValueError, "min_gap"),
    "min_gap_0": (lambda x: dict(min_gap=0), ValueError, "min_gap"),
    "min_gap_float": (lambda x: dict(min_gap=2.5), ValueError, "min_gap"),
    "max_gap_below_min_gap": (lambda x: dict(min_gap=4, max_gap=3), ValueError, "max_gap"),
    "max_gap_below_default_min_gap": (lambda x: dict(max_gap=1), ValueError, "max_gap"),
    "min_gap_int64_max": (lambda x: dict(min_gap=2**63 - 1), ValueError, "no valid pair"),
    "explicit_pair_gap": (lambda x: dict(pairs=_bad_pairs()), ValueError, r"pairs\[2\]"),
    "explicit_pair_row": (lambda x: dict(pairs=(torch.tensor([0, 3]), torch.tensor([0, 0]), torch.tensor([2, 2]))),
                          ValueError, r"pairs\[1\]"),
    "explicit_pair_negative_row": (lambda x: dict(pairs=(torch.tensor([-1]), torch.tensor([0]), torch.tensor([2]))),
                                   ValueError, r"pairs\[0\]"),
    "explicit_pair_beyond_length": (lambda x: dict(pairs=(torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([2, 6])),
                                                   lengths=torch.tensor([11, 6, 11])), ValueError, r"pairs\[1\]"),
    "explicit_pair_before_prefix_start": (lambda x: dict(pairs=(torch.tensor([0, 1]), torch.tensor([3, 1]), torch.tensor([6, 4])),
                                                         prefix_start=2), ValueError, r"pairs\[1\]"),
    "explicit_pair_above_max_gap": (lambda x: dict(pairs=(torch.tensor([0, 1]), torch.tensor([3, 1]), torch.tensor([6, 9])),
                                                   max_gap=4), ValueError, r"pairs\[1\]"),
    "explicit_pair_i_negative": (lambda x: dict(pairs=(torch.tensor([0]), torch.tensor([-1]), torch.tensor([2]))),
                                 ValueError, r"pairs\[0\]"),
    "explicit_pair_j_at_L": (lambda x: dict(pairs=(torch.tensor([0]), torch.tensor([3]), torch.tensor([L]))),
                             ValueError, r"pairs\[0\]"),
    "explicit_pair_huge_i": (lambda x: dict(pairs=(torch.tensor([0]), torch.tensor([2**63 - 2]), torch.tensor([-2**63])),
                                            max_gap=3), ValueError, r"pairs\[0\]"),
    "explicit_pairs_empty": (lambda x: dict(pairs=(torch.zeros(0, dtype=torch.long),) * 3), ValueError, "pairs"),
    "explicit_pairs_two": (lambda x: dict(pairs=(torch.tensor([0]), torch.tensor([0]))), ValueError, "pairs"),
    "explicit_pairs_lengths_differ": (lambda x: dict(pairs=(torch.tensor([0, 0]), torch.tensor([0]), torch.tensor([2]))),
                                      ValueError, "pairs"),
    "explicit_pairs_float": (lambda x: dict(pairs=(torch.tensor([0.0]), torch.tensor([0.0]), torch.tensor([2.0]))),
                             ValueError, "pairs"),
    "explicit_pairs_not_tensors": (lambda x: dict(pairs=([0], [0], [2])), ValueError, "pairs"),
    "pairs_fraction_0": (lambda x: dict(pairs=0.0), ValueError, "pairs"),
    "pairs_fraction_1.5": (lambda x: dict(pairs=1.5), ValueError, "pairs"),
    "pairs_fraction_negative": (lambda x: dict(pairs=-0.5), ValueError, "pairs"),
    "pairs_count_0": (lambda x: dict(pairs=0), ValueError, "pairs"),
    "pairs_count_negative": (lambda x: dict(pairs=-3), ValueError, "pairs"),
    "pairs_bool": (lambda x: dict(pairs=True), ValueError, "pairs"),
    "pairs_string": (lambda x: dict(pairs="all"), ValueError, "pairs"),
    # a batch without a pair (a loss of 0 under sum and row_mean) hid these before
    "pairs_nan_no_pair_sum": (lambda x: dict(lengths=torch.tensor([2, 1, 0]), pairs=float("nan"), reduction="sum"),
                              ValueError, r"pairs as a fraction must lie in \(0, 1\], got nan"),
    "pairs_count_no_pair_row_mean": (lambda x: dict(lengths=torch.tensor([2, 1, 0]), pairs=-3, reduction="row_mean"),
                                     ValueError, "pairs as a count per row must be >= 1, got -3"),
    "pairs_tensor_no_pair_mean": (lambda x: dict(lengths=torch.tensor([2, 1, 0]), pairs=torch.tensor(0.5)),
                                  ValueError, "pairs must be None, a float fraction .* got Tensor"),
    "no_pair_short_rows": (lambda x: dict(lengths=torch.tensor([2, 1, 0])), ValueError, "no valid pair"),
    "no_pair_prefix_start": (lambda x: dict(prefix_start=9), ValueError, "no valid pair"),
    "no_pair_min_gap": (lambda x: dict(min_gap=L), ValueError, "no valid pair"),
    "no_pair_subsampled": (lambda x: dict(lengths=torch.tensor([2, 2, 2]), pairs=0.5), ValueError, "no valid pair"),
    "no_pair_count": (lambda x: dict(prefix_start=20, pairs=3), ValueError, "no valid pair"),
    "reduction": (lambda x: dict(reduction="avg"), ValueError, "reduction"),
    "reduction_none": (lambda x: dict(reduction="none"), ValueError, "reduction"),
    "next_weight_above_1": (lambda x: dict(next_weight=1.5), ValueError, "next_weight"),
    "next_weight_negative": (lambda x: dict(next_weight=-0.1), ValueError, "next_weight"),
    "next_weight_nan": (lambda x: dict(next_weight=float("nan")), ValueError, "next_weight"),
    "next_weight_string": (lambda x: dict(next_weight="0.5"), ValueError, "next_weight"),
    "explicit_pairs_complex": (lambda x: dict(pairs=(torch.tensor([0]), torch.tensor([0]), torch.tensor([3 + 5j]))),
                               ValueError, "pairs .*complex"),
    "explicit_pairs_no_rows": (lambda x: dict(f=x[0][:0], b=x[1][:0], tokens=x[2][:0],
                                              pairs=(torch.tensor([0]), torch.tensor([0]), torch.tensor([2]))),
                               ValueError, r"pairs\[0\].*no rows"),
    "generator_int": (lambda x: dict(pairs=0.5, generator=123), ValueError, "generator must be None or a torch.Generator"),
    "lengths_int_beyond_int64": (lambda x: dict(lengths=2**70), ValueError, "lengths must fit in int64"),
    # torch compares no uint16/32/64 tensor: a NotImplementedError from inside a check before
    "tokens_uint16": (lambda x: dict(tokens=x[2].to(torch.uint16)), ValueError, r"tokens must be an integer tensor \(int8, .*got torch.uint16"),
    "tokens_uint64": (lambda x: dict(tokens=x[2].to(torch.uint64)), ValueError, r"tokens must be an integer tensor .*got torch.uint64"),
    "documents_list_of_lists": (lambda x: dict(documents=[[0] * x[2].shape[1]] * 2), ValueError,
                                r"documents must be a \(B, L\) tensor of ids or a \(prefix_ids, suffix_ids\) pair, "
                                r"got a list of 2 that are not all tensors"),
    "documents_uint32": (lambda x: dict(documents=torch.zeros(x[2].shape, dtype=torch.uint32)), ValueError,
                         r"documents must be a \(B, L\) integer tensor .*got torch.uint32"),
    "prefix_start_int_beyond_int64": (lambda x: dict(prefix_start=2**64), ValueError, "prefix_start must fit in int64"),
    "deterministic_string": (lambda x: dict(deterministic="yes"), ValueError, "deterministic must be True or False, got 'yes'"),
    "deterministic_int": (lambda x: dict(deterministic=1), ValueError, "deterministic must be True or False, got 1"),
}


@pytest.mark.parametrize("backend", BACKENDS_CPU)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(inputs, case, backend):
    make, exc, pattern = BAD[case]
    with pytest.raises(exc, match=pattern):
        _call(inputs, backend, **make(inputs))


@pytest.mark.parametrize("backend", BACKENDS_CPU)
def test_padding_tokens_are_not_checked(inputs, backend):
    """Token ids beyond lengths[r] are padding: any value is accepted there."""
    f, b, tokens, head = inputs
    tokens = tokens.clone()
    tokens[0, 7:] = -100
    tokens[1, 9:] = V + 5
    loss = _call(inputs, backend, tokens=tokens, lengths=torch.tensor([7, 9, 11]))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", BACKENDS_CPU)
def test_short_rows_are_fine(inputs, backend):
    """Rows too short for any pair contribute nothing, as long as some row has a pair."""
    f, b, tokens, head = inputs
    loss = _call(inputs, backend, lengths=torch.tensor([0, 2, 3]))  # only (row 2, i=0, j=2)
    single = _call(inputs, backend, pairs=(torch.tensor([2]), torch.tensor([0]), torch.tensor([2])))
    assert torch.allclose(loss, single, rtol=1e-6)


def test_unknown_backend_lists_the_choices(inputs):
    with pytest.raises(ValueError) as e:
        _call(inputs, "cuda")
    msg = str(e.value)
    assert "backend" in msg and "'cuda'" in msg
    for name in BACKENDS:
        assert name in msg


def test_bad_head_output():
    """A head whose output is not (..., 2V) is refused."""
    f, b, tokens, _ = make_inputs(B=B, L=L, m=m, V=V, seed=1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        odd = torch.nn.Linear(2 * m, 2 * V + 1)
    with pytest.raises(ValueError, match="head"):
        belief_state_loss(f, b, tokens, odd, backend="torch")


def test_module_form_checks_too(inputs):
    f, b, tokens, head = inputs
    with pytest.raises(ValueError, match="min_gap"):
        BeliefStateLoss(head, min_gap=1)(f, b, tokens)
    with pytest.raises(ValueError, match="backend"):
        BeliefStateLoss(head, backend="fast")(f, b, tokens)


@pytest.mark.parametrize("backend", BACKENDS_CPU + ["auto"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["f", "b"])
def test_nonfinite_inputs_show_in_the_loss(inputs, backend, value, where):
    f, b, tokens, head = inputs
    x = (f if where == "f" else b).clone()
    x[1, 3, 2] = value  # f[1, 3] is the prefix of pairs (3, 5..10); b[1, 3] the suffix of (0..1, 3)
    loss = _call(inputs, backend, **{where: x})
    assert not torch.isfinite(loss), loss


@pytest.mark.parametrize("backend", BACKENDS_CPU)
def test_nonfinite_head_weight_shows_in_the_loss(inputs, backend):
    f, b, tokens, head = inputs
    with torch.no_grad():
        head.layers[-1].weight[3, 1] = float("nan")
    assert torch.isnan(_call(inputs, backend))


# --------------------------------------------------------------------------------------------
# The raw ops: every bad argument is a RuntimeError (TORCH_CHECK), never a crash.


def _op_args(**changes):
    g = torch.Generator().manual_seed(0)
    Bb, Ll, H, VV = 2, 9, 5, 4
    args = dict(A=torch.randn(Bb, Ll, H, generator=g), Bm=torch.randn(Bb, Ll, H, generator=g),
                weights=[torch.randn(6, H, generator=g), torch.randn(2 * VV, 6, generator=g)],
                biases=[torch.randn(6, generator=g), torch.randn(2 * VV, generator=g)],
                tokens=torch.randint(0, VV, (Bb, Ll), generator=g), lengths=torch.tensor([9, 7]),
                prefix_start=torch.tensor([0, 1]), min_gap=2, max_gap=5, row=None, i=None, j=None,
                weight=torch.tensor(0.1, dtype=torch.float64), next_weight=0.5, activation="gelu",
                need_grad=True)
    args.update(changes)
    return list(args.values())


_LIST = dict(row=torch.tensor([0, 1]), i=torch.tensor([0, 2]), j=torch.tensor([3, 6]),
             weight=torch.tensor([0.5, 0.5], dtype=torch.float64))
OP_BAD = {
    "A_2d": dict(A=_randn(9, 5)),
    "Bm_shape": dict(Bm=_randn(2, 8, 5)),
    "A_double": dict(A=_randn(2, 9, 5, dtype=torch.float64)),
    "A_half": dict(A=_randn(2, 9, 5).half(), Bm=_randn(2, 9, 5).half()),
    "no_weights": dict(weights=[], biases=[]),
    "weights_biases_count": dict(biases=[_randn(6)]),
    "weight_in_width": dict(weights=[_randn(6, 4), _randn(8, 6)]),
    "weight_chain": dict(weights=[_randn(6, 5), _randn(8, 7)]),
    "bias_width": dict(biases=[_randn(5), _randn(8)]),
    "odd_output": dict(weights=[_randn(6, 5), _randn(7, 6)], biases=[_randn(6), _randn(7)]),
    "weight_double": dict(weights=[_randn(6, 5).double(), _randn(8, 6)]),
    "tokens_shape": dict(tokens=torch.zeros(2, 8, dtype=torch.long)),
    "tokens_int32": dict(tokens=torch.zeros(2, 9, dtype=torch.int32)),
    "token_negative": dict(tokens=torch.full((2, 9), -1)),
    "token_too_big": dict(tokens=torch.full((2, 9), 4)),
    "lengths_above_L": dict(lengths=torch.tensor([10, 7])),
    "lengths_negative": dict(lengths=torch.tensor([9, -3])),
    "lengths_shape": dict(lengths=torch.tensor([9])),
    "lengths_int32": dict(lengths=torch.tensor([9, 7], dtype=torch.int32)),
    "prefix_start_negative": dict(prefix_start=torch.tensor([0, -1])),
    "prefix_start_shape": dict(prefix_start=torch.tensor([0, 1, 2])),
    "min_gap_1": dict(min_gap=1),
    "max_gap_below_min_gap": dict(min_gap=3, max_gap=2),
    "next_weight": dict(next_weight=1.5),
    "activation": dict(activation="tanh"),
    "weight_not_scalar": dict(weight=torch.ones(3, dtype=torch.float64)),
    "row_without_i": dict(row=torch.tensor([0])),
    "pair_list_weight_count": {**_LIST, "weight": torch.ones(3, dtype=torch.float64)},
    "pair_list_lengths_differ": {**_LIST, "j": torch.tensor([3])},
    "pair_list_int32": {**_LIST, "row": torch.tensor([0, 1], dtype=torch.int32)},
    "pair_row_out_of_range": {**_LIST, "row": torch.tensor([0, 2])},
    "pair_row_negative": {**_LIST, "row": torch.tensor([-1, 1])},
    "pair_j_beyond_length": {**_LIST, "j": torch.tensor([3, 7])},
    "pair_j_beyond_L": {**_LIST, "row": torch.tensor([0, 0]), "j": torch.tensor([3, 100])},
    "pair_gap_too_small": {**_LIST, "j": torch.tensor([1, 6])},
    "pair_i_before_prefix_start": {**_LIST, "i": torch.tensor([0, 0]), "j": torch.tensor([3, 4])},
    "pair_i_negative": {**_LIST, "i": torch.tensor([-1, 2]), "j": torch.tensor([3, 6])},
    "weight_inf": dict(weight=torch.tensor(float("inf"), dtype=torch.float64)),
    "weight_past_float32": dict(weight=torch.tensor(1e300, dtype=torch.float64)),  # an inf loss in float32
    # 1/|P| of a batch with no pair is inf: the missing pairs are the error, not the scale
    "no_pair_inf_scale": dict(lengths=torch.tensor([1, 2]), weight=torch.tensor(float("inf"), dtype=torch.float64)),
}
# What each case's error says: the check it is named after, not an earlier one.
OP_MATCH = {
    "A_2d": r"A must be \(B, L, h1\)", "Bm_shape": "Bm must have the shape of A", "A_double": "must be float32",
    "A_half": "must be float32", "no_weights": "at least the output layer", "weights_biases_count": "one entry per layer",
    "weight_in_width": r"weights\[0\] must be", "weight_chain": r"weights\[1\] must be", "bias_width": r"biases\[0\]",
    "odd_output": "2V outputs", "weight_double": r"weights\[0\] must be", "tokens_shape": r"tokens must be int64 CPU \(2, 9\), got \[2, 8\]",
    "tokens_int32": "tokens must be int64", "token_negative": r"tokens\[0, 0\] = -1", "token_too_big": r"tokens\[0, 0\] = 4",
    "lengths_above_L": r"lengths must lie in \[0, L=9\], got lengths\[0\] = ", "lengths_negative": r"got lengths\[1\] = -",
    "lengths_shape": r"got \[1\]", "lengths_int32": r"lengths must be int64 CPU \(2,\), got \[2\] Int",
    "prefix_start_negative": r"prefix_start must be >= 0, got prefix_start\[1\] = -", "prefix_start_shape": r"got \[3\]",
    "min_gap_1": "min_gap must be >= 2", "max_gap_below_min_gap": "max_gap must be >= min_gap", "next_weight": "next_weight",
    "activation": "activation must be one of", "weight_not_scalar": "weight must be a 0-dim", "row_without_i": "given together",
    "pair_list_weight_count": "one entry per pair", "pair_list_lengths_differ": r"j must be an int64 CPU vector as long as row \(2\), got \[1\]",
    "pair_list_int32": r"row must be an int64 CPU vector .* Int", "weight_inf": r"weight\[0\] must be finite",
    "weight_past_float32": r"weight\[0\] must be finite, >= 0 and at most float32's largest \(3.40282e\+38\), got 1e\+300",
    "no_pair_inf_scale": "no valid pair at all",
    **{case: rf"pairs\[{k}\] = .* is not a valid pair" for case, k in (
        ("pair_row_out_of_range", 1), ("pair_row_negative", 0), ("pair_j_beyond_length", 1), ("pair_j_beyond_L", 1),
        ("pair_gap_too_small", 0), ("pair_i_before_prefix_start", 1), ("pair_i_negative", 0))},
}


# The errors belief_state_loss raises in eager mode, where the op's own check is the one that runs
# under torch.compile; the rest are the op's RuntimeError.
OP_ERROR = {"token_negative": IndexError, "token_too_big": IndexError, "weight_inf": ValueError, "weight_past_float32": ValueError,
            "no_pair_inf_scale": ValueError, "lengths_above_L": ValueError, "lengths_negative": ValueError,
            "prefix_start_negative": ValueError,
            **{case: ValueError for case in OP_MATCH if case.startswith("pair_") and "list" not in case}}


@pytest.mark.parametrize("case", list(OP_BAD))
def test_pair_loss_op_bad_input(case):
    with pytest.raises(OP_ERROR.get(case, RuntimeError), match=OP_MATCH[case]):
        torch.ops.bst_fast.pair_loss(*_op_args(**OP_BAD[case]))


def _op_reference(A, Bm, weights, biases, tokens, lengths, prefix_start, min_gap, max_gap, row, i, j,
                  weight, next_weight, activation, need_grad):
    """The op's loss in float64 by hand (docs/contract.md §3-§4), pairs by brute force from docs/contract.md §2 when no list
    is given, and its gradients with respect to A, Bm, the weights and biases by autograd."""
    assert activation == "gelu"
    if row is None:
        pairs = [(r, a, c) for r in range(A.shape[0]) for a in range(A.shape[1]) for c in range(A.shape[1])
                 if a >= int(prefix_start[r]) and min_gap <= c - a <= max_gap and c <= int(lengths[r]) - 1]
        row, i, j = (torch.tensor(x) for x in zip(*pairs))
        w = torch.full((len(pairs),), float(weight), dtype=torch.float64)
    else:
        w = weight.double()
    leaves = [x.detach().double().requires_grad_() for x in (A, Bm, *weights, *biases)]
    A64, B64, W64, c64 = leaves[0], leaves[1], leaves[2:2 + len(weights)], leaves[2 + len(weights):]
    h = torch.nn.functional.gelu(A64[row, i] + B64[row, j])
    for k, (W, c) in enumerate(zip(W64, c64)):
        h = h @ W.T + c
        if k + 1 < len(W64):
            h = torch.nn.functional.gelu(h)
    V = h.shape[1] // 2
    ce = torch.nn.functional.cross_entropy
    per_pair = (next_weight * ce(h[:, :V], tokens[row, i + 1], reduction="none")
                + (1 - next_weight) * ce(h[:, V:], tokens[row, j - 1], reduction="none"))
    loss = (w * per_pair).sum()
    return loss.detach(), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("listed", [False, True], ids=["all_pairs", "pair_list"])
def test_pair_loss_op_good_input_matches_reference(listed):
    """The base arguments of the cases above are valid (each case breaks exactly one thing), and the op
    computes on them the loss and gradients of docs/contract.md §4 (float32 against float64: docs/contract.md §6)."""
    args = _op_args(**(_LIST if listed else {}))
    loss, dA, dB, dW, dc = torch.ops.bst_fast.pair_loss(*args)
    ref_loss, ref_grads = _op_reference(*args)
    assert loss.dtype == torch.float32
    assert abs(float(loss) - float(ref_loss)) < 1e-5 * abs(float(ref_loss))
    for got, want in zip([dA, dB, *dW, *dc], ref_grads):
        assert got.shape == want.shape
        assert (got.double() - want).norm() < 1e-4 * want.norm()


SAMPLE_BAD = {
    "lengths_2d": (torch.tensor([[9, 7]]), torch.tensor([0, 0]), 2, 5, torch.tensor([1, 1])),
    "lengths_int32": (torch.tensor([9, 7], dtype=torch.int32), torch.tensor([0, 0]), 2, 5, torch.tensor([1, 1])),
    "prefix_start_shape": (torch.tensor([9, 7]), torch.tensor([0]), 2, 5, torch.tensor([1, 1])),
    "k_shape": (torch.tensor([9, 7]), torch.tensor([0, 0]), 2, 5, torch.tensor([1])),
    "k_above_count": (torch.tensor([9, 4]), torch.tensor([0, 0]), 2, 5, torch.tensor([1, 4])),
    "k_negative": (torch.tensor([9, 7]), torch.tensor([0, 0]), 2, 5, torch.tensor([1, -1])),
    "lengths_negative": (torch.tensor([9, -7]), torch.tensor([0, 0]), 2, 5, torch.tensor([1, 0])),
    "prefix_start_negative": (torch.tensor([9, 7]), torch.tensor([0, -3]), 2, 5, torch.tensor([1, 0])),
    # min_gap = 1 lists the gap-1 pairs too (docs/contract.md §8); below 1 there is no pair set
    "min_gap_0": (torch.tensor([9, 7]), torch.tensor([0, 0]), 0, 5, torch.tensor([1, 1])),
    "max_gap_below_min_gap": (torch.tensor([9, 7]), torch.tensor([0, 0]), 4, 3, torch.tensor([1, 1])),
    # refused before any prefix of the row is listed (that took 6.5 GB for k = 0)
    "lengths_huge": (torch.tensor([9, 2**62]), torch.tensor([0, 0]), 2, 2**62, torch.tensor([1, 0])),
}
# (error, what it says): the check each case is named after, not an earlier one
SAMPLE_MATCH = {
    "lengths_2d": (RuntimeError, r"lengths must be an int64 CPU vector, got \[1, 2\]"),
    "lengths_int32": (RuntimeError, r"lengths must be an int64 CPU vector, got \[2\] Int"),
    "prefix_start_shape": (RuntimeError, r"prefix_start must be int64 CPU \(2,\), got \[1\]"),
    "k_shape": (RuntimeError, r"k must be int64 CPU \(2,\), got \[1\]"),
    "k_above_count": (ValueError, r"k\[1\] must lie in \[0, \|P_r\| = 3\], got 4"),
    "k_negative": (ValueError, r"k\[1\] must lie in \[0, "),
    "lengths_negative": (ValueError, r"lengths\[1\] must lie in \[0, 2\^31\], got -7"),
    "prefix_start_negative": (ValueError, r"prefix_start\[1\] must be >= 0, got -3"),
    "min_gap_0": (RuntimeError, "min_gap must be >= 1"),
    "max_gap_below_min_gap": (RuntimeError, "max_gap must be >= min_gap"),
    "lengths_huge": (ValueError, r"lengths\[1\] must lie in \[0, 2\^31\]"),
}


@pytest.mark.parametrize("case", list(SAMPLE_BAD))
def test_sample_pairs_op_bad_input(case):
    error, match = SAMPLE_MATCH[case]
    with pytest.raises(error, match=match):
        torch.ops.bst_fast.sample_pairs(*SAMPLE_BAD[case], 0)


# Extreme integers, where an unchecked i + max_gap overflows int64: run in a subprocess, so that a
# crash or a hang fails the test instead of killing the session.
_PRELUDE = """
import torch, bst_fast.backends.cpp_backend
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
A, Bm = torch.randn(2, 9, 5, generator=g), torch.randn(2, 9, 5, generator=g)
W, c = [torch.randn(8, 5, generator=g)], [torch.randn(8, generator=g)]
tok = torch.randint(0, 4, (2, 9), generator=g)
lengths, ps, one = torch.tensor([9, 7]), torch.tensor([0, 1]), torch.tensor(1.0, dtype=torch.float64)
op = torch.ops.bst_fast
def call(min_gap=2, max_gap=5, lengths=lengths, ps=ps, row=None, i=None, j=None, weight=one):
    return op.pair_loss(A, Bm, W, c, tok, lengths, ps, min_gap, max_gap, row, i, j, weight, 0.5, "gelu", True)[0]
reference = call(max_gap=8)  # every pair: no gap above L - 1 = 8 exists
"""
I64_MAX = 2**63 - 1
EXTREME = {
    # The pair (0, 2**63 - 2, -2**63): i + min_gap and i + max_gap wrap around to pass the checks;
    # it must be refused (ValueError, as in eager mode), not read out of bounds.
    "pair_i_near_int64_max": ("out = call(min_gap=2, max_gap=3, row=torch.tensor([0]), i=torch.tensor([2**63 - 2]), "
                              "j=torch.tensor([-2**63]), weight=torch.ones(1, dtype=torch.float64))", True),
    # The rest are valid arguments with a well-defined answer (a huge max_gap is no limit; a huge
    # prefix_start leaves the row no pair): the op must give it, not 0, a hang or a bad_alloc.
    "max_gap_int64_max": (f"out = call(max_gap={I64_MAX}); assert torch.allclose(out, reference), (out, reference)", False),
    # no pair at all: the ValueError belief_state_loss gives in eager mode (under torch.compile only
    # the op checks), not a mean of 0 over nothing
    "min_and_max_gap_huge": (f"import pytest\n            with pytest.raises(ValueError, match='no valid pair'):\n"
                             f"                call(min_gap={I64_MAX - 1}, max_gap={I64_MAX})", False),
    "prefix_start_int64_max": (f"out = call(ps=torch.tensor([{I64_MAX}, 1])); want = call(ps=torch.tensor([9, 1])); "
                               "assert torch.allclose(out, want), (out, want)", False),
    "sample_max_gap_int64_max": (f"out = op.sample_pairs(lengths, ps, 2, {I64_MAX}, torch.tensor([3, 3]), 0); "
                                 "want = op.sample_pairs(lengths, ps, 2, 9, torch.tensor([3, 3]), 0); "
                                 "assert all(torch.equal(x, y) for x, y in zip(out, want)), (out, want)", False),
    "sample_prefix_start_int64_max": (f"out = op.sample_pairs(lengths, torch.tensor([{I64_MAX}, 1]), 2, 5, torch.tensor([0, 3]), 0); "
                                      "want = op.sample_pairs(lengths, torch.tensor([9, 1]), 2, 5, torch.tensor([0, 3]), 0); "
                                      "assert all(torch.equal(x, y) for x, y in zip(out, want)), (out, want)", False),
    # a few pairs of a long row (5e9 pairs): memory for the k chosen, not a byte per pair
    "sample_few_pairs_of_a_long_row": ("out = op.sample_pairs(torch.tensor([100000]), torch.tensor([0]), 2, 100000, "
                                       "torch.tensor([3]), 0)\n"
                                       "            r, i, j = out\n"
                                       "            assert len(i) == 3 and bool((j - i >= 2).all()) and bool((j < 100000).all())\n"
                                       "            assert (i * 100000 + j).unique().numel() == 3 and bool(((i * 100000 + j).diff() > 0).all())",
                                       False),
    # Every k[r] <= |P_r| (2^61 - 2^30 for a row of 2^31 tokens), but the sum of k wraps to 1: the
    # output was one element long and row 5's slice began at a negative offset (a segfault on 2 threads)
    "sample_k_sum_past_int64": ("N = 2**31; n = N * (N - 1) // 2; rest = 2**64 - 5 * n; ks = [rest // 4] * 3 + [rest - 3 * (rest // 4)]\n"
                                "            import pytest\n"
                                "            with pytest.raises(ValueError, match='the sum of k must fit in int64'):\n"
                                "                op.sample_pairs(torch.tensor([N] * 5 + [10] + [N] * 4), torch.zeros(10, dtype=torch.long), 1, "
                                "2**40, torch.tensor([n] * 5 + [1] + ks), 0)", False),
    # The same through the public API, every CPU backend.
    "public_prefix_start_int64_max": (
        "from bst_fast import TextHead, belief_state_loss\n"
        "            head = TextHead(3, 4, hidden=5)\n"
        "            f, b = torch.randn(2, 9, 3, generator=g), torch.randn(2, 9, 3, generator=g)\n"
        "            for be in ('cpp', 'torch', 'reference'):\n"
        f"                out = belief_state_loss(f, b, tok, head, prefix_start=torch.tensor([{I64_MAX}, 1]), backend=be)\n"
        "                want = belief_state_loss(f, b, tok, head, prefix_start=torch.tensor([9, 1]), backend=be)\n"
        "                assert torch.allclose(out, want), (be, out, want)", False),
}


def _limit_memory():
    """3 GiB of address space for the child above what this process maps (a torch built with CUDA
    maps several GiB at import, and failed to import under a flat 3 GiB): a runaway loop fails fast
    instead of eating the machine. Runs in the forked child, whose map is this process's."""
    import resource

    try:
        with open("/proc/self/status") as fh:
            mapped = next(int(line.split()[1]) << 10 for line in fh if line.startswith("VmSize:"))
    except OSError:  # no /proc (macOS): the flat limit
        mapped = 0
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (3 << 30), mapped + (3 << 30)))


@pytest.mark.parametrize("case", list(EXTREME))
def test_ops_extreme_integers_do_not_crash(case):
    """A ValueError for a bad pair, the right answer for valid extremes; never a crash, a hang or
    a silently wrong loss."""
    code, must_raise = EXTREME[case]
    script = _PRELUDE + textwrap.dedent(f"""
        try:
            {code}
        except (RuntimeError, ValueError) as e:
            print(type(e).__name__ + ":", e)
        else:
            print("OK")
    """)
    try:
        # 3 s on an idle 2-core machine; the limit leaves room for a loaded one (a hang never answers)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150,
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: the op hung (no answer in 150 s)")
    out = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"{case}: exit code {proc.returncode}: {proc.stderr[-2000:]}"
    assert out.startswith("ValueError: pairs[0] = ") if must_raise else out == "OK", out


def test_a_fused_backend_refusing_a_head_advises_torch_on_any_device(monkeypatch):
    """The head decides first: 'cpp' would not take a ResidualSwiGLUHead either, so backend='triton'
    on the CPU points to 'torch', not to 'cpp'."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    f = torch.randn(1, 6, 4)
    tokens = torch.randint(0, 5, (1, 6))
    with pytest.raises(ValueError, match="backend='torch' for ResidualSwiGLUHead"):
        belief_state_loss(f, f, tokens, ResidualSwiGLUHead(4, 5), backend="triton")
    with pytest.raises(ValueError, match="use backend='cpp' on the CPU"):
        belief_state_loss(f, f, tokens, make_head(4, 5, hidden=4), backend="triton")


@pytest.mark.parametrize("backend", ["auto", "reference", "torch", "cpp", "triton"])
def test_the_meta_device_is_refused_where_the_loss_reads_values(backend, monkeypatch):
    """All pairs on meta tensors: the ids and lengths must be read (a GPU stand-in takes only host
    pair sets, tests/test_host_pairs.py). It was torch's 'Cannot copy out of meta tensor', and cpp
    advised backend='triton', which fails the same way."""
    f, tokens = torch.empty(2, 6, 3, device="meta"), torch.zeros(2, 6, dtype=torch.long, device="meta")
    head = make_head(3, 7, hidden=4).to("meta")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # triton's advice: none that fails alike ('cpp' did)
    want = {"cpp": "backend='cpp' runs on the CPU, got meta tensors$",
            "triton": r"backend='triton' runs on a CUDA device \(or on the CPU under TRITON_INTERPRET=1\), got meta tensors$"
            }.get(backend, "inputs are on the meta device")
    with pytest.raises(ValueError, match=want):
        belief_state_loss(f, f, tokens, head, backend=backend)


def test_lengths_are_checked_before_sampling(monkeypatch):
    """Under torch.compile belief_state_loss skips its own checks (the op repeats them), but with
    sampled pairs the sampler runs first and its work grows with the lengths: then they are checked."""
    from bst_fast import _pairs

    f, b, tokens, head = make_inputs(B=2, L=10, m=4, V=5, seed=3)
    kw = dict(lengths=torch.tensor([10, 2**62]), prefix_start=0, min_gap=2, max_gap=None, next_weight=0.5,
              reduction="mean", generator=None, op_checks=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _pairs.prepare(f, b, tokens, 5, pairs=None, **kw)  # skipped: the op checks all pairs itself
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, L=10\], got lengths\[1\]"):
        _pairs.prepare(f, b, tokens, 5, pairs=3, **kw)


def test_compiled_loss_raises_the_eager_errors():
    """Under torch.compile the cpp op's own checks run instead of prepare's: the same error class
    and the same cause (a batch with no pair used to be blamed on an inf weight)."""
    f, b, tokens, head = make_inputs(B=2, L=6, m=4, V=5, seed=1)
    loss = torch.compile(lambda lengths, tokens: belief_state_loss(f, b, tokens, head, lengths=lengths, backend="cpp"),
                         fullgraph=True)
    with pytest.raises(ValueError, match="no valid pair at all"):
        loss(torch.tensor([1, 1]), tokens)
    with pytest.raises(IndexError, match=r"tokens must lie in \[0, vocab_size=5\).*tokens\[0, 0\] = 9"):
        loss(torch.tensor([6, 6]), torch.full_like(tokens, 9))
    # the op's checks of lengths, prefix_start and listed pairs raise ValueError too (RuntimeError before)
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, L=6\], got lengths\[1\] = 9"):
        loss(torch.tensor([6, 9]), tokens)
    start = torch.compile(lambda s: belief_state_loss(f, b, tokens, head, prefix_start=s, backend="cpp"), fullgraph=True)
    with pytest.raises(ValueError, match=r"prefix_start must be >= 0, got prefix_start\[0\] = -1"):
        start(torch.tensor([-1, 0]))
    listed = torch.compile(lambda i: belief_state_loss(f, b, tokens, head, pairs=(torch.tensor([0, 1]), i, torch.tensor([3, 2])),
                                                       backend="cpp"), fullgraph=True)
    with pytest.raises(ValueError, match=r"pairs\[1\] = \(row=1, i=1, j=2\) is not a valid pair"):
        listed(torch.tensor([0, 1]))


def test_the_raw_op_differentiates_and_compiles_after_import_bst_fast_alone():
    """`import bst_fast` loads the C++ op, and with it its autograd and fake rules: before, they came
    with the cpp backend's module, so a raw call's backward left A.grad None (only a warning) and
    FakeTensorMode had no kernel until a cpp loss had run (run in a fresh process: this one has)."""
    code = """if 1:
        import torch, bst_fast
        from torch._subclasses.fake_tensor import FakeTensorMode
        g = torch.Generator().manual_seed(0)
        A = torch.randn(2, 6, 4, generator=g, requires_grad=True)
        args = [torch.randn(2, 6, 4, generator=g), [torch.randn(6, 4, generator=g)], [torch.randn(6, generator=g)],
                torch.randint(0, 3, (2, 6), generator=g), torch.tensor([6, 6]), torch.tensor([0, 0]), 2, 6,
                None, None, None, torch.tensor(0.1, dtype=torch.float64), 0.5, "gelu", True]
        torch.ops.bst_fast.pair_loss(A, *args)[0].backward()
        assert A.grad is not None and A.grad.abs().sum() > 0
        with FakeTensorMode() as mode:
            out = torch.ops.bst_fast.pair_loss(mode.from_tensor(A), *[mode.from_tensor(x) if torch.is_tensor(x) else
                                                                     [mode.from_tensor(y) for y in x] if isinstance(x, list) else x
                                                                     for x in args])
        assert out[0].shape == () and out[1].shape == A.shape
        print("ok")
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_op_arguments_on_another_device_and_bad_weights_are_refused():
    """One meta tensor among CPU ones dispatches to the shape-only kernel, whose outputs would be
    uninitialised memory returned as a loss; a NaN or negative pair weight would make any loss."""
    import bst_fast.backends.cpp_backend  # noqa: F401

    g = torch.Generator().manual_seed(0)
    A, Bm = torch.randn(2, 9, 5, generator=g), torch.randn(2, 9, 5, generator=g)
    W, c = [torch.randn(8, 5, generator=g)], [torch.randn(8, generator=g)]
    tok, lengths, ps = torch.randint(0, 4, (2, 9), generator=g), torch.tensor([9, 7]), torch.tensor([0, 1])

    def call(tok=tok, weight=torch.tensor(1.0, dtype=torch.float64), listed=False):
        pairs = (torch.tensor([0]), torch.tensor([1]), torch.tensor([4])) if listed else (None, None, None)
        return torch.ops.bst_fast.pair_loss(A, Bm, W, c, tok, lengths, ps, 2, 8, *pairs, weight, 0.5, "gelu", True)

    with pytest.raises(ValueError, match="A's device"):
        call(tok=tok.to("meta"))
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match=r"weight\[0\] must be finite, >= 0 and at most"):
            call(weight=torch.tensor([bad], dtype=torch.float64), listed=True)
    with pytest.raises(ValueError, match=r"weight\[0\] must be finite, >= 0 and at most"):
        call(weight=torch.tensor(float("nan"), dtype=torch.float64))


def test_a_huge_count_per_row_is_every_pair():
    """pairs=k takes min(k, |P_r|) pairs of row r: any k above the count is all of them, even past int64."""
    f, b, tokens, head = make_inputs(B=2, L=8, m=4, V=5, seed=3)
    want = belief_state_loss(f, b, tokens, head, backend="torch", pairs=10**6)
    got = belief_state_loss(f, b, tokens, head, backend="torch", pairs=2**70)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the models' own arguments

def _models():
    from bst_fast.model import BeliefStateTransformer, ForwardOnly, ModelConfig, Teacherless

    cfg = ModelConfig(vocab_size=13, max_len=16, n_layer=1, d_model=8, n_head=2, head_hidden=8)
    return [BeliefStateTransformer(cfg), ForwardOnly(cfg), Teacherless(cfg)]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=torch.zeros(9, dtype=torch.long)), "tokens must be a .B, L. tensor"),
    (dict(tokens=torch.zeros(2, 9)), "tokens must be an integer tensor"),
    (dict(lengths=torch.tensor([12, 9])), r"lengths must lie in \[0, L=9\]"),
    (dict(lengths=torch.tensor([9.0, 9.0])), "lengths must be an int or a"),
    (dict(lengths=torch.tensor([9])), r"lengths must have shape \(2,\)"),
    (dict(tokens=torch.full((2, 9), 13)), r"tokens must lie in \[0, vocab_size=13\)"),
])
def test_model_forward_checks_the_batch_before_the_encoders(kwargs, match):
    for model in _models():
        args = dict(tokens=torch.ones(2, 9, dtype=torch.long), lengths=None) | kwargs
        # an id outside the vocabulary is an IndexError, as belief_state_loss raises it
        with pytest.raises(IndexError if "vocab_size" in match else ValueError, match=match):
            model(args["tokens"], args["lengths"])


def test_model_forward_takes_an_int_length_and_refuses_a_silent_gamma():
    bst, fwd, _ = _models()
    tokens = torch.randint(0, 13, (2, 9))
    torch.testing.assert_close(bst(tokens, 9)["total"], bst(tokens)["total"])
    with pytest.raises(ValueError, match="gamma > 0 .* has none"):
        bst(tokens, gamma=0.5)  # no GPT head: the weight used to be ignored
    with pytest.raises(ValueError, match=r"gamma must be a number in \[0, 1\]"):
        bst(tokens, gamma=1.5)
    gpt = type(bst)(bst.cfg.__class__(**{**vars(bst.cfg), "gpt_head": True}))
    # a numpy scalar (a config read through numpy) is taken, as belief_state_loss takes its options
    torch.testing.assert_close(gpt(tokens, gamma=np.float32(0.25))["total"], gpt(tokens, gamma=0.25)["total"])
    with pytest.raises(ValueError, match="no next-token position"):
        fwd(tokens, prefix_start=20)  # was 0/0 = nan


def test_model_config_types_are_checked_by_name():
    from bst_fast.model import ModelConfig

    for field, value, want in (("n_layer", 1.5, "an int"), ("d_model", "8", "an int"),
                               ("gpt_head", 1, "true or false"), ("mlp_ratio", True, "a number"),
                               # a float width was "TypeError: 'float' object is not iterable"
                               ("head_hidden", 16.0, "a positive int or a list"), ("head_hidden", "16", "a positive int"),
                               ("head_hidden", True, "a positive int")):
        with pytest.raises(ValueError, match=f"'model.{field}' must be {want}"):
            ModelConfig(**{field: value}).check()


def test_teacherless_generate_checks_its_count():
    _, _, teacherless = _models()
    with pytest.raises(ValueError, match="n_new"):
        teacherless.generate(torch.ones(1, 3, dtype=torch.long), -2)
    assert teacherless.generate(torch.ones(1, 3, dtype=torch.long), 0).shape == (1, 0)
    from bst_fast import decode
    with pytest.raises(ValueError, match="Teacherless"):
        decode.sample(teacherless, [1, 2], 2)


def test_models_take_every_id_dtype_the_loss_takes():
    """int8, int16, int32 and uint8 token ids (the dtypes full_lengths accepts) give the int64 ids'
    losses: the embedding and the GPT head's cross-entropy read int64 (int32 raised in the
    cross-entropy, the rest in the embedding)."""
    bst, forward, teacherless = _models()
    tokens = torch.randint(3, 13, (2, 9), generator=torch.Generator().manual_seed(0))
    bst_gpt = type(bst)(type(bst.cfg)(**{**vars(bst.cfg), "gpt_head": True}))
    for model, kw in ((bst, {}), (bst_gpt, dict(gamma=0.5)), (forward, {}), (teacherless, dict(prefix_start=3))):
        ids = tokens.clamp(max=teacherless.dummy_id - 1) if model is teacherless else tokens  # the data's ids
        want = model(ids, **kw)["total"]
        for dt in (torch.int8, torch.int16, torch.int32, torch.uint8):
            assert torch.equal(model(ids.to(dt), **kw)["total"], want), (type(model).__name__, dt)
    # the encoder casts integer ids only: a float or bool id is not truncated into a token (prefix_states
    # checks its tokens as forward does; the encoder alone leaves them to the embedding to refuse)
    for dt in (torch.float32, torch.bool):
        with pytest.raises(ValueError, match=f"tokens must be an integer tensor .*got {dt}"):
            bst.prefix_states(tokens.to(dt))
        with pytest.raises(RuntimeError, match="indices"):
            bst.forward_encoder(tokens.to(dt))


def test_numpy_bools_are_taken_as_the_bools_they_hold():
    """deterministic=np.bool_(True) was refused ('got np.True_') while the numeric options take numpy scalars."""
    f, b, tokens, head = make_inputs(B=2, L=7, m=4, V=5, seed=1)
    assert torch.equal(belief_state_loss(f, b, tokens, head, deterministic=np.bool_(True)),
                       belief_state_loss(f, b, tokens, head, deterministic=True))
