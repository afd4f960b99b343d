"""Pre-tokenised corpora: how fast `bst-fast tokenize` is and how much memory it takes, how long a
run takes to start on the prepared corpus, and how many batches a second it gives.

    python bench/text_data.py [--size-mb 1000] [--dir /tmp/bst_text_bench] [--out bench/results/text_data_cpu.md]

A corpus of synthetic short stories (sentences of Zipf-distributed words: a few hundred common
words and ~20k made-up ones, names, punctuation, some dialogue; 6 to 15 sentences, ~570 bytes a
story, or --sentences; blank lines between them) of --size-mb megabytes is written once to --dir and reused. Then, each in its own process
(peak RSS from wait4, the process's own high-water mark):

  1. `tokenize --vocab 1000` (trains the BPE tokenizer on the corpus, or on --bpe-sample-mb of it)
  2. `tokenize --tokenizer` the tokenizer of 1 (encoding only: the issue's "tokenising" figure)
  3. the tokenizer's own encode_batch on --hf-mb of the documents (what 2 replaces), for comparison
  4. a TextTask built on the prepared corpus (the training start-up), and batches/s of
     (batch_size 64, max_len 256) rows from the memory map (warm page cache: the corpus was just written)
  5. the same with `pack: true` (docs/data.md): the start-up with packing, the share of the batches'
     positions that are padding unpacked and packed, and packed batches/s
  6. the same with `pack: split` (rows cut from one stream of documents, read from the memory map)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("the a and to was he she it they his her said one day little big very happy sad girl boy dog "
          "cat bird tree park ball toy mom dad friend friends house garden sun rain play played wanted saw "
          "looked went came found made had could would not with on in at for of up down out there then when "
          "so but because what who how why all some many more time good bad fun nice kind new old red blue "
          "green yellow small tall fast slow smile smiled laugh laughed run ran jump jumped walk walked help "
          "helped give gave take took eat ate sleep slept is are be have has do did can will an this that "
          "you we i me my your our them their him from into over under after before again too very just "
          "now here where every something anything nothing always never together home school sky water "
          "flower apple cake box car boat fish hat shoe book door window bed table chair cup milk cookie").split()
NAMES = "Lily Tom Ben Sue Max Sara Anna Jack Mia Tim Lucy Sam Emma Leo Zoe Jake".split()
SYLLABLES = ("ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu pa pe pi po pu "
             "ra re ri ro ru sa se si so su ta te ti to tu va ve vi vo vu za ze zi zo zu sh ch th st tr "
             "pl gr fl an en in on un ar er ir or ur").split()


def make_vocab(rng, n_rare=20_000):
    rare = set()
    while len(rare) < n_rare:
        k = int(rng.integers(2, 5))
        rare.add("".join(rng.choice(SYLLABLES, size=k)))
    words = COMMON + sorted(rare)
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.05  # Zipf: the common words first
    return np.array(words, dtype=object), p / p.sum()


def sentence_pool(rng, n=200_000):
    words, p = make_vocab(rng)
    lens = rng.integers(4, 16, size=n)
    picks = words[rng.choice(len(words), size=int(lens.sum()), p=p)]
    names = rng.choice(NAMES, size=n)
    ends = rng.choice([".", ".", ".", "!", "?"], size=n)
    pool, at = [], 0
    for k, n_words in enumerate(lens):
        w = list(picks[at:at + n_words])
        at += n_words
        if k % 3 == 0:
            w[int(k % n_words)] = names[k]
        if k % 5 == 0 and n_words > 6:
            w[2] = w[2] + ","
        s = " ".join(w) + ends[k]
        s = s[0].upper() + s[1:]
        if k % 7 == 0:
            s = f'"{s}" said {names[(k + 1) % n]}.'
        pool.append(s)
    return pool


def write_corpus(path: Path, size_mb: float, seed: int = 0, sentences=(6, 16)):
    """The synthetic stories of sentences[0] to sentences[1] - 1 sentences, written once (reused
    when the file exists with the same size and shape)."""
    meta = path.with_suffix(".json")
    want = {"size_mb": size_mb, "seed": seed, "version": 1}
    if tuple(sentences) != (6, 16):  # the default's file and meta stay as they were
        want["sentences"] = list(sentences)
    if path.exists() and meta.exists() and json.loads(meta.read_text()) == want:
        return 0.0
    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    pool = sentence_pool(rng, n=int(min(200_000, max(2_000, size_mb * 1000))))
    target, size = int(size_mb * 1e6), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            n = min(4000, max(1, int(target / 500)))  # stories a write (a tiny corpus: a few)
            counts = rng.integers(*sentences, size=n)
            picks = rng.integers(0, len(pool), size=int(counts.sum()))
            stories, at = [], 0
            for c in counts:
                stories.append(" ".join(pool[i] for i in picks[at:at + c]))
                at += c
            text = "\n\n".join(stories) + "\n\n"
            f.write(text)
            size += len(text.encode())
    meta.write_text(json.dumps(want))
    return time.perf_counter() - t


SELF_RSS = ("import resource, sys, runpy; sys.argv = sys.argv[1:]; code = 0\n"
            "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code or 0\n"
            "s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)\n"
            "print('PEAK_RSS_KB', s.ru_maxrss, c.ru_maxrss, s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime,\n"
            "      file=sys.stderr)\n"
            "sys.exit(code)\n")


def tokenize(args_, env=None):
    """Run `python -m bst_fast tokenize ...` and read its peak RSS from the line it prints on exit."""
    cmd = [sys.executable, "-c", SELF_RSS, "bst_fast", "tokenize", *map(str, args_), "--no-progress"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"tokenize failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peak = [line.split()[1:] for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KB")][-1]
    return seconds, int(peak[0]) / 1024, int(peak[1]) / 1024, float(peak[2]) + float(peak[3]), proc.stdout.strip()


def hf_speed(text_path: Path, tok_path: Path, mb: float):
    """MB/s of the tokenizer's own encode_batch (all threads) on the first `mb` MB of documents."""
    from bst_fast.data import load_tokenizer
    from bst_fast.data.encode import PieceEncoder
    from bst_fast.data.text import _doc_batches, iter_documents

    tok = load_tokenizer(tok_path)
    docs, size = [], 0
    for d in iter_documents(text_path):
        docs.append(d)
        size += len(d.encode())
        if size >= mb * 1e6:
            break
    out = {"mb": mb}
    for name, fast in (("encode_batch", False), ("pieces", True)):
        enc = PieceEncoder(tok, np.uint16, fast=fast)
        t = time.perf_counter()
        for batch in _doc_batches(docs, 1 << 20):
            enc.encode(batch)
        out[name] = size / 1e6 / (time.perf_counter() - t)
    return out


def startup_and_batches(corpus: Path, steps: int, batch_size: int, max_len: int, pack=False):
    from bst_fast import TrainConfig
    from bst_fast.tasks import TextTask

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    task = TextTask(TrainConfig(data=str(corpus), max_len=max_len, batch_size=batch_size, progress=False, pack=pack))
    start = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    n_tokens = positions = 0
    for s in range(min(steps, task.data.n_train // batch_size)):  # one epoch at most: the padding figure's
        tokens, lengths = task.rows(s, batch_size)[:2]
        n_tokens += int(lengths.sum())
        positions += tokens.numel()
    dt = time.perf_counter() - t
    steps = min(steps, task.data.n_train // batch_size)
    padding = task.data.padding(batch_size)
    return {"startup_s": start, "train_rows": task.data.n_train, "documents": task.data.n_documents,
            "batches_per_s": steps / dt, "tokens_per_s": n_tokens / dt, "rss_before_mb": rss0, "rss_after_start_mb": rss1,
            "padding_unpacked": padding[0], "padding_packed": padding[1], "padding_timed": 1 - n_tokens / positions,
            "pack": pack, "max_len": max_len, "batch_size": batch_size}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=1000, help="corpus size (default 1000: 1 GB)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bst_text_bench"), help="where the corpus and its prepared folders go")
    ap.add_argument("--bpe-sample-mb", type=float, default=None,
                    help="step 1 trains the BPE on this many MB of the corpus (default: all of it)")
    ap.add_argument("--sentences", type=int, nargs=2, default=[6, 16], metavar=("MIN", "END"),
                    help="sentences a story, MIN to END - 1 (default 6 16: ~190 tokens; 1 4: short stories)")
    ap.add_argument("--skip-bpe", action="store_true", help="skip step 1 (a tokenizer must exist in --dir)")
    ap.add_argument("--hf-mb", type=float, default=20, help="MB of documents the encode_batch comparison reads")
    ap.add_argument("--steps", type=int, default=2000, help="batches timed in step 4")
    ap.add_argument("--workers", type=int, default=None, help="tokenize --workers (default: one per CPU)")
    ap.add_argument("--out", type=Path, default=None, help="write the results (markdown) here")
    ap.add_argument("--json", type=Path, default=None, help="and as JSON here")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    shape = "" if a.sentences == [6, 16] else f"_{a.sentences[0]}-{a.sentences[1]}"
    text = a.dir / f"stories_{a.size_mb:g}mb{shape}.txt"
    load0 = os.getloadavg()
    gen_s = write_corpus(text, a.size_mb, sentences=a.sentences)
    mb = text.stat().st_size / 1e6
    print(f"corpus: {text} ({mb:.0f} MB{'' if gen_s == 0 else f', written in {gen_s:.0f} s'})", flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, {platform.system()}",
           "corpus_mb": mb, "sentences": a.sentences, "load_before": load0}
    trained = a.dir / f"trained_{a.size_mb:g}mb{shape}"
    workers = [] if a.workers is None else ["--workers", a.workers]
    if not a.skip_bpe:
        extra = [] if a.bpe_sample_mb is None else ["--bpe-sample-mb", a.bpe_sample_mb]
        s, peak, child, cpu, line = tokenize([text, "--out", trained, "--vocab", 1000, *extra, *workers], env)
        m = json.loads((trained / "manifest.json").read_text())
        res["with_bpe"] = {"seconds": s, "cpu_s": cpu, "peak_rss_mb": peak, "worker_peak_rss_mb": child, "bpe_s": m["seconds"]["bpe"],
                           "encode_s": m["seconds"]["encode"], "mb_per_s": mb / s, "line": line,
                           "bpe_sample_mb": a.bpe_sample_mb}
        print("tokenize + BPE:", json.dumps(res["with_bpe"]), flush=True)
    tok = trained / "tokenizer.json"
    prepared = a.dir / f"prepared_{a.size_mb:g}mb{shape}"
    s, peak, child, cpu, line = tokenize([text, "--out", prepared, "--tokenizer", tok, *workers], env)
    m = json.loads((prepared / "manifest.json").read_text())
    res["encode_only"] = {"seconds": s, "cpu_s": cpu, "peak_rss_mb": peak, "worker_peak_rss_mb": child, "encode_s": m["seconds"]["encode"],
                          "mb_per_s": mb / s, "encode_mb_per_s": mb / m["seconds"]["encode"], "line": line,
                          "tokens": m["tokens"], "documents": m["documents"], "vocab_size": m["vocab_size"],
                          "dtype": m["dtype"], "encoder": m["encoder"]}
    print("tokenize --tokenizer:", json.dumps(res["encode_only"]), flush=True)
    res["compare"] = hf_speed(text, tok, a.hf_mb)
    print("encode MB/s on", a.hf_mb, "MB:", json.dumps(res["compare"]), flush=True)
    res["train_start"] = startup_and_batches(prepared, a.steps, 64, 256)
    print("start-up and batches:", json.dumps(res["train_start"]), flush=True)
    res["packed"] = startup_and_batches(prepared, a.steps, 64, 256, pack=True)
    print("packed:", json.dumps(res["packed"]), flush=True)
    res["split"] = startup_and_batches(prepared, a.steps, 64, 256, pack="split")
    print("split:", json.dumps(res["split"]), flush=True)
    res["load_after"] = os.getloadavg()
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(report(res))
    print(report(res))


def report(r) -> str:
    e, st = r["encode_only"], r["train_start"]
    lines = ["# Pre-tokenised corpora: `bst-fast tokenize` and training start-up (CPU)", "",
             f"Machine: {r['machine']}; load average {r['load_before'][0]:.1f} before, {r['load_after'][0]:.1f} after "
             f"(the machine was shared with other jobs: figures are lower bounds of an idle machine's).",
             f"Corpus: {r['corpus_mb']:.0f} MB of synthetic short stories (bench/text_data.py; "
             f"{r.get('sentences', [6, 16])[0]} to {r.get('sentences', [6, 16])[1] - 1} sentences), {e['documents']} documents, "
             f"{e['tokens']} tokens, vocab {e['vocab_size']} ({e['dtype']}).", "",
             "| command | wall s | MB/s (wall) | CPU s (all processes) | MB per CPU-s | peak RSS: main process | "
             "each encoding process (max) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    if "with_bpe" in r:
        b = r["with_bpe"]
        what = "all of it" if b["bpe_sample_mb"] is None else f"{b['bpe_sample_mb']:g} MB of it"
        lines.append(f"| `tokenize --vocab 1000` (BPE trained on {what}: {b['bpe_s']:.0f} s; encoding {b['encode_s']:.0f} s) "
                     f"| {b['seconds']:.0f} | {b['mb_per_s']:.1f} | {b['cpu_s']:.0f} | {r['corpus_mb'] / b['cpu_s']:.1f} "
                     f"| {b['peak_rss_mb']:.0f} MB | {b['worker_peak_rss_mb']:.0f} MB |")
    lines.append(f"| `tokenize --tokenizer tokenizer.json` (encoding {e['encode_s']:.0f} s: {e['encode_mb_per_s']:.1f} MB/s; "
                 f"encoder: {e['encoder']}) | {e['seconds']:.0f} | {e['mb_per_s']:.1f} | {e['cpu_s']:.0f} "
                 f"| {r['corpus_mb'] / e['cpu_s']:.1f} | {e['peak_rss_mb']:.0f} MB "
                 f"| {e['worker_peak_rss_mb']:.0f} MB |")
    c = r["compare"]
    lines += ["", f"Encoding speed in one process on the first {c['mb']:g} MB of documents (a cold cache): the "
                  f"tokenizer's own `encode_batch` (its threads) {c['encode_batch']:.1f} MB/s, bst_fast's piece "
                  f"cache (`bst_fast/data/encode.py`, the same ids) {c['pieces']:.1f} MB/s.", "",
              f"Training start-up on the prepared corpus (TextTask: open, check, split; nothing tokenised): "
              f"**{st['startup_s']:.2f} s**, RSS {st['rss_before_mb']:.0f} -> {st['rss_after_start_mb']:.0f} MB "
              f"({st['train_rows']} training rows). Batches from the memory map (64 rows, max_len 256, page cache warm): "
              f"**{st['batches_per_s']:.0f} batches/s** ({st['tokens_per_s'] / 1e6:.1f} M tokens/s).", ""]
    if "packed" in r:
        p = r["packed"]
        lines += [f"Packed (`pack: true`, rows of {p['max_len']}, batches of {p['batch_size']}): start-up "
                  f"**{p['startup_s']:.2f} s** ({st['train_rows']} rows packed into {p['train_rows']}); padding "
                  f"**{p['padding_unpacked']:.1%} of the positions unpacked, {p['padding_packed']:.1%} packed** (an epoch "
                  f"of batches, each padded to its longest row; {st['padding_timed']:.1%} and {p['padding_timed']:.1%} "
                  f"in the batches timed); {p['batches_per_s']:.0f} packed batches/s "
                  f"({p['tokens_per_s'] / 1e6:.1f} M tokens/s).", ""]
    if "split" in r:
        p = r["split"]
        lines += [f"Split (`pack: split`, rows of {p['max_len']}, batches of {p['batch_size']}): start-up "
                  f"**{p['startup_s']:.2f} s** ({st['train_rows']} rows joined and cut into {p['train_rows']}); padding "
                  f"**{p['padding_packed']:.2%}** of the positions ({p['padding_timed']:.2%} in the batches timed); "
                  f"{p['batches_per_s']:.0f} split batches/s ({p['tokens_per_s'] / 1e6:.1f} M tokens/s).", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
