"""Pre-tokenised corpora (bst_fast/data/prepared.py): `bst-fast tokenize`, training from the folder
without tokenising, weighted mixtures, an existing tokenizer by path, and every bad input's error."""
import hashlib
import json
import os
import math
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import bst_fast.data as data_pkg
from bst_fast import TrainConfig, load_model, train
from bst_fast import checkpoint as checkpoint_mod
from bst_fast.__main__ import main as cli
from bst_fast.data import TextData, load_tokenizer, save_tokenizer, train_bpe
from bst_fast.data import prepared as prep
from bst_fast.data import text as text_mod
from bst_fast.data.encode import PieceEncoder, piece_encodable
from bst_fast.tasks import TextTask
from _helpers import star_fields_for

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_test.yaml"
WORDS = "once upon a time little tom saw a big red ball and he was very happy to play with it".split()


def tiny(out, **changes):
    d = TrainConfig.load(TINY).to_dict()
    d.update(out_dir=str(out), **{**star_fields_for(changes.get("data", "star")), **changes})
    return TrainConfig.from_dict(d)


def write_corpus(path: Path, n_docs=60, seed=0, words=WORDS):
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(words, size=int(rng.integers(3, 40)))) + "." for _ in range(n_docs)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(docs) + "\n")
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(text file, tokenizer.json, prepared corpus folder) of one small corpus."""
    root = tmp_path_factory.mktemp("prepared")
    text = root / "text" / "a.txt"
    write_corpus(text)
    tok = root / "tok.json"
    save_tokenizer(train_bpe(text, vocab_size=300), tok)
    out = root / "corpus"
    assert cli([ "tokenize", str(text), "--out", str(out), "--tokenizer", str(tok), "--no-progress"]) == 0
    return text, tok, out


def rows(data, batches=6, batch_size=8, seed=0):
    return [data.batch(s, batch_size, seed) for s in range(batches)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b)) and len(a) == len(b)


# ---------------------------------------------------------------------------------------------
# reading and encoding: the same documents and ids as before, faster


def test_streamed_reader_splits_as_the_whole_file_does(tmp_path, monkeypatch):
    blank = re.compile(r"\n[ \t\r\f\v]*\n")

    def whole(f):
        return [b.strip() for b in blank.split(f.read_bytes().decode("utf-8-sig")) if b.strip()]

    rnd = random.Random(1)
    alphabet = ["a", "b", " ", "\n", "\n", "\t", "\r", "\x0c", "\x0b", "\u00e9", "\u65e5", "\u2028", "\x85",
                "\ufeff", "  \n"]
    f = tmp_path / "x.txt"
    for _ in range(1500):
        s = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 60)))
        f.write_bytes((("\ufeff" if rnd.random() < 0.3 else "") + s).encode())
        monkeypatch.setattr(text_mod, "_READ_BYTES", rnd.randint(1, 9))
        assert list(text_mod.iter_documents(f)) == whole(f), repr(s)
    f.write_bytes(b"ok\n\n" * 5 + b"caf\xe9")  # the error names the byte in the file
    with pytest.raises(ValueError, match=r"x\.txt: not UTF-8 text \(byte 23"):
        list(text_mod.iter_documents(f))


def test_piece_encoder_gives_the_tokenizers_own_ids(corpus):
    tok = load_tokenizer(corpus[1])
    assert piece_encodable(tok)
    rnd = random.Random(0)
    alphabet = list("ab c.,'!?\n\t\r  1234") + ["\u00a0", "\u2028", "\x85", "\x1c", "\u3000", "\u00e9", "\u65e5",
                                               "'s", "'ll", "\u200b", "\u180e", "  ", "\x0b", "<bos>", "once", " upon"]
    docs = ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 60))) for _ in range(3000)]
    enc = PieceEncoder(tok, np.uint16)
    for lo in range(0, len(docs), 700):  # a cache that fills over several calls
        flat, lengths = enc.encode(docs[lo:lo + 700])
        ref = [e.ids for e in tok.encode_batch(docs[lo:lo + 700], add_special_tokens=False)]
        assert lengths.tolist() == [len(r) for r in ref]
        assert flat.tolist() == [i for r in ref for i in r]
    assert enc.fast
    from tokenizers import Tokenizer, normalizers

    other = Tokenizer.from_str(tok.to_str())
    other.normalizer = normalizers.Lowercase()  # not piece-wise: encode_batch itself is used
    assert not piece_encodable(other) and not PieceEncoder(other).fast


def test_piece_encoder_checks_short_documents_against_the_tokenizer_and_never_a_huge_one(corpus, monkeypatch):
    """The fast encoder's ids are checked against encode_batch on some documents each call: a wrong
    id is an error. Documents over _CHECK_CHARS are not checked (encode_batch's Encodings of a 50 MB
    document held 13 GB: review helper-90), the short ones of the same calls are."""
    from bst_fast.data import encode

    tok = load_tokenizer(corpus[1])
    long_doc = "once upon a time. " * (encode._CHECK_CHARS // 18 + 1)
    assert len(long_doc) > encode._CHECK_CHARS
    enc = PieceEncoder(tok, np.uint16)
    checked = []
    real = enc._hf
    monkeypatch.setattr(enc, "_hf", lambda docs: checked.extend(map(len, docs)) or real(docs))
    enc.encode([long_doc, "a short one", long_doc, "another"])  # first call: the pieces' misses, then the check
    enc.encode([long_doc] * 3)
    n_first = len(checked)
    assert max(checked) < 200 and {len("a short one"), len("another")} <= set(checked), checked
    flat, lengths = enc.encode([long_doc])
    assert lengths.tolist() == [len(e.ids) for e in tok.encode_batch([long_doc], add_special_tokens=False)]
    assert len(checked) == n_first  # nothing encoded or checked: the cache held every piece
    bad = PieceEncoder(tok, np.uint16)
    monkeypatch.setattr(bad, "_encode_fast", lambda docs: (np.zeros(3, np.uint16), np.array([3] + [0] * (len(docs) - 1))))
    with pytest.raises(RuntimeError, match="piece-wise encoding differs"):
        bad.encode(["a short one", "x"])


# ---------------------------------------------------------------------------------------------
# tokenize -> train


def test_tokenize_writes_a_manifest_and_uint16(corpus):
    text, tok, out = corpus
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "bst_fast.prepared" and m["version"] == 1 and m["dtype"] == "uint16"
    assert m["documents"] == 60 and m["vocab_size"] == load_tokenizer(tok).get_vocab_size()
    assert (out / "tokens.bin").stat().st_size == 2 * m["tokens"]
    assert (out / "offsets.bin").stat().st_size == 8 * (m["documents"] + 1)
    assert m["sha256"]["tokens"] == hashlib.sha256((out / "tokens.bin").read_bytes()).hexdigest()
    assert m["fingerprint"] == prep.fingerprint_of(m) and m["source"]["files"] == 1
    assert prep.dtype_for(65536) == np.uint16 and prep.dtype_for(65537) == np.uint32
    assert not list(out.parent.glob(".corpus.*"))  # no temporary folder left


def test_train_from_a_prepared_corpus_tokenises_nothing(corpus, tmp_path, monkeypatch):
    text, tok, out = corpus

    def refuse(*a, **k):
        raise AssertionError("a prepared corpus was tokenised or a tokenizer trained")

    monkeypatch.setattr(data_pkg, "train_bpe", refuse)
    monkeypatch.setattr(text_mod, "train_bpe", refuse)
    monkeypatch.setattr(text_mod, "_encode_documents", refuse)
    monkeypatch.setattr(PieceEncoder, "encode", refuse)
    cfg = tiny(tmp_path / "run", data=str(out), max_len=24, steps=4, eval_every=2, ckpt_every=2)
    result = train(cfg)
    assert math.isfinite(result["held_out_loss"])
    manifest = json.loads((out / "manifest.json").read_text())
    saved = json.loads((tmp_path / "run" / "data.json").read_text())
    assert saved["sha256"] == manifest["fingerprint"] and saved["format"] == "prepared"
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000004"
    assert load_tokenizer(ckpt / "tokenizer.json").to_str() == load_tokenizer(out / "tokenizer.json").to_str()
    model, saved_cfg = load_model(ckpt)
    assert saved_cfg.model.vocab_size == manifest["vocab_size"]


def test_batches_equal_training_from_the_text_with_that_tokenizer(corpus, tmp_path, monkeypatch):
    text, tok, out = corpus
    monkeypatch.setattr(data_pkg, "train_bpe", lambda *a, **k: pytest.fail("train_bpe called"))
    common = dict(max_len=12, batch_size=8, seed=5)
    raw = TextTask(tiny(tmp_path, data=str(text), tokenizer=str(tok), **common))
    ready = TextTask(tiny(tmp_path, data=str(out), **common))
    assert raw.vocab_size == ready.vocab_size == load_tokenizer(tok).get_vocab_size()
    assert same([raw.rows(s, 8)[:2] for s in range(12)], [ready.rows(s, 8)[:2] for s in range(12)])
    assert same(list(raw.data.held_out_batches(5)), list(ready.data.held_out_batches(5)))
    assert torch.equal(raw.data.held_out_lengths, ready.data.held_out_lengths)


def test_resume_is_bitwise_exact_on_a_prepared_corpus(corpus, tmp_path):
    out = corpus[2]
    model = {"n_layer": 1, "d_model": 16, "n_head": 2, "head_hidden": 16, "dropout": 0.1}
    text = dict(data=str(out), max_len=16, steps=6, eval_every=0, ckpt_every=0, pairs=0.5, model=model)
    train(tiny(tmp_path / "full", **text))
    train(tiny(tmp_path / "cut", **text), stop_at=3)
    train(tiny(tmp_path / "cut", **text), resume=True)
    a, _ = load_model(tmp_path / "full")
    b, _ = load_model(tmp_path / "cut")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_resume_names_a_changed_data_field_and_takes_the_same_corpus_by_another_path(corpus, tmp_path):
    """A star run resumed with data=<prepared corpus> said "checkpoint ... holds no tokenizer.json"
    (the task read the new data before the config was compared); a text run resumed with its corpus
    through a link was refused on the `data` string, though the corpus's fingerprint is checked."""
    text, _, out = corpus
    train(tiny(tmp_path / "star", steps=2, eval_every=0, ckpt_every=0))
    with pytest.raises(ValueError, match=r"another config.*'data': \('star', '.*corpus'\)"):
        train(tiny(tmp_path / "star", steps=3, eval_every=0, ckpt_every=0, data=str(out), max_len=16), resume=True)
    link = tmp_path / "link"
    link.symlink_to(out)
    run = dict(max_len=16, eval_every=0, ckpt_every=0)
    train(tiny(tmp_path / "text", data=str(out), steps=2, **run))
    train(tiny(tmp_path / "text", data=str(link), steps=3, **run), resume=True)
    assert (tmp_path / "text" / "checkpoints" / "latest").read_text() == "step-00000003"
    # another corpus (the same documents tokenised in RAM: another kind of fingerprint) is still refused
    with pytest.raises(ValueError, match="trained on a prepared corpus and data now names raw text"):
        train(tiny(tmp_path / "text", data=str(text), steps=4, **run), resume=True)
    with pytest.raises(ValueError, match=r"another config.*'data': \('.*link', 'star'\)"):  # the link resumed it
        train(tiny(tmp_path / "text", steps=4, eval_every=0, ckpt_every=0), resume=True)


def test_text_vocab_blocks_a_resume_only_where_the_run_read_it(corpus, tmp_path):
    """text_vocab sizes the BPE a raw-text run trains; a run whose tokenizer came with it (a prepared
    corpus, a `tokenizer` file) never reads it, so a resume that changes it is the same run, while a
    resume of a run that trained its BPE from it is refused on it."""
    text, tok, out = corpus
    run = dict(max_len=16, eval_every=0, ckpt_every=0)
    for name, data in (("prepared", dict(data=str(out))), ("tokenizer", dict(data=str(text), tokenizer=str(tok)))):
        train(tiny(tmp_path / name, steps=2, **data, **run))
        train(tiny(tmp_path / name, steps=3, text_vocab=4000, **data, **run), resume=True)
        assert load_model(tmp_path / name)[1].text_vocab == 4000
    train(tiny(tmp_path / "bpe", data=str(text), text_vocab=280, steps=2, **run))
    with pytest.raises(ValueError, match=r"another config.*'text_vocab': \(280, 300\)"):
        train(tiny(tmp_path / "bpe", data=str(text), text_vocab=300, steps=3, **run), resume=True)


def test_an_existing_tokenizer_for_raw_text(corpus, tmp_path, monkeypatch):
    text, tok, _ = corpus
    monkeypatch.setattr(data_pkg, "train_bpe", lambda *a, **k: pytest.fail("train_bpe called"))
    task = TextTask(tiny(tmp_path, data=str(text), tokenizer=str(tok), text_vocab=5000, max_len=16))
    assert task.vocab_size == load_tokenizer(tok).get_vocab_size()  # the tokenizer's, not text_vocab
    with pytest.raises(ValueError, match="config field 'tokenizer': no such tokenizer file"):
        TextTask(tiny(tmp_path, data=str(text), tokenizer=str(tmp_path / "none.json"), max_len=16))
    with pytest.raises(ValueError, match="'tokenizer' must be '' for star-graph data"):
        tiny(tmp_path, tokenizer=str(tok)).check()


def test_max_doc_tokens_drops_long_documents(corpus, tmp_path, capsys):
    text, tok, _ = corpus
    out = tmp_path / "short"
    assert cli(["tokenize", str(text), "--out", str(out), "--tokenizer", str(tok), "--max-doc-tokens", "20",
                "--no-progress"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["dropped_documents"] > 0 and m["documents"] + m["dropped_documents"] == 60
    assert f"dropped {m['dropped_documents']} documents longer than 20 tokens" in capsys.readouterr().out
    offsets = np.fromfile(out / "offsets.bin", dtype="<i8")
    assert np.diff(offsets).max() <= 20
    # training on it names the documents the tokenising dropped, with or without its own max_doc_tokens
    earlier = f"{m['dropped_documents']} documents were dropped when the corpus was tokenised"
    for extra, line in (({}, earlier), ({"max_doc_tokens": 12}, "max_doc_tokens: dropped ")):
        TextTask(tiny(tmp_path, data=str(out), max_len=24, **extra))
        err = capsys.readouterr().err
        assert line in err and earlier in err, err
    kept = np.diff(offsets)
    assert f"dropped {(kept > 12).sum()} of {len(kept)} documents longer than 12 tokens ({earlier}" in err


def test_uint32_for_a_vocabulary_over_65536(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>"] + sorted(alphabet))}
    vocab.update({f"x{k}": len(vocab) + k for k in range(70_000 - len(vocab))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<bos>", "<eos>"])
    tok.save(str(tmp_path / "big.json"))
    write_corpus(tmp_path / "t" / "a.txt", n_docs=10)
    out = tmp_path / "big"
    m = prep.tokenize_corpus(tmp_path / "t", out, tokenizer=tmp_path / "big.json")
    assert m["dtype"] == "uint32" and m["vocab_size"] == 70_000
    assert (out / "tokens.bin").stat().st_size == 4 * m["tokens"]
    raw = TextData(tmp_path / "t", load_tokenizer(tmp_path / "big.json"), 16, seed=1)
    assert same(rows(raw, batch_size=4, seed=1), rows(prep.prepared_text_data(out, 16, seed=1), batch_size=4, seed=1))


# ---------------------------------------------------------------------------------------------
# mixtures


@pytest.fixture(scope="module")
def two(tmp_path_factory, corpus):
    """Two prepared corpora of one tokenizer, with no document in common."""
    root = tmp_path_factory.mktemp("mix")
    tok = corpus[1]
    paths = []
    for k, words in enumerate((WORDS[:9], WORDS[9:])):
        write_corpus(root / f"t{k}" / "a.txt", n_docs=40, seed=k, words=words)
        prep.tokenize_corpus(root / f"t{k}", root / f"c{k}", tokenizer=tok)
        paths.append(root / f"c{k}")
    return paths


def test_mixture_draws_rows_by_weight(two, tmp_path):
    cfg = tiny(tmp_path, data=[[str(two[0]), 3], str(two[1])], max_len=16, batch_size=16)
    assert cfg.data == [[str(two[0]), 3.0], [str(two[1]), 1.0]]
    task = TextTask(cfg)
    mix = task.data
    assert isinstance(mix, prep.MixtureData) and mix.n_train == sum(p.n_train for p in mix.parts)
    drawn = np.concatenate([mix.draw(s, 16, cfg.seed) for s in range(400)])
    share = (drawn == 0).mean()  # 6400 draws at p = 0.75: sd 0.0054
    assert abs(share - 0.75) < 0.025, share
    # each row is a row of the corpus it drew, and batches are pure functions of (seed, step)
    sets = [{tuple(t[:n].tolist()) for t, n in zip(*p._train.gather(np.arange(p.n_train)))} for p in mix.parts]
    for s in (0, 7, 33):
        tokens, lengths = task.rows(s, 16)[:2]
        which = mix.draw(s, 16, cfg.seed)
        for r in range(16):
            assert tuple(tokens[r, :lengths[r]].tolist()) in sets[which[r]]
    again = TextTask(cfg)
    assert same([again.rows(s, 16)[:2] for s in (33, 0, 7)], [task.rows(s, 16)[:2] for s in (33, 0, 7)])
    # a corpus never repeats a row within a window of its size
    seen = {}
    for s in range(20):
        which = mix.draw(s, 16, cfg.seed)
        slots = s * 16 + np.arange(16)
        for c in (0, 1):
            for slot, row in zip(slots[which == c], mix._rows(c, slots[which == c], cfg.seed)):
                seen.setdefault((c, slot // mix.parts[c].n_train), []).append(row)
    assert all(len(v) == len(set(v)) for v in seen.values())
    # the held-out rows are both corpora's
    assert mix.n_held_out == sum(p.n_held_out for p in mix.parts) > 0


def test_a_mixtures_held_out_batches_take_the_corpora_in_turn(two, tmp_path):
    """Every held-out row of each corpus once, a batch of each corpus in turn (then the longer one's
    rest): eval_batches' first batches score every corpus (they scored the first one only: review
    helper-91), and the whole set's figure is the same."""
    cfg = tiny(tmp_path, data=[str(two[0]), str(two[1])], max_len=16, batch_size=1)
    mix = TextTask(cfg).data
    sizes = [p.n_held_out for p in mix.parts]
    assert min(sizes) >= 2
    key = lambda batch: [tuple(t[:n].tolist()) for t, n in zip(batch[0], batch[1])]
    each = [[key(b) for b in p.held_out_batches(1)] for p in mix.parts]
    got = [key(b) for b in mix.held_out_batches(1)]
    k = min(sizes)
    want = [row for pair in zip(each[0][:k], each[1][:k]) for row in pair] + each[0][k:] + each[1][k:]
    assert got == want
    first_two = TextTask(tiny(tmp_path, data=[str(two[0]), str(two[1])], max_len=16, batch_size=1, eval_batches=2))
    assert [key(r) for r in first_two.held_out()] == [each[0][0], each[1][0]]


def test_mixture_trains_and_resumes_from_a_yaml_list(two, tmp_path):
    yaml = tmp_path / "mix.yaml"
    # TINY's own steps, eval_every and ckpt_every left out (a key written twice is refused), and its
    # star-graph fields (a text run refuses them)
    base = "".join(line for line in TINY.read_text().splitlines(keepends=True)
                   if line.split(":")[0] not in ("steps", "eval_every", "ckpt_every", *star_fields_for(two)))
    yaml.write_text(base + f"data:\n  - [{two[0]}, 2]\n  - {two[1]}\nmax_len: 16\nsteps: 4\n"
                    f"eval_every: 2\nckpt_every: 2\nout_dir: {tmp_path / 'run'}\n")
    cfg = TrainConfig.load(yaml)
    assert cfg.data == [[str(two[0]), 2.0], [str(two[1]), 1.0]]
    train(cfg, stop_at=2)
    result = train(cfg, resume=True)
    assert math.isfinite(result["held_out_loss"])
    saved = json.loads((tmp_path / "run" / "data.json").read_text())
    assert [e["weight"] for e in saved["mixture"]] == pytest.approx([2 / 3, 1 / 3])


def test_mixture_needs_one_tokenizer(two, corpus, tmp_path):
    write_corpus(tmp_path / "t" / "a.txt", n_docs=30, seed=9)
    prep.tokenize_corpus(tmp_path / "t", tmp_path / "other", vocab_size=280)  # its own tokenizer
    cfg = tiny(tmp_path, data=[str(two[0]), str(tmp_path / "other")], max_len=16)
    with pytest.raises(ValueError, match=r"must share one tokenizer.*c0.*other"):
        TextTask(cfg)
    with pytest.raises(ValueError, match=r"is not a prepared corpus.*takes prepared corpora only"):
        TextTask(tiny(tmp_path, data=[str(two[0]), str(corpus[0])], max_len=16))


def test_huge_finite_mixture_weights_keep_their_ratio(two, tmp_path):
    """Weights 1e308 and 1e308 passed the finite check; their sum overflowed to inf and the first
    batch failed inside numpy ("probabilities do not sum to 1")."""
    task = TextTask(tiny(tmp_path, data=[[str(two[0]), 1e308], [str(two[1]), 1e308]], max_len=16))
    assert task.data.weights.tolist() == [0.5, 0.5]


def test_a_prepared_corpus_given_as_text_to_tokenise_is_named(corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"it is a prepared corpus .*give it as a run's data"):
        prep.tokenize_corpus(corpus[2], tmp_path / "again", tokenizer=corpus[1])


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf")])
def test_mixture_weights_must_be_finite_and_positive(two, tmp_path, weight):
    with pytest.raises(ValueError, match=r"config field 'data': the weight of .*c1.* must be a finite number > 0"):
        tiny(tmp_path, data=[str(two[0]), [str(two[1]), weight]]).check()


@pytest.mark.parametrize("data, match", [
    ([], "non-empty list"),
    (["star"], "star graphs are not mixed"),
    ([["a", "b"]], r"\[path, weight\] pair"),
    ([["a", 1, 2]], r"\[path, weight\] pair"),
    ([3], r"\[path, weight\] pair"),
])
def test_bad_data_lists_name_the_field(tmp_path, data, match):
    with pytest.raises(ValueError, match=r"config field 'data'.*" + match):
        tiny(tmp_path, data=data).check()


# ---------------------------------------------------------------------------------------------
# bad input


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _rehash(folder: Path):
    """Make the manifest agree with the files again (so that a deeper check is what fails)."""
    m = json.loads((folder / "manifest.json").read_text())
    tokens = (folder / "tokens.bin").read_bytes()
    m["sha256"]["tokens"] = hashlib.sha256(tokens).hexdigest()
    m["sha256"]["offsets"] = hashlib.sha256((folder / "offsets.bin").read_bytes()).hexdigest()
    m["block_sha256"] = [hashlib.sha256(tokens[i:i + m["block_bytes"]]).hexdigest()
                         for i in range(0, len(tokens), m["block_bytes"])]
    m["fingerprint"] = prep.fingerprint_of(m)
    (folder / "manifest.json").write_text(json.dumps(m))


def _edit(folder: Path, **fields):
    m = json.loads((folder / "manifest.json").read_text())
    m.update(fields)
    (folder / "manifest.json").write_text(json.dumps(m))


def _poke(path: Path, index: int, value: int, dtype="<u2"):
    a = np.fromfile(path, dtype=dtype)
    a[index] = value
    a.tofile(path)


@pytest.mark.parametrize("case, match", [
    ("not_json", r"manifest\.json: corrupt manifest \(not JSON"),
    ("not_object", r"corrupt manifest \(a JSON list"),
    ("bad_dtype", r"corrupt manifest: dtype must be"),
    ("newer", r"format version 2 is newer"),
    ("edited", r"fingerprint does not match its content"),
    ("no_manifest", r"is not a prepared corpus: it holds no manifest\.json"),
    ("short_tokens", r"tokens\.bin: \d+ bytes, but the manifest's .* make \d+"),
    ("missing_offsets", r"offsets\.bin: missing"),
    ("tokens_changed", r"tokens\.bin: block 0 .* does not match its SHA-256"),
    ("offsets_changed", r"offsets\.bin: its SHA-256 does not match"),
    ("tokenizer_changed", r"tokenizer\.json: its SHA-256 does not match"),
    ("unsorted_offsets", r"offsets\.bin: offsets are not sorted: document 3 ends at"),
    ("first_offset", r"offsets\.bin: the first document starts at 5"),
    ("id_over_vocab", r"tokens\.bin: token id 65000 is outside the vocabulary"),
    # a corpus tokenised before tokenize refused special ids (stop 41) by a tokenizer whose model makes them
    ("special_id", r"tokens\.bin \(block 0\): documents' text encodes as special ids .*the first 2, <eos>"),
    # not in the fingerprint, read at every start: int('many') had been a bare error naming nothing
    ("dropped_not_int", r"corrupt manifest: dropped_documents must be absent, null or an int >= 0, got 'many'"),
])
def test_a_bad_prepared_corpus_is_a_clear_error(corpus, tmp_path, case, match):
    d = _copy(corpus[2], tmp_path / "c")
    m = json.loads((d / "manifest.json").read_text())
    if case == "not_json":
        (d / "manifest.json").write_text("{not json")
    elif case == "not_object":
        (d / "manifest.json").write_text("[1, 2]")
    elif case == "bad_dtype":
        _edit(d, dtype="int8")
    elif case == "newer":
        _edit(d, version=2)
    elif case == "edited":
        _edit(d, tokens=m["tokens"] - 1)
    elif case == "no_manifest":
        (d / "manifest.json").unlink()
    elif case == "short_tokens":
        (d / "tokens.bin").write_bytes((d / "tokens.bin").read_bytes()[:-2])
    elif case == "missing_offsets":
        (d / "offsets.bin").unlink()
    elif case == "tokens_changed":
        _poke(d / "tokens.bin", 5, 7)
    elif case == "offsets_changed":
        _poke(d / "offsets.bin", 3, 4, dtype="<i8")
    elif case == "tokenizer_changed":
        (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text().replace("\n", "\n "))
    elif case == "unsorted_offsets":
        off = np.fromfile(d / "offsets.bin", dtype="<i8")
        off[4] = off[3] - 1
        off.tofile(d / "offsets.bin")
        _rehash(d)
    elif case == "first_offset":
        _poke(d / "offsets.bin", 0, 5, dtype="<i8")
        _rehash(d)
    elif case == "id_over_vocab":
        _poke(d / "tokens.bin", 9, 65000)
        _rehash(d)
    elif case == "special_id":
        _poke(d / "tokens.bin", 9, m["special_ids"]["<eos>"])
        _rehash(d)
    elif case == "dropped_not_int":
        _edit(d, dropped_documents="many")
    with pytest.raises(ValueError, match=match):
        prep.prepared_text_data(d, 16)
    through_config = "no manifest.json: not a prepared corpus either" if case == "no_manifest" else match
    with pytest.raises((ValueError, FileNotFoundError), match=through_config):  # and through the config, before training starts
        train(tiny(tmp_path / "run", data=str(d), max_len=16))
    assert not (tmp_path / "run" / "tokenizer.json").exists()


def test_an_id_outside_the_vocabulary_in_an_unchecked_block_fails_when_read(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "BLOCK_BYTES", 64)  # many blocks
    out = tmp_path / "c"
    prep.tokenize_corpus(corpus[0], out, tokenizer=corpus[1])
    n = json.loads((out / "manifest.json").read_text())["tokens"]
    _poke(out / "tokens.bin", n // 2, 65000)
    _rehash(out)
    monkeypatch.setattr(prep, "VERIFY_ALL_BYTES", 0)  # opening checks the first and last blocks only
    monkeypatch.setattr(prep, "VERIFY_BLOCKS", 0)
    data = prep.prepared_text_data(out, 16, held_out=0)
    with pytest.raises(ValueError, match=r"c: token id 65000 is outside the vocabulary 0\.\.\d+ \(the token file is corrupt"):
        for s in range(data.n_train // 8 + 1):
            data.batch(s, 8, 0)
    monkeypatch.setattr(prep, "VERIFY_ALL_BYTES", 1 << 26)
    with pytest.raises(ValueError, match="token id 65000"):
        prep.prepared_text_data(out, 16)


def test_a_special_id_in_an_unchecked_block_fails_when_read(corpus, tmp_path, monkeypatch):
    """An EOS inside a document of a corpus tokenised before tokenize refused special ids, in a block
    that opening does not verify, stops the batch that reads it (it would have ended a row early)."""
    monkeypatch.setattr(prep, "BLOCK_BYTES", 64)
    out = tmp_path / "c"
    prep.tokenize_corpus(corpus[0], out, tokenizer=corpus[1])
    m = json.loads((out / "manifest.json").read_text())
    _poke(out / "tokens.bin", m["tokens"] // 2, m["special_ids"]["<eos>"])
    _rehash(out)
    monkeypatch.setattr(prep, "VERIFY_ALL_BYTES", 0)
    monkeypatch.setattr(prep, "VERIFY_BLOCKS", 0)
    data = prep.prepared_text_data(out, 16, held_out=0)
    with pytest.raises(ValueError, match=r"c: token id 2 inside a document is a special id"):
        for s in range(data.n_train // 8 + 1):
            data.batch(s, 8, 0)


def test_the_output_folder_is_written_atomically_and_never_clobbered(corpus, tmp_path, capsys):
    text, tok, _ = corpus
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    assert cli(["tokenize", str(text), "--out", str(other), "--tokenizer", str(tok), "--no-progress"]) == 2
    assert "--out" in capsys.readouterr().err and (other / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    prep.tokenize_corpus(text, empty, tokenizer=tok)
    first = json.loads((empty / "manifest.json").read_text())
    prep.tokenize_corpus(text, empty, tokenizer=tok, max_doc_tokens=10)  # a prepared corpus is replaced
    assert json.loads((empty / "manifest.json").read_text())["documents"] < first["documents"]
    with pytest.raises(ValueError, match="max_doc_tokens=1"):  # every document too long: nothing written
        prep.tokenize_corpus(text, tmp_path / "none", tokenizer=tok, max_doc_tokens=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "mine"]  # no temporary folder left
    for argv, match in ((["--tokenizer", str(tmp_path / "no.json")], "--tokenizer: no such tokenizer file"),
                        (["--vocab", "100"], "--vocab must be an int from 259"),
                        (["--vocab", "0"], "--vocab must be an int from 259"),  # argparse said ">= 1" (the real least: 259)
                        # argparse took them: HF tokenizers' trainer panicked (2**63: a traceback) or
                        # aborted the process reserving 70 GB (10**9)
                        (["--vocab", str(2**63)], "to 1048576"), (["--vocab", str(10**9)], "to 1048576"),
                        (["--vocab", "300", "--tokenizer", str(tok)], "give one of them")):
        assert cli(["tokenize", str(text), "--out", str(tmp_path / "x"), "--no-progress", *argv]) == 2
        assert match in capsys.readouterr().err
    assert cli(["tokenize", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    assert "no such file or folder" in capsys.readouterr().err


def test_a_prepared_corpus_and_another_tokenizer_disagree(corpus, tmp_path):
    text, tok, out = corpus
    other = tmp_path / "other.json"
    save_tokenizer(train_bpe(text, vocab_size=270), other)
    with pytest.raises(ValueError, match="config field 'tokenizer' .* is not the tokenizer the prepared corpus"):
        TextTask(tiny(tmp_path, data=str(out), tokenizer=str(other), max_len=16))
    TextTask(tiny(tmp_path, data=str(out), tokenizer=str(tok), max_len=16))  # the same one: fine


def test_the_command_line_and_bpe_training(tmp_path):
    write_corpus(tmp_path / "t" / "a.txt", n_docs=30)
    run = subprocess.run([sys.executable, "-m", "bst_fast", "tokenize", str(tmp_path / "t"), "--out",
                          str(tmp_path / "c"), "--vocab", "280", "--no-progress"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "30 documents" in run.stdout and "uint16" in run.stdout
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    # the tokenizer trained is the one a text run trains
    assert load_tokenizer(tmp_path / "c" / "tokenizer.json").to_str() == train_bpe(tmp_path / "t", 280).to_str()
    assert m["tokenizer_origin"] == {"trained": {"vocab_size": 280, "sample_bytes": None}}
    # (300 bytes of these 3.3 kB sampled no document: the BPE trained on nothing, now refused)
    sampled = prep.tokenize_corpus(tmp_path / "t", tmp_path / "s", vocab_size=280, bpe_sample_bytes=1000)
    assert sampled["tokenizer_origin"]["trained"]["sample_bytes"] == 1000
    assert sampled["vocab_size"] > 259  # it learnt merges from the documents sampled


def test_the_whitespace_set_is_pythons():
    """The piece split's whitespace class is every character str.isspace holds but the space."""
    from bst_fast.data import encode

    cls = re.compile(f"[{encode._WHITESPACE}]")
    want = {c for c in range(sys.maxunicode + 1) if chr(c).isspace() and c != 32}
    assert {c for c in range(sys.maxunicode + 1) if cls.match(chr(c))} == want


def test_the_ids_do_not_depend_on_the_workers(corpus, tmp_path):
    text, tok, out = corpus
    for workers in (0, 2):
        m = prep.tokenize_corpus(text, tmp_path / f"w{workers}", tokenizer=tok, workers=workers)
        assert m["fingerprint"] == json.loads((out / "manifest.json").read_text())["fingerprint"]


def test_the_bench_runs(tmp_path):
    out = tmp_path / "r.md"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "text_data.py"), "--size-mb", "0.3", "--dir",
                          str(tmp_path / "b"), "--hf-mb", "0.1", "--steps", "5", "--workers", "0", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert "`tokenize --vocab 1000`" in text and "batches/s" in text and "peak RSS" in text


def test_tokenize_never_deletes_files_that_are_not_a_corpus(corpus, tmp_path, capsys, monkeypatch):
    """Any folder with a manifest.json was taken for a prepared corpus and replaced, deleting the
    rest: another tool's folder, the input corpus itself (--out of its own folder), or a user's
    notes inside a corpus. Such a folder is refused, and one of raw text trains as raw text."""
    text, tok, _ = corpus
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text(text.read_text())
    (raw / "manifest.json").write_text('{"name": "my dataset"}')  # another tool's manifest
    assert cli(["tokenize", str(raw), "--out", str(raw), "--tokenizer", str(tok), "--no-progress"]) == 2
    assert "not a prepared corpus" in capsys.readouterr().err
    assert sorted(p.name for p in raw.iterdir()) == ["a.txt", "manifest.json"]
    assert TextData(str(raw), max_len=24, tokenizer=load_tokenizer(tok)).n_documents > 0  # raw text, not a corpus
    ours = tmp_path / "ours"
    prep.tokenize_corpus(text, ours, tokenizer=tok)
    (ours / "NOTES.md").write_text("keep me")
    with pytest.raises(ValueError, match="also holds other files .*'NOTES.md'"):
        prep.tokenize_corpus(text, ours, tokenizer=tok)
    assert (ours / "NOTES.md").read_text() == "keep me" and prep.is_prepared(ours)
    # a file of a prepared corpus given as data trained on its JSON as text
    with pytest.raises(ValueError, match="is a file of the prepared corpus .*give the folder"):
        TextData(str(ours / "manifest.json"), max_len=24, tokenizer=load_tokenizer(tok))
    # --out . : replacing it left the caller's shell in a deleted folder (and before that the
    # temporary folder landed inside it); refused before any work, as is a folder holding it
    here = tmp_path / "here"
    (here / "sub").mkdir(parents=True)
    monkeypatch.chdir(here / "sub")
    for out in (".", "..", str(here)):
        with pytest.raises(ValueError, match="is the current folder or holds it"):
            prep.tokenize_corpus(text, out, tokenizer=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "ours", "raw"] and list(here.iterdir()) == [here / "sub"]
    # a corpus file name that is a folder of yours is not replaced either
    (ours / "NOTES.md").unlink()
    (ours / "tokens.bin").unlink()
    (ours / "tokens.bin").mkdir()
    (ours / "tokens.bin" / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="also holds other files .*'tokens.bin'"):
        prep.tokenize_corpus(text, ours, tokenizer=tok)
    # a damaged format value beside our token files is a corpus (reported corrupt), not raw text
    damaged = tmp_path / "damaged"
    prep.tokenize_corpus(text, damaged, tokenizer=tok)
    m = json.loads((damaged / "manifest.json").read_text())
    (damaged / "manifest.json").write_text(json.dumps(dict(m, format="bst_fast.prepard")))
    assert prep.is_prepared(damaged)
    with pytest.raises(ValueError, match="format"):
        prep.PreparedCorpus.open(damaged)


def test_a_killed_encoding_process_is_an_error_not_a_hang(corpus, tmp_path):
    """multiprocessing.Pool waited forever for a task whose worker died (the OOM killer); the
    executor reports it, and the temporary folder goes."""
    text, tok, _ = corpus
    code = f"""if 1:
        import os
        from bst_fast.data import prepared as prep
        def die(batch):  # the forked workers die at their first batch (a def: the executor pickles it)
            os._exit(9)
        prep._worker_encode = die
        try:
            prep.tokenize_corpus({str(text)!r}, {str(tmp_path / 'out')!r}, tokenizer={str(tok)!r}, workers=2)
        except RuntimeError as e:
            print("error:", e)
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "an encoding process died" in run.stdout, run.stdout + run.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_an_interrupt_while_workers_send_their_results_exits(tmp_path):
    """Ctrl-C during `tokenize --workers 2` printed "interrupted" and then hung at interpreter exit
    (2 of 25 tries at random times): a worker killed mid-send left a partial result in the pipe, and
    the executor's thread, which interpreter exit joins, waited for the rest. Results far larger than
    a pipe's buffer keep the workers mid-send when the interrupt comes (5 of 5 hung before the fix)."""
    code = """if 1:
        import signal
        import numpy as np
        from bst_fast.data import prepared as prep
        def init(*args):
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        def big(batch):
            return np.zeros(64 << 20, np.uint8)
        class Tok:
            def to_str(self):
                return ""
        def batches():
            for k in range(1000):
                if k == 6:
                    raise KeyboardInterrupt
                yield k
        prep._worker_init, prep._worker_encode = init, big
        try:
            for _ in prep._encoded(batches(), Tok(), np.dtype(np.uint16), 2):
                pass
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout == "interrupted\n", run.stdout + run.stderr[-2000:]


def test_the_piece_cache_is_bounded_in_bytes(monkeypatch):
    """Text without spaces makes each paragraph one piece: the cache held ~4x the text in 1M entries
    before it was bounded in bytes too."""
    from bst_fast.data import encode

    tok = train_bpe_tokenizer_for_cache()
    enc = PieceEncoder(tok, np.uint16)
    monkeypatch.setattr(encode, "MAX_CACHE_BYTES", 50_000)
    docs = ["".join(chr(0x4E00 + (k * 7 + i) % 2000) for i in range(200)) for k in range(400)]
    for k in range(0, 400, 50):
        flat, lengths = enc.encode(docs[k:k + 50])
        assert enc._cache_bytes <= 50_000 + 50 * 2000  # emptied once over the bound, before a batch
    want = [e.ids for e in tok.encode_batch(docs[-50:], add_special_tokens=False)]
    assert np.array_equal(flat, np.concatenate([np.asarray(w, np.uint16) for w in want]))


def train_bpe_tokenizer_for_cache():
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.txt"
        p.write_text("\n\n".join("".join(chr(0x4E00 + i % 300) for i in range(k, k + 60)) for k in range(200)))
        return train_bpe(p, vocab_size=400)


@pytest.mark.parametrize("held_at", ["mkdir", "written", "fsync"])
def test_sigterm_during_tokenize_deletes_the_temporary_folder(corpus, tmp_path, held_at):
    """A scheduler's SIGTERM unwinds like an interrupt: the hidden temporary folder is deleted (it
    stayed, as big as tokens.bin, and nothing cleaned it later), and the exit status says why. The
    command is held until the signal comes, just after making the folder (a SIGTERM there, before
    the handler was in place, left it: review helper-88) or after writing its ids into it (a race
    on the encoding's duration, the signal sent once the command had finished, could fail the test)."""
    import signal
    import time

    text, tok, _ = corpus
    script = tmp_path / "held.py"
    script.write_text(f"""import sys, time
from pathlib import Path
import bst_fast.data.prepared as prep
from bst_fast.__main__ import cli
def hold(folder):
    (folder / "held").write_text("")
    time.sleep(300)  # the test's SIGTERM ends this
real_write, real_mkdir = prep._write, Path.mkdir
def held_write(tmp, *args, **kwargs):
    manifest = real_write(tmp, *args, **kwargs)
    hold(tmp)
    return manifest
def held_mkdir(self, *args, **kwargs):
    real_mkdir(self, *args, **kwargs)
    if self.name.startswith(".out.tmp-"):
        hold(self)
real_fsync = prep.fsync
def held_fsync(path):
    real_fsync(path)
    if path.name == prep.MANIFEST:
        hold(path.parent)
if {held_at!r} == "written":
    prep._write = held_write
elif {held_at!r} == "fsync":
    prep.fsync = held_fsync
else:
    Path.mkdir = held_mkdir
sys.argv = ["bst-fast", "tokenize", {str(text)!r}, "--out", {str(tmp_path / "out")!r}, "--tokenizer", {str(tok)!r},
            "--no-progress", "--workers", "0"]
sys.exit(cli())
""")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".out.tmp-*/held")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    if proc.poll() is not None or not list(tmp_path.glob(".out.tmp-*/held")):
        proc.kill()
        pytest.fail(f"tokenize was not held in its temporary folder: {proc.communicate()[1][-2000:]}")
    # held past the mkdir, the folder holds the corpus's ids
    assert bool(list(tmp_path.glob(".out.tmp-*/" + prep.TOKENS))) == (held_at != "mkdir")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held.py"]
    if held_at != "written":
        return  # the rest holds for all
    # only around the writing, in the main thread, where SIGTERM has its default action
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    seen = []
    with prep._terminate_unwinds():
        seen.append(signal.getsignal(signal.SIGTERM))
    assert seen[0] not in (signal.SIG_DFL, None) and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    import threading

    errors = []

    def in_a_thread():  # signal.signal raised "signal only works in main thread" there
        try:
            with prep._terminate_unwinds():
                pass
        except Exception as e:
            errors.append(e)

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert errors == []


def test_many_files_read_their_folders_manifest_once(tmp_path, monkeypatch):
    """Each file given as data checks that its folder is not a prepared corpus: once per folder (2000
    files beside a 4.5 MB manifest of another tool's took 345 s, a parse per file)."""
    for k in range(30):
        (tmp_path / f"{k}.txt").write_text("a b c")
    (tmp_path / "manifest.json").write_text('{"files": []}')
    calls = []
    real = text_mod.is_prepared
    monkeypatch.setattr(text_mod, "is_prepared", lambda p: calls.append(p) or real(p))
    assert len(text_mod._text_files(sorted(tmp_path.glob("*.txt")))) == 30 and calls == [tmp_path]


def test_the_summary_names_documents_encoded_to_no_token(corpus, capsys):
    """Documents the tokenizer encodes to nothing are dropped; the manifest counted them, and the
    summary line said nothing."""
    _, _, out = corpus
    m = json.loads((out / "manifest.json").read_text())
    prep.print_summary(dict(m, empty_documents=3), out, 1.0)
    assert "dropped 3 documents the tokenizer encodes to no token" in capsys.readouterr().out
    prep.print_summary(dict(m, empty_documents=0), out, 1.0)
    assert "no token" not in capsys.readouterr().out


def test_a_bpe_sample_of_no_document_and_too_many_workers_are_refused(tmp_path, capsys):
    """--bpe-sample-mb 1e-12 was raised to 1 byte, silently, and the BPE then trained on no document
    (vocab 259, no warning); --workers 2**63 was an OverflowError, exit 1."""
    write_corpus(tmp_path / "t" / "a.txt", n_docs=30)
    out = str(tmp_path / "c")
    for argv, match in ((["--bpe-sample-mb", "1e-12"], "--bpe-sample-mb must be at least 1e-6"),
                        (["--bpe-sample-mb", "1e-5"], "sample_bytes 10 .*--bpe-sample-mb.* sampled no document"),
                        (["--workers", str(2**63)], "--workers must be an int from 0 to 4096"),
                        (["--workers", "-1"], "--workers must be an int >= 0")):
        assert cli(["tokenize", str(tmp_path / "t"), "--out", out, "--no-progress", *argv]) == 2, argv
        assert re.search(match, capsys.readouterr().err), argv
    with pytest.raises(ValueError, match="sampled no document"):  # the API: train_bpe itself
        train_bpe(tmp_path / "t", 280, sample_bytes=1)
    with pytest.raises(ValueError, match="workers must be an int from 0 to 4096"):
        prep.tokenize_corpus(tmp_path / "t", out, workers=2**63)
    assert not (tmp_path / "c").exists()


def test_tokenize_corpus_refuses_what_a_given_tokenizer_would_ignore(corpus, tmp_path):
    """With tokenizer= given, vocab_size and bpe_sample_bytes were silently ignored (the CLI refused
    the combination); a tokenizer that is none of the kinds taken was an AttributeError."""
    text, tok, _ = corpus
    for kw, match in ((dict(vocab_size=5000), "vocab_size=5000 applies to a BPE tokenizer trained here"),
                      (dict(bpe_sample_bytes=300), "bpe_sample_bytes=300 applies to a BPE tokenizer trained here")):
        with pytest.raises(ValueError, match=match):
            prep.tokenize_corpus(text, tmp_path / "x", tokenizer=tok, **kw)
    with pytest.raises(ValueError, match="tokenizer must be None .* got int 5"):
        prep.tokenize_corpus(text, tmp_path / "x", tokenizer=5)
    assert not (tmp_path / "x").exists()
    m = prep.tokenize_corpus(text, tmp_path / "y", tokenizer=tok)  # vocab_size left out: fine
    assert m["vocab_size"] == load_tokenizer(tok).get_vocab_size()


def test_a_mixture_refuses_one_corpus_twice_wrong_names_and_a_step_past_int64(two, tmp_path):
    """The same prepared corpus listed twice (or through a link, or a copy) was accepted, trained on
    with the sum of its weights and held out twice (raw text refuses one file twice); a names list
    of the wrong length was cut by zip; batch(2**62, 4, 0) was an OverflowError."""
    link = tmp_path / "link"
    link.symlink_to(two[0])
    copy = tmp_path / "copy"
    shutil.copytree(two[0], copy)
    for again in (two[0], link, copy):
        with pytest.raises(ValueError, match=r"config field 'data': .*c0 and .* are the same corpus"):
            prep.open_data([[str(two[0]), 1], [str(two[1]), 1], [str(again), 2]], 16)
    parts = [prep.prepared_text_data(p, 16) for p in two]
    with pytest.raises(ValueError, match="are the same corpus"):
        prep.MixtureData([parts[0], parts[1], parts[0]], [1, 1, 1])
    for names in (["a"], ["a", "b", "c"], [1, 2]):
        with pytest.raises(ValueError, match="a mixture of 2 corpora needs 2 names"):
            prep.MixtureData(parts, [1, 1], names=names)
    mix = prep.MixtureData(parts, [1, 1])
    top = np.iinfo(np.int64).max // 4
    for step in (2**62, np.int64(2**62), top):
        with pytest.raises(ValueError, match=f"step must be below {top} at batch_size 4"):
            mix.batch(step, 4, 0)
    assert mix.batch(top - 1, 4, 0)[0].shape[0] == 4  # the last step whose slots fit


def test_text_data_refuses_paths_that_are_not_paths(corpus):
    """TextData(None, ...) was "'NoneType' object is not iterable"; an empty list "no documents"."""
    text, tok, _ = corpus
    tokenizer = load_tokenizer(tok)
    for paths, says in ((None, "got NoneType None"), (5, "got int 5"), (b"a.txt", "got bytes"),
                        ([str(text), None], "one is NoneType None"), ([], "no data paths given")):
        with pytest.raises(ValueError, match=says):
            TextData(paths, tokenizer, 32)
    assert TextData((str(text),), tokenizer, 32).n_documents == TextData(text, tokenizer, 32).n_documents


def test_a_mixture_resumes_with_its_corpora_by_another_path(two, corpus, tmp_path):
    """A mixture's data.json holds each corpus's path as written: a resume naming one by a link, or
    with a trailing '/', was refused as another corpus though the corpora were the same. The corpora's
    fingerprints and weights, in order, decide now; another corpus, weight or order is still refused."""
    link = tmp_path / "link"
    link.symlink_to(two[0])
    run = dict(max_len=16, steps=4, eval_every=0, ckpt_every=0)
    d = tmp_path / "run"
    train(tiny(d, data=[[str(two[0]), 1], [str(two[1]), 2]], **run), stop_at=2)
    # other weights alone are named as such (the message blamed the corpora, quoting both fingerprints)
    with pytest.raises(ValueError, match=r"the mixture's corpora are this run's, but not its weights, normalised: "
                                         r"then \[0.333\d*, 0.666\d*\], now \[0.5, 0.5\]"):
        train(tiny(d, data=[[str(two[0]), 2], [str(two[1]), 2]], **run), resume=True)
    for other in ([[str(two[1]), 2], [str(two[0]), 1]], [[str(two[0]), 1], [str(corpus[2]), 2]], [[str(two[0]), 1]]):
        with pytest.raises(ValueError, match="the corpus at .* is not the one this run was trained on"):
            train(tiny(d, data=other, **run), resume=True)
    train(tiny(d, data=[[str(link), 1], [str(two[1]), 2]], **run), resume=True, stop_at=3)
    train(tiny(d, data=[[str(two[0]) + "/", 2], [str(two[1]), 4]], **run), resume=True)  # the same ratio
    assert (d / "checkpoints" / "latest").read_text() == "step-00000004"
    # data.json still names the corpora (as the run's config gives them)
    saved = json.loads((d / "checkpoints" / "step-00000004" / "data.json").read_text())
    assert [e["corpus"] for e in saved["mixture"]] == [str(two[0]) + "/", str(two[1])]


def test_a_best_is_kept_when_the_corpus_is_named_by_another_path(corpus, tmp_path):
    """best_so_far compared `data` as a string while a resume lets a text run name its corpus by
    another path: resumed through a link, the run forgot its best and a worse figure replaced it."""
    out = corpus[2]
    link = tmp_path / "link"
    link.symlink_to(out)
    d = tmp_path / "run"
    train(tiny(d, data=str(out), max_len=16, steps=6, eval_every=1, ckpt_every=3, keep_best="held_out_loss"),
          stop_at=5)
    best = json.loads((d / "checkpoints" / "best" / "best.json").read_text())
    assert best["step"] > 3  # after the resumed step: its config is compared
    then = json.loads((d / "checkpoints" / "step-00000003" / "config.json").read_text())
    for data in (str(out), str(link), str(out) + "/"):
        resumed = TrainConfig.from_dict({**then, "data": data})  # as the trainer has it
        assert checkpoint_mod.best_so_far(d, "held_out_loss", 3, resumed) == best["value"], data
    # a change that leaves another trajectory still drops it
    assert checkpoint_mod.best_so_far(d, "held_out_loss", 3, TrainConfig.from_dict({**then, "seed": 9})) is None


def test_a_resume_hashes_each_checkpoint_file_at_most_as_often_as_before(corpus, tmp_path, monkeypatch):
    """The config was compared twice on a resume, each time through read_config's full verify: one
    more sha256 of the whole checkpoint (weights and optimizer state) per resume, on every rank. Each
    file is hashed at most as often as before the comparison was split (d9791d8): weights, state and
    config twice (the config's read and the load), the tokenizer and data.json three times."""
    d = tmp_path / "run"
    run = dict(data=str(corpus[2]), max_len=16, steps=3, eval_every=0, ckpt_every=0)
    train(tiny(d, **run), stop_at=2)
    ckpt = d / "checkpoints" / "step-00000002"
    counts = {}
    hash_file = checkpoint_mod.sha256

    def counting(path, *a, **k):
        if Path(path).parent == ckpt:
            counts[Path(path).name] = counts.get(Path(path).name, 0) + 1
        return hash_file(path, *a, **k)

    monkeypatch.setattr(checkpoint_mod, "sha256", counting)
    train(tiny(d, **run), resume=True)
    before = {"model.safetensors": 2, "state.pt": 2, "config.json": 2, "tokenizer.json": 3, "data.json": 3}
    assert set(counts) == set(before)  # every file is verified
    assert all(counts[name] <= n for name, n in before.items()), counts


def test_the_summary_says_when_the_bpe_found_fewer_entries_than_asked(tmp_path, capsys):
    """A corpus of few distinct words cannot fill the vocabulary asked for: the summary says so
    (the model silently trained on the smaller one: review helper-90); a full one says nothing."""
    text = tmp_path / "few.txt"
    text.write_text("\n\n".join("the cat sat on the mat" for _ in range(50)))
    manifest = prep.tokenize_corpus(text, tmp_path / "few.prep", vocab_size=2000, progress=False)
    assert manifest["vocab_size"] < 2000
    prep.print_summary(manifest, "few.prep", 1.0)
    assert f"a BPE of vocab 2000 was asked for, and the text had merges for {manifest['vocab_size']} only" \
        in capsys.readouterr().out
    prep.print_summary({**manifest, "tokenizer_origin": {"trained": {"vocab_size": manifest["vocab_size"]}}}, "x", 1.0)
    assert "was asked for" not in capsys.readouterr().out
    # a sample's few pieces are named as the cause, not the corpus's (review helper-91)
    prep.print_summary({**manifest, "tokenizer_origin": {"trained": {"vocab_size": 2000, "sample_bytes": 5000}}}, "x", 1.0)
    assert "asked for, and the --bpe-sample-mb sample had merges for" in capsys.readouterr().out


def test_tokenize_never_removes_a_temporary_folder_it_did_not_make(corpus, tmp_path, monkeypatch):
    """A temporary name already taken (another process's folder) is an error, and that folder stays
    (the clean-up removed it: review helper-91)."""
    text, tok, _ = corpus
    monkeypatch.setattr(prep.secrets, "token_hex", lambda n: "deadbeef")
    theirs = tmp_path / f".out.tmp-{os.getpid()}-deadbeef"
    theirs.mkdir()
    (theirs / "theirs.bin").write_bytes(b"x")
    with pytest.raises(FileExistsError):
        prep.tokenize_corpus(text, tmp_path / "out", tokenizer=str(tok), progress=False)
    assert (theirs / "theirs.bin").read_bytes() == b"x" and not (tmp_path / "out").exists()


def test_an_interrupt_between_the_renames_puts_the_old_corpus_back(corpus, tmp_path, monkeypatch):
    """Replacing a prepared corpus moves the old one aside, then the new one in: an interrupt between
    the two renames moves the old one back (the clean-up then deleted the new one, the old one left
    under a hidden name)."""
    text, tok, _ = corpus
    out = tmp_path / "out"
    first = prep.tokenize_corpus(text, out, tokenizer=str(tok), progress=False)
    real = os.rename
    def interrupted(a, b):
        if Path(a).name.startswith(".out.tmp-"):
            raise KeyboardInterrupt
        real(a, b)
    monkeypatch.setattr(prep.os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.tokenize_corpus(text, out, tokenizer=str(tok), progress=False)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / prep.MANIFEST).read_text())["fingerprint"] == first["fingerprint"]


def test_encoding_workers_die_with_a_killed_tokenize(tmp_path):
    """A SIGKILL of `tokenize` (or the OOM killer's) left its encoding workers alive for ever,
    blocked on the result pipe their siblings hold open (review helper-105): each worker asks the
    kernel to kill it when its parent dies (Linux)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    import signal
    import time

    code = """if 1:
        import os, signal, sys, time
        import numpy as np
        from bst_fast.data import prepared as prep
        def init(*args):
            prep._die_with(args[-1])  # the real initializer's first step, with its parent's pid
        def slow(batch):
            print("worker", os.getpid(), flush=True)
            time.sleep(120)
        class Tok:
            def to_str(self):
                return ""
        prep._worker_init, prep._worker_encode = init, slow
        for _ in prep._encoded(iter(range(4)), Tok(), np.dtype(np.uint16), 2):
            pass
    """
    run = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    workers = {int(run.stdout.readline().split()[1]) for _ in range(2)}
    run.kill()
    run.wait()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().split(")")[-1].split()[0] != "Z"  # a zombie is gone, awaiting its reaper
        except FileNotFoundError:
            return False

    deadline = time.time() + 20
    while any(map(alive, workers)) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed parent"


def test_a_resume_compares_the_named_tokenizer_by_content_and_names_a_change_of_form(corpus, tmp_path):
    """A resume read the checkpoint's tokenizer but compared the field as a path: the same file by
    another path was refused, a dangling old path accepted; a raw run resumed on its own prepared
    corpus was told the corpus "is not the one this run was trained on" (review helper-105)."""
    text, tok, out = corpus
    run = dict(max_len=16, eval_every=0, ckpt_every=0)
    d = tmp_path / "run"
    train(tiny(d, data=str(text), tokenizer=str(tok), steps=2, **run))
    moved = tmp_path / "moved.json"
    shutil.copy(tok, moved)
    train(tiny(d, data=str(text), tokenizer=str(moved), steps=3, **run), resume=True)  # the same tokenizer
    train(tiny(d, data=str(text), tokenizer="", steps=4, **run), resume=True)  # the checkpoint carries it
    other = tmp_path / "other.json"
    save_tokenizer(train_bpe(text, vocab_size=280), other)
    with pytest.raises(ValueError, match=r"config field 'tokenizer' \(.*other.json\) is not the tokenizer checkpoint"):
        train(tiny(d, data=str(text), tokenizer=str(other), steps=5, **run), resume=True)
    with pytest.raises(ValueError, match=r"trained on raw text and data now names a prepared corpus .* in the form it was "
                                         r"trained on"):
        train(tiny(d, data=str(out), steps=5, **run), resume=True)
    with pytest.raises(ValueError, match=r"another config.*Set them back to resume it, or start over \(--overwrite"):
        train(tiny(d, data=str(text), tokenizer=str(tok), steps=5, **{**run, "max_len": 20}), resume=True)


def test_tokenize_takes_max_doc_tokens_0_as_keep_all(corpus, tmp_path):
    text, tok, _ = corpus
    out = tmp_path / "all"
    assert cli(["tokenize", str(text), "--out", str(out), "--tokenizer", str(tok), "--max-doc-tokens", "0",
                "--no-progress"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["dropped_documents"] == 0 and m["max_doc_tokens"] is None and m["documents"] == 60
