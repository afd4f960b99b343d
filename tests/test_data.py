"""Tests of bst_fast.data: star-graph format, generator, splits, path accuracy, BPE text batches."""
from collections import Counter

import numpy as np
import pytest
import torch

from bst_fast.data import (StarGraphData, StarGraphStream, StarGraphTokenizer, TextData,
                           generate_star_graphs, graph_keys, load_tokenizer, path_accuracy,
                           save_tokenizer, train_bpe)
from bst_fast.data.text import iter_documents


# ---------------------------------------------------------------------------- star graph format

def test_format_round_trip():
    tok = StarGraphTokenizer(10)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.edge_sep_id, tok.query_id, tok.answer_id,
            tok.vocab_size) == (10, 11, 12, 13, 14, 15, 16)
    edges, s, g, path = [(3, 7), (0, 3), (0, 5), (5, 9)], 0, 9, [0, 5, 9]
    ids = tok.encode_row(edges, s, g, path)
    assert tok.decode(ids) == "<bos> 3 7 | 0 3 | 0 5 | 5 9 / 0 9 = 0 5 9 <eos>"
    assert tok.decode(ids, skip_special=True) == "3 7 | 0 3 | 0 5 | 5 9 / 0 9 = 0 5 9"
    assert tok.decode(ids + [tok.pad_id, 4]) == tok.decode(ids)  # stops at PAD
    parsed = tok.parse(torch.tensor(ids + [tok.pad_id] * 3))
    assert (parsed.edges, parsed.start, parsed.goal, parsed.path) == (edges, s, g, path)
    # a partial row (prefix up to "=" plus some generated nodes) parses too
    assert tok.parse(ids[:-2]).path == [0, 5]
    with pytest.raises(ValueError, match="outside"):
        tok.encode_row([(3, 10)], 3, 10, [3, 10])


@pytest.mark.parametrize("d,l,n", [(2, 5, 50), (5, 5, 50), (2, 20, 50), (3, 2, 6)])
def test_layout_matches_rows(d, l, n):
    data = StarGraphData(d, l, n, n_train=64, n_test=16, seed=0)
    e = d * (l - 1)
    assert data.row_length == 1 + (3 * e - 1) + 4 + l + 1
    tok = data.tokenizer
    assert data.train_tokens.dtype == torch.uint8 and data.test_tokens.dtype == torch.int64  # < 256 ids
    for rows in (data.train_tokens, data.test_tokens):
        assert rows.shape[1] == data.row_length
        assert (rows[:, data.prefix_start] == tok.answer_id).all()
        assert (rows[:, data.prefix_start - 3] == tok.query_id).all()
        assert (rows[:, -1] == tok.eos_id).all()
        assert data.answer_slice.stop == data.row_length - 1 and data.path_len == l
        # vectorised encoding agrees with encode_row
        for r in rows[:5]:
            assert tok.encode_row(*tok.parse(r)) == r.tolist()


@pytest.mark.parametrize("d,l,n", [(2, 5, 50), (5, 5, 21), (2, 20, 50), (1, 3, 3), (2, 5, 5000), (5, 20, 300)])
def test_generator_validity(d, l, n):
    tok = StarGraphTokenizer(n)
    rows = generate_star_graphs(300, d, l, n, seed=1)
    for r in rows:
        gph = tok.parse(r)
        assert len(gph.edges) == d * (l - 1)
        children = {}
        for u, v in gph.edges:
            children.setdefault(u, []).append(v)
        nodes = {u for e in gph.edges for u in e}
        assert len(nodes) == 1 + d * (l - 1)                # distinct labels
        assert len(children[gph.start]) == d                # d arms leave s
        assert all(len(c) == 1 for u, c in children.items() if u != gph.start)
        for first in children[gph.start]:                   # every arm has l nodes, s included
            arm = [gph.start, first]
            while arm[-1] in children:
                arm.append(children[arm[-1]][0])
            assert len(arm) == l
        assert gph.goal not in children                     # the goal is a leaf
        assert len(gph.path) == l and gph.path[0] == gph.start and gph.path[-1] == gph.goal
        assert all((a, b) in set(gph.edges) for a, b in zip(gph.path, gph.path[1:]))


def test_generator_is_random_enough():
    d, l, n = 2, 5, 50
    rows = generate_star_graphs(4000, d, l, n, seed=2)
    assert set(np.unique(rows[:, 1:3 * d * (l - 1):3])) == set(range(n))  # all labels used
    e3 = 3 * d * (l - 1)
    # edges are shuffled: the first edge leaves s in about d / E of the rows
    frac = (rows[:, 1] == rows[:, e3 + 1]).mean()
    assert abs(frac - d / (d * (l - 1))) < 0.04


def test_many_labels_are_drawn_uniformly_at_a_cost_of_k_a_row():
    """Above 256 labels (and 2k), a row's labels are drawn one by one by rejection: shuffling all
    N labels a row took 4.9 s and 877 MB for 4,000 rows at N = 20,000. Each label position is
    uniform over the N labels, pairs of positions distinct; at the paper's N the draws are still
    the row-wise shuffle's (the same graphs for every seed as before)."""
    from bst_fast.data.star import _distinct_labels

    n, k, N = 20_000, 5, 1000
    labels = _distinct_labels(n, k, N, np.random.default_rng(3))
    assert labels.min() >= 0 and labels.max() < N
    assert (np.sort(labels, axis=1)[:, 1:] != np.sort(labels, axis=1)[:, :-1]).all()
    for c in range(k):  # 10 bins of 2,000 expected each (sd about 42)
        counts = np.bincount(labels[:, c] * 10 // N, minlength=10)
        assert np.abs(counts - n / 10).max() < 200, (c, counts)
    # the second label is uniform among the labels the first did not take: P(l1 > l0) = 1/2
    assert abs((labels[:, 1] > labels[:, 0]).mean() - 0.5) < 0.02
    rng, again = np.random.default_rng(4), np.random.default_rng(4)
    assert np.array_equal(_distinct_labels(7, 9, 50, rng),
                          again.permuted(np.broadcast_to(np.arange(50), (7, 50)), axis=1)[:, :9])


def test_too_few_nodes():
    with pytest.raises(ValueError, match="n_nodes must be >= 1 \\+ d\\*\\(l-1\\) = 9"):
        generate_star_graphs(1, 2, 5, 8, seed=0)
    with pytest.raises(ValueError, match="n_nodes"):
        StarGraphData(5, 5, 20, 10, 10)


def test_determinism():
    a, b = generate_star_graphs(50, 2, 5, 50, 7), generate_star_graphs(50, 2, 5, 50, 7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, generate_star_graphs(50, 2, 5, 50, 8))
    d1, d2 = StarGraphData(2, 5, 50, 100, 20, seed=3), StarGraphData(2, 5, 50, 100, 20, seed=3)
    assert torch.equal(d1.train_tokens, d2.train_tokens) and torch.equal(d1.test_tokens, d2.test_tokens)
    # batch(step) is pure: same rows out of order and from a fresh object; an epoch covers all rows
    b5 = d1.batch(5, 16, seed=1)
    d1.batch(0, 16, seed=1)
    assert torch.equal(b5, d2.batch(5, 16, seed=1))
    assert not torch.equal(b5, d1.batch(5, 16, seed=2))
    per_epoch = 100 // 16
    epoch = torch.cat([d1.batch(k, 16, seed=1) for k in range(per_epoch)])
    assert len({tuple(r) for r in epoch.tolist()}) == len(epoch)
    assert not torch.equal(d1.batch(0, 16, 1), d1.batch(per_epoch, 16, 1))  # a new permutation
    s1, s2 = StarGraphStream(2, 5, 50, seed=4), StarGraphStream(2, 5, 50, seed=4)
    assert torch.equal(s1.batch(9, 32), s2.batch(9, 32))
    assert not torch.equal(s1.batch(9, 32), s1.batch(10, 32))
    assert torch.equal(next(s1.batches(32, start_step=9)), s1.batch(9, 32))
    it = d1.batches(16, seed=1, start_step=4)
    assert torch.equal(next(it), d1.batch(4, 16, 1)) and torch.equal(next(it), b5)


def _canon(tok, row):
    """The graph of a row: its edge set (the query is not part of it)."""
    return frozenset(tok.parse(row).edges)


def test_no_train_test_overlap():
    # G(2, 3) over 5 nodes has only 5 * 4!/2 = 60 graphs (120 graph+query rows): collisions are
    # certain, also of a test graph asked with its other goal, which training must not see either.
    data = StarGraphData(2, 3, 5, n_train=600, n_test=40, seed=0)
    tok = data.tokenizer
    test = {_canon(tok, r) for r in data.test_tokens}
    assert len(test) == 40                                   # test graphs are distinct
    assert not test & {_canon(tok, r) for r in data.train_tokens}
    assert len(data.train_tokens) == 600
    assert len({_canon(tok, r) for r in data.train_tokens}) == 20  # every other graph is trained on
    stream = StarGraphStream(2, 3, 5, seed=0, exclude=data)
    assert not test & {_canon(tok, r) for r in stream.batch(0, 500)}
    keyed = StarGraphStream(2, 3, 5, seed=0, exclude=data.test_tokens)
    assert torch.equal(keyed.batch(3, 64), stream.batch(3, 64))
    # the same graph with its edges listed in another order has the same key
    r = data.test_tokens[:1].numpy().copy()
    r[0, [1, 2, 4, 5]] = r[0, [4, 5, 1, 2]]
    assert graph_keys(r, 2, 3)[0] == graph_keys(data.test_tokens[:1], 2, 3)[0]
    # a query (start, goal) swapped for the other goal keeps the key: the key is the graph's
    other = data.test_tokens[:1].numpy().copy()
    g = tok.parse(other[0])
    other_goal = next(v for u, v in g.edges if v != g.goal and all(u2 != v for u2, _ in g.edges))
    other[0, data.prefix_start - 1] = other_goal
    assert graph_keys(other, 2, 3)[0] == graph_keys(data.test_tokens[:1], 2, 3)[0]
    with pytest.raises(ValueError, match="n_test=200"):
        StarGraphData(2, 3, 5, n_train=1, n_test=200)
    with pytest.raises(ValueError, match=r"tokens must be \(n, 20\) rows of G\(2, 3\)"):
        graph_keys(StarGraphData(2, 5, 9, n_train=0, n_test=2).test_tokens, 2, 3)
    with pytest.raises(ValueError, match="exclude holds G"):
        StarGraphStream(2, 3, 6, exclude=data)


def test_blockwise_draws(monkeypatch):
    """Rows are drawn in blocks of _BLOCK: the split's guarantees hold across block edges (blocks
    of 7 rows), and building a set needs little more than the set itself."""
    import tracemalloc
    from bst_fast.data import star
    monkeypatch.setattr(star, "_BLOCK", 7)
    data = StarGraphData(2, 3, 5, n_train=600, n_test=40, seed=0)
    tok = data.tokenizer
    test = {_canon(tok, r) for r in data.test_tokens}
    assert len(test) == 40 and len(data.test_tokens) == 40      # distinct across blocks
    train = {_canon(tok, r) for r in data.train_tokens}
    assert len(data.train_tokens) == 600 and not test & train and len(train) == 20
    again = StarGraphData(2, 3, 5, n_train=600, n_test=40, seed=0)
    assert torch.equal(again.train_tokens, data.train_tokens)
    assert torch.equal(StarGraphStream(2, 3, 5, seed=1, exclude=data).batch(2, 50),
                       StarGraphStream(2, 3, 5, seed=1, exclude=data).batch(2, 50))
    monkeypatch.setattr(star, "_BLOCK", 1 << 12)
    tracemalloc.start()
    try:
        big = StarGraphData(2, 5, 50, n_train=100_000, n_test=10, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    final = big.train_tokens.numel() * big.train_tokens.element_size()
    assert big.train_tokens.dtype == torch.uint8 and big.batch(0, 4, 0).dtype == torch.int64  # 53 ids
    scratch = (1 << 12) * big.row_length * 8  # one block of int64 rows
    # a single int64 draw peaked at 3.2x its int64 result, 26x the uint8 one
    assert peak < 1.3 * final + 4 * scratch, (peak, final, scratch)


@pytest.mark.parametrize("call, name", [
    (lambda: StarGraphData(2.7, 3, 10, n_train=4, n_test=4), "d"),
    (lambda: StarGraphData(2, 3.9, 10, n_train=4, n_test=4), "l"),
    (lambda: StarGraphData(2, 3, 10.9, n_train=4, n_test=4), "n_nodes"),
    (lambda: StarGraphData(2, 3, 10, n_train=4, n_test=4, seed=-1), "seed"),
    (lambda: StarGraphData(2, 3, 10, n_train=4, n_test=4).batch(-1, 2, 0), "step"),
    (lambda: StarGraphStream(2, 3, 10, seed=2.9), "seed"),
    (lambda: StarGraphStream(2, 3, 10).batch(0, 0), "batch_size"),
    (lambda: generate_star_graphs(-1, 2, 3, 10, 0), "n"),
    (lambda: path_accuracy(lambda p, n: p[:, :n], torch.zeros(4, 13, dtype=torch.long), 9, 0), "path_len"),
    (lambda: path_accuracy(lambda p, n: p[:, :n], torch.zeros(4, 13, dtype=torch.long), 9, 3, batch_size=0), "batch_size"),
    (lambda: path_accuracy(lambda p, n: p[:, :n], torch.zeros(4, 12, dtype=torch.long), 9, 3), "tokens"),
])
def test_bad_star_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must"):
        call()


def test_decode_shows_unknown_ids():
    tok = StarGraphTokenizer(2)
    assert tok.decode([-1, 0, tok.vocab_size]) == f"<unk:-1> 0 <unk:{tok.vocab_size}>"


# ---------------------------------------------------------------------------- path accuracy

def _oracle(data):
    table = {tuple(r[:data.prefix_start + 1].tolist()): r[data.answer_slice]
             for r in data.test_tokens}

    def generate(prefix, n_new):
        assert prefix.shape[1] == data.prefix_start + 1 and n_new == data.path_len
        return torch.stack([table[tuple(p.tolist())] for p in prefix])
    return generate


def _flawed_cheat(data, seed=0):
    """Picks a random child of s, then follows the only child: right about 1/d of the time."""
    rng = np.random.default_rng(seed)

    def generate(prefix, n_new):
        out = []
        for p in prefix:
            g = data.tokenizer.parse(p)
            children = {}
            for u, v in g.edges:
                children.setdefault(u, []).append(v)
            path = [g.start, children[g.start][rng.integers(len(children[g.start]))]]
            while len(path) < n_new:
                path.append(children[path[-1]][0])
            out.append(path)
        return torch.tensor(out)
    return generate


def test_path_accuracy_oracle():
    data = StarGraphData(2, 5, 50, n_train=10, n_test=101, seed=0)
    assert path_accuracy(_oracle(data), data.test_tokens, data.prefix_start, data.path_len,
                         batch_size=7) == 1.0
    oracle = _oracle(data)
    bad_row = 50

    def one_wrong(prefix, n_new):  # wrong in one node (the 3rd) of one row
        out = oracle(prefix, n_new).clone()
        for b, p in enumerate(prefix):
            if torch.equal(p, data.test_tokens[bad_row, :data.prefix_start + 1]):
                out[b, 2] = (out[b, 2] + 1) % data.n_nodes
        return out
    acc, per_pos = path_accuracy(one_wrong, data.test_tokens, data.prefix_start, data.path_len,
                                 batch_size=16, per_position=True)
    assert acc == pytest.approx(100 / 101)
    assert per_pos.shape == (5,) and per_pos[2] == pytest.approx(100 / 101)
    assert per_pos[[0, 1, 3, 4]].eq(1).all()


@pytest.mark.parametrize("d", [2, 5])
def test_path_accuracy_flawed_cheat(d):
    data = StarGraphData(d, 5, 50, n_train=10, n_test=2000, seed=1)
    acc = path_accuracy(_flawed_cheat(data), data.test_tokens, data.prefix_start, data.path_len)
    assert abs(acc - 1 / d) < 0.04


# ---------------------------------------------------------------------------- text

_WORDS = "the cat sat on a mat and then ran to see big red dog who was very happy today".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)

    def doc(n):
        return " ".join(rng.choice(_WORDS, size=n)) + "."
    (root / "sub").mkdir()
    # a.txt: three documents separated by blank lines (one with whitespace on the blank line)
    (root / "a.txt").write_text(doc(5) + "\n" + doc(4) + "\n\n" + doc(30) + "\n  \n" + doc(3) + "\n")
    (root / "sub" / "b.txt").write_text("\n".join(doc(8) + "\n" for _ in range(40)))
    (root / "ignored.md").write_text("not a txt file " * 50)
    return root


def test_train_bpe_and_save_load(corpus, tmp_path):
    tok = train_bpe(corpus, vocab_size=300)
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>")] == [0, 1, 2]
    assert 259 < tok.get_vocab_size() <= 300
    text = "the big dog sat on the mat."
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text and len(ids) < len(text)   # merges were learnt
    save_tokenizer(tok, tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").encode(text).ids == ids
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(corpus, vocab_size=100)
    with pytest.raises(FileNotFoundError):
        train_bpe(tmp_path / "missing")


def test_text_data_batches(corpus):
    tok = train_bpe(corpus, vocab_size=300)
    data = TextData(corpus, tok, max_len=12, held_out=0.1, seed=0)
    assert (data.pad_id, data.bos_id, data.eos_id) == (0, 1, 2)
    assert data.n_held_out > 0 and data.n_train > 43          # 43 documents, some chunked
    seen = []
    for step in range(data.n_train // 8):
        tokens, lengths = data.batch(step, 8, seed=0)
        assert tokens.dtype == lengths.dtype == torch.int64
        assert tokens.shape == (8, int(lengths.max())) and int(lengths.max()) <= 12
        for row, n in zip(tokens, lengths):
            assert row[0] == data.bos_id and row[n - 1] == data.eos_id
            assert (row[n:] == data.pad_id).all() and (row[1:n - 1] > 2).all()
            seen.append(tuple(row[:n].tolist()))
    # one epoch draws without replacement (rows may repeat in content, so compare multisets)
    everything = Counter(tuple(r[:n].tolist()) for r, n in zip(*data.batch(0, data.n_train, 0)))
    assert not Counter(seen) - everything
    t1, l1 = data.batch(3, 8, seed=5)
    t2, l2 = TextData(corpus, tok, max_len=12, held_out=0.1, seed=0).batch(3, 8, seed=5)
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    held = [t for t, _ in data.held_out_batches(4)]
    assert sum(len(t) for t in held) == data.n_held_out
    # the long document (30 words) is cut into consecutive chunks that rejoin to the original
    whole = TextData(corpus, tok, max_len=12, held_out=0.0)
    tokens, lengths = whole.batch(0, whole.n_train, 0)
    rows = {tuple(r[1:n - 1].tolist()) for r, n in zip(tokens, lengths)}
    docs = list(iter_documents(corpus))
    assert len(docs) == 43 and "\n" in docs[0]                # a single newline does not split
    long_doc = tok.encode(docs[1]).ids
    assert len(long_doc) > 20
    chunks = [tuple(long_doc[i:i + 10]) for i in range(0, len(long_doc), 10)]
    assert all(c in rows for c in chunks)


def test_out_of_vocabulary_ids(tmp_path):
    rows = [[3, 4, 5], [6, 7], [8, 9, 10, 99, 11]]
    with pytest.raises(ValueError, match=r"my_ids: token id 99 at row 2, index 3 .*0\.\.49"):
        TextData.from_ids(rows, vocab_size=50, source_name="my_ids")
    path = tmp_path / "ids.npy"
    np.save(path, np.array([[3, 4, 5, 6], [7, 8, -1, 9]]))
    with pytest.raises(ValueError, match=r"ids\.npy: token id -1 at row 1, index 2"):
        TextData.from_ids(path, vocab_size=50)
    pt = tmp_path / "ids.pt"
    torch.save([torch.tensor([3, 4]), torch.tensor([5, 60])], pt)
    with pytest.raises(ValueError, match=r"ids\.pt: token id 60 at row 1, index 1"):
        TextData.from_ids(pt, vocab_size=50)
    ok = TextData.from_ids(rows[:2], vocab_size=50, max_len=4, held_out=0.0)
    tokens, lengths = ok.batch(0, ok.n_train, seed=0)
    assert sorted(lengths.tolist()) == [3, 4, 4]               # [3,4,5] -> two chunks, [6,7] one


def test_text_that_spells_a_special_token_is_text(tmp_path):
    """'<pad>', '<bos>', '<eos>' written in a document are its content, not special ids inside it."""
    (tmp_path / "a.txt").write_text("use <pad> and <eos> tags in html like <bos>\n\nanother document here\n")
    tok = train_bpe(tmp_path, 300)
    data = TextData(tmp_path, tok, 64, held_out=0)
    tokens, lengths = data.batch(0, 2, 0)
    for row, n in zip(tokens, lengths):
        inner = row[1 : int(n) - 1]
        assert int(row[0]) == data.bos_id and int(row[int(n) - 1]) == data.eos_id
        assert not any(int(t) in (data.pad_id, data.bos_id, data.eos_id) for t in inner)
    text = "use <pad> and <eos> tags"
    assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    tok.save(str(tmp_path / "tok.json"))
    again = load_tokenizer(tmp_path / "tok.json")  # the setting is not saved: loading sets it again
    assert again.encode(text, add_special_tokens=False).ids == tok.encode(text, add_special_tokens=False).ids


def test_one_document_holds_out_its_last_rows(tmp_path):
    """A corpus of one document (a book) still has held-out rows: its last ones, never trained on."""
    g = torch.Generator().manual_seed(0)  # random words: no two rows alike
    (tmp_path / "book.txt").write_text(" ".join(f"w{int(k)}" for k in torch.randint(0, 300, (3000,), generator=g)))
    tok = train_bpe(tmp_path, 300)
    data = TextData(tmp_path, tok, 32, held_out=0.1)
    assert data.n_held_out >= 1 and data.n_train >= 1
    train_rows = {tuple(r[: int(n)].tolist()) for r, n in zip(*data._train.gather(np.arange(data.n_train)))}
    held_rows = [tuple(r[: int(n)].tolist()) for t, l in data.held_out_batches(64) for r, n in zip(t, l)]
    assert len(held_rows) == data.n_held_out and not train_rows & set(held_rows)
    single = TextData(tmp_path, tok, 10**6, held_out=0.1)  # one row in all: nothing to hold out
    assert single.n_held_out == 0 and single.n_train == 1


def _rows_of(data, which):
    rows = data._train if which == "train" else data._held
    return [tuple(r[: int(n)].tolist()) for r, n in zip(*rows.gather(np.arange(len(rows))))]


def test_held_out_share_counts_rows_not_documents():
    """A long document and a short one: holding out 'one document' would hold out half the corpus,
    or almost all of it; the split holds out round(0.1 * rows) rows whatever the seed."""
    docs = [np.arange(3, 1003) % 500 + 3, np.arange(3, 13)]
    for seed in range(6):
        data = TextData.from_ids(docs, 600, max_len=64, held_out=0.1, seed=seed)
        rows = 18  # ceil(1000 / 62) + 1
        assert data.n_held_out == round(0.1 * rows) and data.n_train == rows - round(0.1 * rows)
        assert not set(_rows_of(data, "train")) & set(_rows_of(data, "held"))
    # Many documents: whole documents in a seeded order, at most one of them cut; exact share.
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 600, size=int(n)) for n in rng.integers(1, 200, size=80)]
    for held_out in (0.05, 0.3):
        data = TextData.from_ids(docs, 600, max_len=20, held_out=held_out, seed=1)
        total = data.n_train + data.n_held_out
        assert data.n_held_out == round(held_out * total)
        held, train = _rows_of(data, "held"), _rows_of(data, "train")
        cut = 0
        for d in docs:
            chunks = [tuple([1, *d[lo:lo + 18].tolist(), 2]) for lo in range(0, len(d), 18)]
            inside = [c in held for c in chunks]
            assert all(c in held or c in train for c in chunks)
            if any(inside) and not all(inside):
                cut += 1
                assert inside == sorted(inside)  # a cut document holds out its last rows
        assert cut <= 1
    assert TextData.from_ids(docs, 600, max_len=20, held_out=0.0).n_held_out == 0
    # every row but one asked for: one is still trained on
    assert TextData.from_ids(docs[:1], 600, max_len=20, held_out=0.99).n_train == 1


def test_text_data_is_the_same_whatever_the_encode_batch(corpus, monkeypatch):
    from bst_fast.data import text
    tok = train_bpe(corpus, vocab_size=300)
    whole = TextData(corpus, tok, max_len=12, held_out=0.1, seed=3)
    monkeypatch.setattr(text, "_ENCODE_CHARS", 60)  # 43 documents: an encode call every few
    parts = TextData(corpus, tok, max_len=12, held_out=0.1, seed=3)
    assert _rows_of(parts, "train") == _rows_of(whole, "train") and _rows_of(parts, "held") == _rows_of(whole, "held")
    assert parts.fingerprint() == whole.fingerprint()
    assert torch.equal(next(parts.batches(8))[0], parts.batch(0, 8, seed=3)[0])  # the data's own seed


def test_a_tokenizer_json_that_pads_or_truncates_changes_nothing(corpus, tmp_path):
    tok = train_bpe(corpus, vocab_size=300)
    plain = TextData(corpus, tok, max_len=64, held_out=0.0)
    tok.enable_padding(pad_id=0, pad_token="<pad>")
    tok.enable_truncation(8)
    save_tokenizer(tok, tmp_path / "tok.json")
    for t in (tok, load_tokenizer(tmp_path / "tok.json")):
        data = TextData(corpus, t, max_len=64, held_out=0.0)
        assert _rows_of(data, "train") == _rows_of(plain, "train")
    assert tok.padding is not None and tok.truncation is not None  # the caller's settings are kept


def test_text_files_must_be_utf8_and_hidden_folders_are_skipped(tmp_path):
    (tmp_path / "a.txt").write_bytes("\ufeffHello world.\n\ncaf\u00e9 na\u00efve".encode("utf-8"))
    assert list(iter_documents(tmp_path)) == ["Hello world.", "caf\u00e9 na\u00efve"]  # the BOM is dropped
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("Hello world.")
    assert list(iter_documents(tmp_path)) == ["Hello world.", "caf\u00e9 na\u00efve"]
    (tmp_path / "b.txt").write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"b\.txt: not UTF-8 text \(byte 3"):
        list(iter_documents(tmp_path))
    np.save(tmp_path / "ids.npy", np.arange(10))
    with pytest.raises(ValueError, match=r"ids\.npy: not UTF-8 .*TextData\.from_ids"):
        train_bpe(tmp_path / "ids.npy", 300)


@pytest.mark.parametrize("call, name", [
    (lambda: TextData.from_ids([[3, 4]], vocab_size=40.5), "vocab_size"),
    (lambda: TextData.from_ids([[3, 4]], vocab_size=40, seed=-1), "seed"),
    (lambda: TextData.from_ids([[3, 4]], vocab_size=40, max_len=2), "max_len"),
    (lambda: TextData.from_ids([[3, 4]], vocab_size=40, held_out=1.5), "held_out"),
    (lambda: TextData.from_ids([[3, 4]], vocab_size=40, bos_id=1.0), "bos_id"),
    # checked before the (here missing) corpus is read
    (lambda: TextData("no/such/corpus", None, max_len=16, held_out=1.0), "held_out"),
    (lambda: next(TextData.from_ids([[3, 4]] * 9, vocab_size=40, held_out=0.5).held_out_batches(0)), "batch_size"),
])
def test_bad_text_arguments_name_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_bpe_sample_keeps_long_and_short_documents_alike():
    """train_bpe(sample_bytes=) samples documents, not characters owed: with short documents 2% of the
    text, about 2% of the sample is theirs. Keeping a document once the characters owed covered it
    made them 98% of a sample at rate 0.02."""
    from bst_fast.data.text import _spread_sample

    docs = ["s" * 40 if k % 2 else "L" * 2000 for k in range(20000)]
    kept = list(_spread_sample(iter(docs), 0.02))
    short_chars = sum(len(d) for d in kept if d[0] == "s")
    total = sum(len(d) for d in kept)
    assert abs(total / (0.02 * sum(map(len, docs))) - 1) < 0.2  # about the asked share of the text
    assert 0.01 < short_chars / total < 0.04  # their share of the corpus: 40 / 2040, about 2%
    assert kept == list(_spread_sample(iter(docs), 0.02))  # the same sample every time


def test_star_nodes_and_layout_sizes_are_ints_never_truncated():
    """encode_row([(0, 1.7)], 0, 1.7, [0, 1.7]) encoded node 1 (int() truncated it); graph_keys(t,
    2.5, 3) read G(2, 3) (StarLayout's int())."""
    from bst_fast.data.star import StarLayout, graph_keys

    tok = StarGraphTokenizer(5)
    with pytest.raises(ValueError, match="node must be an int >= 0, got 1.7"):
        tok.encode_row([(0, 1.7)], 0, 1.7, [0, 1.7])
    for bad in (True, "1", np.float64(1.0), -1):
        with pytest.raises(ValueError, match="node must be an int >= 0"):
            tok.encode_row([(0, bad)], 0, 1, [0, 1])
    assert tok.encode_row([(0, np.int64(1))], 0, torch.tensor(1), [0, 1]) == tok.encode_row([(0, 1)], 0, 1, [0, 1])
    data = StarGraphData(2, 3, 12, 10, 5)
    for d, l in ((2.5, 3), (2, 3.0), ("2", 3), (2, 1)):
        with pytest.raises(ValueError, match=r"(d must be an int >= 1|l must be an int >= 2), got"):
            graph_keys(data.test_tokens, d, l)
        with pytest.raises(ValueError, match=r"must be an int"):
            StarLayout(d, l)
    assert np.array_equal(graph_keys(data.test_tokens, np.int64(2), 3), graph_keys(data.test_tokens, 2, 3))
