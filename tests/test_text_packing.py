"""Packed text rows (bst_fast/data/packing.py): `pack: true`, whole documents back to back in rows of
max_len, each as its unpacked row; `pack: split`, every unpacked row joined into one stream cut into
rows of exactly max_len; the trainer's counts, micro-batches, held-out loss and resume on them."""
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from bst_fast import BeliefStateTransformer, TrainConfig, load_model, train
from bst_fast.config import apply_sets, resolve_config
from bst_fast.data import TextData, load_tokenizer
from bst_fast.data.packing import pack_greedily, padding_fraction
from bst_fast.data.prepared import open_data, tokenize_corpus
from bst_fast.trainer import build_run, train_step
from _helpers import DDP_SCRIPT_END, star_fields_for, torchrun

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"


def documents(n=60, seed=0):
    """Content ids of n documents of 1 to 30 tokens (some longer than a row of 16)."""
    g = np.random.default_rng(seed)
    return [g.integers(3, 40, size=int(k)).tolist() for k in g.integers(1, 31, size=n)]


def units_of(rows):
    """The unpacked rows of (tokens, lengths[, documents]) batches, as lists of ids."""
    out = []
    for tokens, lengths, *docs in rows:
        for r in range(len(tokens)):
            valid = tokens[r, :lengths[r]].tolist()
            if not docs:
                out.append(valid)
                continue
            ids = docs[0][r, :lengths[r]].tolist()
            out += [[t for t, d in zip(valid, ids) if d == k] for k in range(ids[-1] + 1)]
    return out


@pytest.mark.parametrize("max_doc_tokens", [None, 20])
def test_packing_keeps_every_document_whole_and_in_order(max_doc_tokens):
    docs, L = documents(), 16
    kw = dict(vocab_size=40, max_len=L, held_out=0.2, seed=3, max_doc_tokens=max_doc_tokens)
    plain, packed = TextData.from_ids(docs, **kw), TextData.from_ids(docs, pack=True, **kw)
    assert packed.dropped_documents == plain.dropped_documents == (0 if max_doc_tokens is None else
                                                                   sum(len(d) > 20 for d in docs))
    for side in ("_train", "_held"):
        units = getattr(plain, side).gather(np.arange(len(getattr(plain, side))))
        rows = getattr(packed, side).gather(np.arange(len(getattr(packed, side))))
        # the unpacked rows (a long document cut as unpacked), in order, each whole: BOS .. EOS
        assert units_of([rows]) == units_of([units])
        tokens, lengths, ids = rows
        assert int(lengths.max()) <= L and len(rows[0]) < len(units[0])
        for r in range(len(tokens)):
            n = int(lengths[r])
            run = ids[r, :n]
            # ids are runs 0, 1, 2, ... (each starting at a BOS), padding continues the last one
            assert run[0] == 0 and bool(((run[1:] - run[:-1]) >= 0).all()) and bool(((run[1:] - run[:-1]) <= 1).all())
            assert torch.equal(tokens[r, :n] == 1, torch.cat([torch.tensor([True]), run[1:] != run[:-1]]))
            assert bool((ids[r, n:] == run[-1]).all())
        # greedy in data order: no row could have taken the next row's first document
        assert all(int(lengths[r]) + int((ids[r + 1, :lengths[r + 1]] == 0).sum()) > L for r in range(len(tokens) - 1))


def rows_of(rows):
    """The valid part of each row of a (tokens, lengths[, documents]) batch, as lists of ids."""
    return [rows[0][r, :rows[1][r]].tolist() for r in range(len(rows[0]))]


@pytest.mark.parametrize("max_len, max_doc_tokens", [(16, None), (16, 20), (5, None), (40, None)])
def test_split_rows_are_the_stream_of_unpacked_rows_cut_every_max_len(max_len, max_doc_tokens):
    docs = documents()
    kw = dict(vocab_size=40, max_len=max_len, held_out=0.2, seed=3, max_doc_tokens=max_doc_tokens)
    plain, split = TextData.from_ids(docs, **kw), TextData.from_ids(docs, pack="split", **kw)
    assert split.pack == "split" and split.packed and split.dropped_documents == plain.dropped_documents
    for side in ("_train", "_held"):
        units = getattr(plain, side).gather(np.arange(len(getattr(plain, side))))
        rows = getattr(split, side).gather(np.arange(len(getattr(split, side))))
        # nothing lost, added or reordered: the rows, joined, are the unpacked rows joined (train and
        # held-out apart), and every row but the stream's last is exactly max_len long
        stream = sum(rows_of(units), [])
        assert sum(rows_of(rows), []) == stream
        tokens, lengths, ids = rows
        assert bool((lengths[:-1] == max_len).all()) and 1 <= int(lengths[-1]) <= max_len
        assert len(tokens) == -(-len(stream) // max_len)
        for r in range(len(tokens)):
            n = int(lengths[r])
            run, step = ids[r, :n], ids[r, 1:n] - ids[r, :n - 1]
            # ids 0, 1, 2, ...: a new document at every BOS after the first position (content ids are
            # 3..39), the part before the row's first BOS its own document 0
            assert run[0] == 0 and torch.equal(step, (tokens[r, 1:n] == 1).long())
            assert bool((ids[r, n:] == run[-1]).all())
        # documents cut across rows: the fragments, each a run of one id, are the stream cut at every
        # BOS and every row boundary
        cuts = sorted({0, len(stream)} | {k for k, t in enumerate(stream) if t == 1}
                      | set(range(0, len(stream), max_len)))
        assert units_of([rows]) == [stream[a:b] for a, b in zip(cuts, cuts[1:])]
        # a row gathered alone, or in any order, is the same row
        order = np.random.default_rng(0).permutation(len(tokens))[:5]
        again = getattr(split, side).gather(order)
        assert rows_of(again) == [rows_of(rows)[r] for r in order]
        assert all(torch.equal(again[2][b, :again[1][b]], ids[r, :lengths[r]]) for b, r in enumerate(order))
    before, after = split.padding(4)
    assert before == plain.padding(4)[0] and after <= min(before, 0.05)  # the stream's last row, if drawn


def test_a_bad_pack_value_is_a_clear_error(tmp_path):
    for bad in ("yes", "Split", 1, None, [True]):
        with pytest.raises(ValueError, match="'pack' must be false, true or 'split'"):
            tiny(tmp_path, pack=bad)
        with pytest.raises(ValueError, match="pack must be False, True or 'split'"):
            TextData.from_ids(documents(), vocab_size=40, max_len=16, pack=bad)
    with pytest.raises(ValueError, match="'pack' must be false, true or 'split'"):
        TrainConfig(data=str(tmp_path), pack="splits").check()  # a TrainConfig built directly, checked
    assert apply_sets(tiny(tmp_path), ["pack=split"]).pack == "split"  # --set pack=split
    assert apply_sets(tiny(tmp_path), ["pack=true"]).pack is True


def test_pack_greedily_and_padding_fraction():
    assert pack_greedily([3, 4, 5, 2, 6, 6], 8).tolist() == [0, 2, 4, 5, 6]  # [3 4] [5 2] [6] [6]
    assert pack_greedily([], 8).tolist() == [0]
    with pytest.raises(ValueError, match="1..8"):
        pack_greedily([3, 9], 8)
    # two batches of 2: [2, 4] padded to 4 and [4, 4]: 2 of 16 positions are padding, in any order
    assert padding_fraction([2, 4, 4, 4], 2) in (pytest.approx(2 / 16), pytest.approx(2 / 14))
    assert padding_fraction([5, 5, 5], 3) == 0.0


@pytest.mark.parametrize("pack", [True, "split"])
def test_packed_batches_are_pure_functions_of_seed_and_step(pack):
    a, b = (TextData.from_ids(documents(), vocab_size=40, max_len=16, pack=pack, seed=1) for _ in range(2))
    a.batch(0, 4, seed=1)
    for step in (5, 0, 9):
        assert all(torch.equal(x, y) for x, y in zip(a.batch(step, 4, seed=1), b.batch(step, 4, seed=1)))


def tiny(out_dir, **changes):
    return resolve_config(TINY, out_dir=str(out_dir), **{**star_fields_for(changes.get("data", "star")), **changes})


def corpus(tmp_path):
    """60 short documents (2 to 7 words) of a 20-word language: rows of 32 hold several."""
    words = "the cat sat on a mat and ran to see the dog who barked at it in the park today".split()
    g = np.random.default_rng(0)
    path = tmp_path / "c.txt"
    path.write_text("\n\n".join(" ".join(g.choice(words, size=int(n))) for n in g.integers(2, 8, size=60)))
    return path


def text(tmp_path, out="run", **changes):
    return tiny(tmp_path / out, data=str(corpus(tmp_path)), text_vocab=280, max_len=32, **{"pack": True, **changes})


@pytest.mark.parametrize("pack", [True, "split"])
def test_a_packed_batch_is_its_documents_trained_alone(tmp_path, pack):
    """The step's counts and loss on a packed batch are those of its documents as unpacked rows:
    pairs and next-token targets never cross a document, and each document reads only itself (split
    rows: each fragment of a document cut by a row boundary is trained alone, as its own row)."""
    run = build_run(text(tmp_path, batch_size=4, gamma=0.5, pack=pack, **{"model.dropout": 0.0}).check(), "cpu")
    batch = run.batch(0)
    assert batch.documents is not None and int(batch.documents.max()) > 0  # several documents a row
    units = units_of([(batch.tokens, batch.lengths, batch.documents)])
    if pack == "split":  # full rows, most starting and ending mid-document
        assert bool((batch.lengths == 32).all()) and any(u[0] != 1 for u in units) and any(u[-1] != 2 for u in units)
    alone = torch.zeros(len(units), max(map(len, units)), dtype=torch.long)
    for k, u in enumerate(units):
        alone[k, :len(u)] = torch.tensor(u)
    lengths = torch.tensor([len(u) for u in units])
    pairs, targets, _ = run.objective.totals(lengths, torch.zeros_like(lengths), alone.shape[1])
    assert (batch.pair_total, batch.token_total) == (pairs, targets)
    assert pairs == sum((n - 1) * (n - 2) // 2 for n in lengths.tolist())
    model = run.model.eval()
    kw = dict(prefix_start=0, generator=torch.Generator(), pair_total=pairs, token_total=targets, row_total=1)
    with torch.no_grad():
        packed = run.objective(model, batch.tokens, batch.lengths, documents=batch.documents, **kw)
        plain = run.objective(model, alone, lengths, **kw)
    for key in ("total", "belief", "gpt"):
        assert float(packed[key]) == pytest.approx(float(plain[key]), rel=1e-5)


@pytest.mark.parametrize("pack", [True, "split"])
def test_grad_accum_on_packed_rows_gives_the_big_batchs_weights(tmp_path, pack):
    runs = []
    for accum in (1, 2):
        run = build_run(text(tmp_path, grad_accum=accum, batch_size=4, pack=pack, **{"model.dropout": 0.0}).check(), "cpu")
        losses = [float(train_step(run, step)) for step in range(3)]
        runs.append((losses, {k: v.detach().clone() for k, v in run.model.state_dict().items()}))
    (l1, p1), (l2, p2) = runs
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert all(torch.allclose(p1[k], p2[k], atol=1e-6, rtol=1e-5) for k in p1)


@pytest.mark.parametrize("pack", [True, "split"])
def test_a_packed_run_trains_and_logs_the_padding_it_saves(tmp_path, capfd, pack):
    cfg = text(tmp_path, steps=6, eval_every=1, log_every=1, warmup=0, lr=1e-2, min_lr=1e-2, pack=pack)
    result = train(cfg)
    line = re.search(r"packing: (\d+)% of positions were padding, now (\d+)%", capfd.readouterr().err)
    # 35% -> 18% packed on these few rows; split rows are full but the stream's last
    assert line and int(line.group(2)) < int(line.group(1)) - 10 and (pack is True or int(line.group(2)) <= 5), line
    rows = [r.split(",") for r in (tmp_path / "run" / "metrics.csv").read_text().splitlines()[1:]]
    held = [float(v) for _, k, v in rows if k == "held_out_loss"]
    assert len(held) == 6 and result["held_out_loss"] == held[-1]
    vocab = load_model(tmp_path / "run")[1].model.vocab_size
    assert held[0] > math.log(vocab) - 0.5 and held[-1] < held[0] - 0.3, held


@pytest.mark.parametrize("pack", [True, "split"])
def test_a_packed_run_resumes_bitwise_exactly(tmp_path, pack):
    opts = dict(steps=6, ckpt_every=0, batch_size=4, pairs=0.5, pack=pack, **{"model.dropout": 0.1})
    train(text(tmp_path, "full", **opts))
    train(text(tmp_path, "cut", **opts), stop_at=3)
    train(text(tmp_path, "cut", **opts), resume=True)
    a, b = load_model(tmp_path / "full")[0], load_model(tmp_path / "cut")[0]
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match="pack"):  # packing changes every batch: not a resumable change
        train(text(tmp_path, "cut", **{**opts, "steps": 8, "pack": "split" if pack is True else True}), resume=True)


@pytest.mark.parametrize("changes, field", [({"pack": True}, "pack"), ({"max_doc_tokens": 256}, "max_doc_tokens"),
                                            ({"max_doc_tokens": -1}, "max_doc_tokens"),
                                            ({"max_len": 258}, "max_len"), ({"text_vocab": 300}, "text_vocab")])
def test_text_fields_on_star_graphs_are_clear_errors(tmp_path, changes, field):
    with pytest.raises(ValueError, match=f"'{field}' must be"):
        tiny(tmp_path, **changes).check()


@pytest.mark.parametrize("pack", [True, "split"])
def test_a_packed_mixture_of_prepared_corpora(tmp_path, pack):
    """Each corpus is packed alone; a mixture's packed row is a packed row of the corpus it drew."""
    text = corpus(tmp_path)
    tokenize_corpus(text, tmp_path / "a", vocab_size=280, workers=0)
    # b: the first 40 documents (one corpus twice is refused: it would be held out twice)
    half = tmp_path / "half" / "c.txt"
    half.parent.mkdir()
    half.write_text("\n\n".join(text.read_text().split("\n\n")[:40]))
    tokenize_corpus(half, tmp_path / "b", tokenizer=tmp_path / "a" / "tokenizer.json", workers=0)
    mix = open_data([[str(tmp_path / "a"), 2], [str(tmp_path / "b"), 1]], 32, pack=pack)
    assert mix.packed and mix.n_train == sum(p.n_train for p in mix.parts) < open_data(str(tmp_path / "a"), 32).n_train * 2
    rows = set()
    for part in mix.parts:
        t, n, _ = part._train.gather(np.arange(part.n_train))
        rows |= {tuple(t[r, :n[r]].tolist()) for r in range(len(t))}
    tokens, lengths, ids = mix.batch(3, 8, seed=0)
    for r in range(8):
        assert tuple(tokens[r, :lengths[r]].tolist()) in rows  # a packed row of the corpus it drew
        assert bool((ids[r, lengths[r]:] == ids[r, lengths[r] - 1]).all())
    before, after = mix.padding(8)
    assert after < before


def test_split_rows_of_a_prepared_corpus_are_read_from_its_memory_map(tmp_path):
    """A prepared corpus's split rows are the raw text's (same tokenizer), read from the memory-mapped
    token file row by row: the stream is never built."""
    path = corpus(tmp_path)
    tokenize_corpus(path, tmp_path / "a", vocab_size=280, workers=0)
    raw = TextData(path, load_tokenizer(tmp_path / "a" / "tokenizer.json"), 32, pack="split")
    prep = open_data(str(tmp_path / "a"), 32, pack="split")
    assert isinstance(prep._train.units.flat, np.memmap) and not hasattr(prep._train, "tokens")
    for side in ("_train", "_held"):
        a, b = (getattr(d, side).gather(np.arange(len(getattr(d, side)))) for d in (raw, prep))
        assert len(a[0]) > 0 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(raw.batch(2, 4, seed=0), prep.batch(2, 4, seed=0)))


def test_the_tinystories_config_is_the_official_setup_and_trains(tmp_path):
    cfg = resolve_config("configs/tinystories.yaml").check()
    assert (cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head, cfg.model.head_type) == (8, 768, 8, "swiglu")
    assert (cfg.text_vocab, cfg.max_len - 2, cfg.max_doc_tokens, cfg.pack) == (1000, 256, 256, "split")
    assert (cfg.batch_size, cfg.lr, cfg.weight_decay, cfg.grad_clip, cfg.steps) == (256, 3e-4, 0.1, 1.0, 100_000)
    assert (cfg.min_gap, cfg.meet_token, cfg.reduction, cfg.model.dropout) == (1, "eos", "row_mean", 0.0)
    # the model the data would complete (vocabulary 1000 with the specials), built without weights
    model_cfg = TrainConfig.from_dict({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "vocab_size": 1000,
                                                                  "max_len": cfg.max_len}}).model.check()
    with torch.device("meta"):
        params = sum(p.numel() for p in BeliefStateTransformer(model_cfg).parameters())
    assert 110e6 < params < 140e6, params  # two 8 x 768 encoders (~57M each) and the SwiGLU head
    # a tiny override of it trains (on the CPU, a small generated corpus)
    small = dict(data=str(corpus(tmp_path)), text_vocab=280, max_len=32, max_doc_tokens=12, steps=2, batch_size=4,
                 device="cpu", eval_every=2, ckpt_every=2, progress=False, out_dir=str(tmp_path / "run"),
                 model={"n_layer": 1, "d_model": 32, "n_head": 2})
    result = train("configs/tinystories.yaml", **small)
    assert math.isfinite(result["held_out_loss"]) and load_model(tmp_path / "run")[1].pack == "split"


def test_ddp_two_ranks_on_split_rows_equal_one_process(tmp_path):
    """Two DDP ranks on packed (split) text rows give one process's weights: each rank's share of a
    step's pairs and next-token targets divides by the whole step's counts over its documents."""
    import os
    import subprocess
    import sys

    corpus(tmp_path)
    sets = dict(data=str(tmp_path / "c.txt"), text_vocab=280, max_len=32, pack="split", batch_size=4, steps=4,
                ckpt_every=0, eval_every=0, lr=1e-2, min_lr=1e-2, warmup=0, gamma=0.5, **{"model.dropout": 0.0,
                "model.gpt_head": True}, **star_fields_for("text"))
    script = tmp_path / "run.py"
    script.write_text("import bst_fast, sys\n"
                      f"kw = {sets!r}\n"
                      "kw.update(steps=int(sys.argv[2])) if len(sys.argv) > 2 else None\n"
                      f"bst_fast.train({str(TINY)!r}, out_dir=sys.argv[1], **kw)\n"
                      + DDP_SCRIPT_END)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for out, steps in (("one", []), ("short", ["1"])):
        subprocess.run([sys.executable, str(script), str(tmp_path / out), *steps], check=True, env=env,
                       capture_output=True, timeout=300)
    ddp = torchrun(script, tmp_path / "two")
    run = subprocess.run(ddp, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    one, _ = load_model(tmp_path / "one")
    two, _ = load_model(tmp_path / "two")
    short, _ = load_model(tmp_path / "short")  # after one step: the later steps moved the weights
    d = one.cfg.d_model
    for name, x in one.state_dict().items():
        y = two.state_dict()[name]
        if name.endswith("qkv.bias"):  # the key bias's gradient is rounding noise (see test_train.py)
            keep = torch.ones_like(x, dtype=torch.bool)
            keep[d:2 * d] = False
            x, y = x[keep], y[keep]
        assert float((x - y).abs().max() / (y.abs().max() + 1e-12)) < 1e-5, name
    assert any(not torch.allclose(v, short.state_dict()[k]) for k, v in one.state_dict().items())

    def held_out(run):  # the last step's evaluation: each DDP rank scored every other batch, summed
        rows = [line.split(",") for line in (tmp_path / run / "metrics.csv").read_text().splitlines()[1:]]
        return [float(v) for s, k, v in rows if k == "held_out_loss"]
    assert len(held_out("one")) == 1 and held_out("two") == pytest.approx(held_out("one"), rel=1e-5)
