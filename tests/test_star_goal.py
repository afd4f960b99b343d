"""Where the star graph's answer sits in a row: nothing in the listing order may give it away.

A model that could read the goal arm off the row's layout (the first edge leaving s, the last leaf
listed, the smallest leaf label, ...) would solve the task without planning. Rows are parsed here
from the documented token format, independently of StarGraphTokenizer and of graph_keys."""
import numpy as np
import pytest
import torch

from bst_fast.data import StarGraphData, StarGraphStream, StarGraphTokenizer, generate_star_graphs


def parse(row, n_nodes):
    """(edges in row order, s, g, path) of one row [BOS u v | u v | ... / s g = path EOS]: node ids are
    0..N-1, then PAD, BOS, EOS, "|", "/", "=" (the format of bst_fast.data.star's docstring)."""
    bos, eos, sep, query, answer = (n_nodes + k for k in (1, 2, 3, 4, 5))
    row = [int(t) for t in row]
    assert row[0] == bos and row[-1] == eos
    q = row.index(query)
    listing = row[1:q]
    assert len(listing) % 3 == 2 and all(t == sep for t in listing[2::3])
    edges = list(zip(listing[0::3], listing[1::3]))
    s, g = row[q + 1], row[q + 2]
    assert row[q + 3] == answer
    path = row[q + 4:-1]
    assert all(0 <= t < n_nodes for e in edges for t in e) and 0 <= s < n_nodes and 0 <= g < n_nodes
    return edges, s, g, path


def arms(edges, s):
    """The arms of the star, each as its node list from s, in the row order of their first edges."""
    child = {}
    for u, v in edges:
        child.setdefault(u, []).append(v)
    out = []
    for first in child[s]:
        arm = [s, first]
        while arm[-1] in child:
            (nxt,) = child[arm[-1]]
            arm.append(nxt)
        out.append(arm)
    return out


def test_special_ids_match_the_tokenizer():
    tok = StarGraphTokenizer(7)
    assert (tok.bos_id, tok.eos_id, tok.edge_sep_id, tok.query_id, tok.answer_id) == (8, 9, 10, 11, 12)


def _assert_uniform(counts, n, what):
    """Each of the len(counts) outcomes has frequency 1/len(counts) within 5 standard errors."""
    d = len(counts)
    se = ((1 / d) * (1 - 1 / d) / n) ** 0.5
    freq = np.asarray(counts) / n
    assert np.all(np.abs(freq - 1 / d) < 5 * se), f"{what}: frequencies {freq.round(4)}, expected {1 / d:.4f} +- {se:.4f}"


@pytest.mark.parametrize("d,l,n_nodes", [(2, 5, 50), (3, 4, 20), (5, 3, 11)])
def test_goal_arm_position_is_uniform(d, l, n_nodes):
    """Over a few thousand graphs: which of s's out-edges (in row order) starts the goal arm, which
    listed leaf is the goal, and the goal's rank by label among the leaves are each uniform over the
    d arms; the goal edge's slot in the listing is uniform over the E edges on average."""
    n = 3000
    rows = generate_star_graphs(n, d, l, n_nodes, seed=[31, d, l])
    E = d * (l - 1)
    arm_rank = np.zeros(d, dtype=np.int64)
    leaf_rank = np.zeros(d, dtype=np.int64)
    label_rank = np.zeros(d, dtype=np.int64)
    slots = []
    for row in rows:
        edges, s, g, path = parse(row, n_nodes)
        assert len(edges) == E
        star = arms(edges, s)
        assert len(star) == d and all(len(a) == l for a in star)
        goal_arms = [k for k, a in enumerate(star) if a[-1] == g]
        assert len(goal_arms) == 1 and star[goal_arms[0]] == path  # the answer is the goal's arm
        arm_rank[goal_arms[0]] += 1
        slot = [k for k, (_, v) in enumerate(edges) if v == g]
        assert len(slot) == 1
        slots.append(slot[0])
        leaves_in_order = [v for _, v in edges if v in {a[-1] for a in star}]
        leaf_rank[leaves_in_order.index(g)] += 1
        label_rank[sorted(a[-1] for a in star).index(g)] += 1
    _assert_uniform(arm_rank, n, "goal arm among s's out-edges in row order")
    _assert_uniform(leaf_rank, n, "goal among the leaves in row order")
    _assert_uniform(label_rank, n, "goal's label rank among the leaves")
    # The slot of the edge into g: uniform over 0..E-1 has mean (E-1)/2 and variance (E^2-1)/12.
    se = ((E * E - 1) / 12 / n) ** 0.5
    assert abs(np.mean(slots) - (E - 1) / 2) < 5 * se, (np.mean(slots), (E - 1) / 2, se)
    # And every label is as likely a goal as any other (no label is reserved for goals).
    goals = rows[:, 3 * E + 2]
    _assert_uniform(np.bincount(goals, minlength=n_nodes), n, "goal label")


def test_goal_arm_position_in_the_training_data():
    """The same through StarGraphData and StarGraphStream, whose rows pass the exclusion filter."""
    d, l, N = 3, 4, 20
    data = StarGraphData(d, l, N, n_train=2000, n_test=500, seed=3)
    stream = StarGraphStream(d, l, N, seed=3, exclude=data)
    for rows in (data.train_tokens, data.test_tokens, stream.batch(7, 2000)):
        counts = np.zeros(d, dtype=np.int64)
        for row in rows.tolist():
            edges, s, g, _ = parse(row, N)
            counts[[a[-1] for a in arms(edges, s)].index(g)] += 1
        _assert_uniform(counts, len(rows), "goal arm among s's out-edges in row order")


def _canon(row, n_nodes):
    edges, s, g, _ = parse(row, n_nodes)
    return frozenset(edges), s, g


def test_train_and_test_graphs_are_disjoint():
    """From parsed graphs (edge set, start, goal), not from graph_keys: the test rows are distinct and
    share no graph + query with the training rows or a stream that excludes them."""
    d, l, N = 2, 3, 5  # 120 distinct graph + query rows: fresh draws collide with the test set
    data = StarGraphData(d, l, N, n_train=600, n_test=40, seed=11)
    test = [_canon(r, N) for r in data.test_tokens.tolist()]
    assert len(set(test)) == len(test) == 40
    test = set(test)
    # Without the exclusion, rows like these would hit the test set (so the check below has teeth).
    fresh = generate_star_graphs(600, d, l, N, seed=12)
    assert any(_canon(r, N) in test for r in fresh.tolist())
    train = {_canon(r, N) for r in data.train_tokens.tolist()}
    assert not train & test
    stream = StarGraphStream(d, l, N, seed=11, exclude=data)
    assert not {_canon(r, N) for r in torch.cat([stream.batch(s, 300) for s in range(3)]).tolist()} & test
