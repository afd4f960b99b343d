"""Listed pair sets resolved on the host (prepare's host_pairs, the triton backend's): a subsample is
drawn, checked and listed without reading the device, so the GPU never waits on the host for it.

The meta device stands in for a GPU here: any read of a meta tensor's values raises, so a pass on
meta inputs shows that nothing before the op's kernels reads the device."""
import pytest
import torch

from bst_fast import TextHead, belief_state_loss
from bst_fast import _pairs
from bst_fast.backends import pair_loss_op, runtime

META = torch.device("meta")
# what reading a meta tensor's values raises (.item(), .tolist(), bool(), a copy to the CPU), or
# prepare's own refusal where it would read them (its checks' one sync)
READ_ERRORS = (RuntimeError, NotImplementedError, ValueError)
READ = r"meta tensor|meta device|Cannot copy out of meta|item\(\) cannot be called|not implemented for 'Meta'|data-dependent"


def _prepare(f, tokens, lengths, pairs, **kw):
    opts = dict(lengths=lengths, prefix_start=0, min_gap=2, max_gap=None, pairs=pairs, next_weight=0.5,
                reduction="mean", generator=torch.Generator().manual_seed(3), op_checks=True, host_pairs=True)
    opts.update(kw)
    return _pairs.prepare(f, f, tokens, 50, **opts)


@pytest.mark.parametrize("pairs", [0.05, 7, "explicit"])
@pytest.mark.parametrize("lengths", [None, "tensor", 30])
def test_prepare_and_pair_list_read_no_device(pairs, lengths):
    pytest.importorskip("bst_fast._C")  # the C++ sampler
    B, L = 5, 37
    if lengths == "tensor":
        lengths = torch.tensor([37, 30, 12, 3, 25])
    if pairs == "explicit":
        row = torch.tensor([3, 0, 0, 4, 1, 0])  # unsorted, one repeated
        i = torch.tensor([0, 5, 1, 2, 0, 5])
        pairs = (row, i, i + torch.tensor([2, 3, 9, 20, 2, 3]))
    f, tokens = torch.empty(B, L, 8, device=META), torch.empty(B, L, dtype=torch.long, device=META)
    p = _prepare(f, tokens, lengths, pairs)
    assert p.host and p.row.device.type == "cpu" and p.lengths.device.type == "cpu" and p.weight.device.type == "cpu"
    pl = _pairs.pair_list(p, B, L, 11, device=META)  # uploads to "the GPU" and sorts there, reads nothing back
    assert pl.ia.device == META and pl.perm.device == META
    # the same list as one built and kept on the host, where its values can be compared
    ref = _pairs.pair_list(p, B, L, 11)
    assert pl.chunks == ref.chunks and pl.wscale == ref.wscale and pl.search_steps == ref.search_steps
    key = ref.ia.long() * B * L + ref.ib.long()
    assert bool((key[1:] >= key[:-1]).all())  # sorted by (ia, ib), the explicit list's order undone
    suffix_key = (ref.ib.long() * B * L + ref.ia.long())[ref.perm.long()]
    assert bool((suffix_key[1:] >= suffix_key[:-1]).all())
    # the sampled set is the one a device-side resolution draws (the same seed, the same sampler)
    if not isinstance(pairs, tuple):
        q = _prepare(torch.empty(B, L, 8), torch.zeros(B, L, dtype=torch.long), lengths, pairs, host_pairs=False)
        assert not q.host
        assert torch.equal(q.row, p.row) and torch.equal(q.i, p.i) and torch.equal(q.j, p.j)
        assert torch.equal(q.weight, p.weight)


def test_host_resolution_only_where_the_host_knows_the_set(monkeypatch):
    """Device lengths or prefix_start, documents, the device sampler, a device generator or all pairs
    keep the pair set on the device (there the tokens are checked at once); host_pairs=False never
    resolves on the host. A device tensor is never brought to the host to resolve it there."""
    pytest.importorskip("bst_fast._C")
    real = _pairs.to_device

    def to_device(t, device):
        assert not (t.device == META and torch.device(device).type == "cpu"), "a device tensor brought to the host"
        return real(t, device)

    monkeypatch.setattr(_pairs, "to_device", to_device)
    B, L = 3, 12
    f, tokens = torch.empty(B, L, 4, device=META), torch.empty(B, L, dtype=torch.long, device=META)
    for kw in (dict(lengths=torch.full((B,), L, device=META)), dict(prefix_start=torch.zeros(B, dtype=torch.long, device=META)),
               dict(pairs=None), dict(host_pairs=False)):
        opts = dict(dict(lengths=None, pairs=0.5), **kw)
        with pytest.raises(READ_ERRORS, match=READ):  # a device read: not on the host
            _prepare(f, tokens, opts.pop("lengths"), opts.pop("pairs"), **opts)
    cpu = torch.zeros(B, L, 4)
    docs = torch.zeros(B, L, dtype=torch.long)
    assert not _prepare(cpu, docs, None, 0.5, documents=docs).host
    assert not _prepare(cpu, docs, None, 0.5, device_sampler=True).host
    class DeviceGenerator(torch.Generator):  # a generator on "a GPU": the draw's seed is read there
        device = torch.device("meta")

    with pytest.raises(RuntimeError, match=READ):  # not resolved on the host: the seed is read on "the GPU"
        _prepare(cpu, docs, None, 0.5, generator=DeviceGenerator())
    assert _prepare(cpu, docs, None, 0.5).host


def test_loss_before_the_op_reads_no_device(monkeypatch):
    """belief_state_loss on meta tensors with host lengths reaches the triton op (its fake kernel on
    meta) without a device read: the checks, the draw and the head's first layer."""
    pytest.importorskip("bst_fast._C")
    pytest.importorskip("triton")
    real = torch.autocast  # which has no meta device: its guards run as the CPU's
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **k: real("cpu" if device_type == "meta" else device_type,
                                                                             *a, **k))
    B, L, m, V = 4, 21, 6, 30
    head = TextHead(m, V, hidden=10, n_layers=2).to(META)
    f = torch.empty(B, L, m, device=META, requires_grad=True)
    b = torch.empty(B, L, m, device=META, requires_grad=True)
    tokens = torch.empty(B, L, dtype=torch.long, device=META)
    loss = belief_state_loss(f, b, tokens, head, lengths=torch.tensor([21, 20, 9, 15]), pairs=0.2, backend="triton",
                             generator=torch.Generator().manual_seed(0))
    assert loss.device == META and loss.shape == ()
    loss.backward()
    assert f.grad.device == META and f.grad.shape == f.shape
    with runtime.switched(host_pairs=False):  # BST_FAST_DEVICE_PAIR_LIST=1: listed on "the GPU", which it reads
        with pytest.raises(READ_ERRORS, match=READ):
            belief_state_loss(f, b, tokens, head, lengths=torch.tensor([21, 20, 9, 15]), pairs=0.2, backend="triton",
                              generator=torch.Generator().manual_seed(0))


def test_op_body_reads_no_device_before_its_kernels(monkeypatch):
    """The triton op's own body with a host pair set and meta "GPU" tensors: its checks, the token
    mask and the pair list read nothing; the kernels (stubbed: they cannot run on meta) get a list on
    the device, and the one read left is the token flag's, after them (raise_on_bad_tokens). With
    host_pairs off in its prepare (the tokens checked at once) it would read the device first."""
    pytest.importorskip("triton")
    from bst_fast.backends import triton_backend
    events = []

    def chunks(f, b, lengths, tokens, pl, weights, biases, *args):
        events.append(("kernels", pl.ia.device, pl.perm.device, lengths.device))
        zeros = lambda t: torch.zeros_like(t)
        return f.new_zeros(()), zeros(f), zeros(b), [zeros(w) for w in weights], [zeros(c) for c in biases]

    monkeypatch.setattr(triton_backend, "_loss_by_chunks", chunks)
    monkeypatch.setattr(_pairs, "raise_on_bad_tokens", lambda tokens, bad, V: events.append(("flag", bad.device)))
    B, L, m, h1, V = 3, 12, 5, 8, 20
    A, Bm = torch.empty(B, L, m, device=META), torch.empty(B, L, m, device=META)  # f, b: the op takes the whole head
    W = [torch.empty(h1, 2 * m, device=META), torch.empty(2 * V, h1, device=META)]
    c = [torch.empty(h1, device=META), torch.empty(2 * V, device=META)]
    tokens = torch.empty(B, L, dtype=torch.long, device=META)
    row, i, j = torch.tensor([2, 0, 1, 0]), torch.tensor([0, 3, 1, 3]), torch.tensor([4, 9, 8, 9])
    out = triton_backend.triton_pair_loss._init_fn(A, Bm, W, c, tokens, torch.tensor([12, 9, 5]), torch.zeros(B, dtype=torch.long),
                                                   2, L, row, i, j, torch.full((4,), 0.25, dtype=torch.float64), 0.5,
                                                   "relu", True)
    assert events == [("kernels", META, META, META), ("flag", META)] and out[1].device == META


def test_op_device_rule():
    """A listed pair set may lie on the CPU whole; a pair set split across devices is refused, naming the rule."""
    A = torch.empty(2, 9, 4, device=META)
    W, c = [torch.empty(10, 4, device=META)], [torch.empty(10, device=META)]
    tokens = torch.empty(2, 9, dtype=torch.long, device=META)
    host = dict(lengths=torch.tensor([9, 9]), prefix_start=torch.zeros(2, dtype=torch.long), row=torch.tensor([0]),
                i=torch.tensor([1]), j=torch.tensor([4]), weight=torch.ones(1, dtype=torch.float64))
    pair_loss_op.check_devices(A, A, W, c, tokens, **host)
    out = pair_loss_op.fake(A, A, W, c, tokens, host["lengths"], host["prefix_start"], 2, 9, host["row"], host["i"],
                            host["j"], host["weight"], 0.5, "relu", True)
    assert out[1].device == META and out[1].shape == A.shape
    for key in ("lengths", "weight", "row"):
        split = dict(host, **{key: host[key].to(META)})
        with pytest.raises(ValueError, match="or a listed pair set's .* all on the CPU"):
            pair_loss_op.check_devices(A, A, W, c, tokens, **split)
    with pytest.raises(ValueError, match="must be on A's device"):  # all pairs: no host pair list
        pair_loss_op.check_devices(A, A, W, c, tokens, host["lengths"], host["prefix_start"], None, None, None,
                                   torch.ones((), dtype=torch.float64))


def _inputs(B, L, V, m=5):
    """f, b, tokens and a two-layer TextHead of hidden 8, from seed 0."""
    g = torch.Generator().manual_seed(0)
    head = TextHead(m, V, hidden=8, n_layers=2)
    f, b = torch.randn(B, L, m, generator=g), torch.randn(B, L, m, generator=g)
    return f, b, torch.randint(0, V, (B, L), generator=g), head


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused_ce"])
@pytest.mark.parametrize("bad", [40, 10**9, -1, -10**9])
@pytest.mark.parametrize("pairs", [0.5, "explicit"])
def test_op_checks_the_tokens_after_its_kernels(bad, pairs, fused):
    """The triton op checks a host pair set's tokens on the device once its chunks are queued: a
    label outside [0, V) is read by no kernel (V = 40 > 32 takes the cross-entropy's two-pass blocks
    in the interpreter, as every GPU shape does, whose label load is masked: unmasked, 10**9 crashed
    the interpreter; the fused kernel only compares), and the error names the token as before."""
    pytest.importorskip("bst_fast._C")
    pytest.importorskip("triton")
    B, L, V = 2, 11, 40
    f, b, tokens, head = _inputs(B, L, V)
    tokens[1, 4] = bad
    if pairs == "explicit":
        pairs = (torch.tensor([1, 0]), torch.tensor([3, 0]), torch.tensor([6, 9]))  # (1, 3, 6) reads tokens[1, 4]
    with runtime.switched(fused_ce=fused), pytest.raises(IndexError, match=rf"tokens\[1, 4\] = {bad}"):
        belief_state_loss(f, b, tokens, head, lengths=torch.tensor([L, L]), pairs=pairs, backend="triton",
                          generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("pairs", [0.5, "empty"])
def test_a_sum_over_no_pair_still_checks_a_host_sets_tokens(pairs):
    """A sum over no pair returns 0 before the triton op runs, so the tokens the op would have
    checked (a host pair set's) are checked then: cpp raises for them, and so must triton."""
    pytest.importorskip("bst_fast._C")
    V = 7
    f, b, tokens, head = _inputs(2, 9, V)
    tokens[1, 1] = V  # inside row 1's two valid positions
    if pairs == "empty":
        pairs = tuple(torch.zeros(0, dtype=torch.int64) for _ in range(3))
    for backend in ("cpp", "triton"):
        with pytest.raises(IndexError, match=rf"tokens\[1, 1\] = {V}"):
            belief_state_loss(f, b, tokens, head, lengths=torch.tensor([2, 2]), pairs=pairs, reduction="sum",
                              backend=backend, generator=torch.Generator().manual_seed(1))
    tokens[1, 1] = 0
    assert float(belief_state_loss(f, b, tokens, head, lengths=torch.tensor([2, 2]), pairs=pairs, reduction="sum",
                                   backend="triton", generator=torch.Generator().manual_seed(1))) == 0.0


def test_to_device():
    t = torch.arange(5)
    assert _pairs.to_device(t, "cpu") is t
    assert _pairs.to_device(t, META).device == META
    assert _pairs.host_known(None) and _pairs.host_known(7) and _pairs.host_known(t)
    assert not _pairs.host_known(t.to(META))
