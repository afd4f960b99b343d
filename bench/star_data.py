"""Star-graph generation speed (graphs/s, one core): raw generator, deduplicated splits, stream;
and the peak memory of building a training set of --memory-n rows against the set's own size.

    python bench/star_data.py [--n 200000] [--memory-n 2000000] [--json bench/results/star_data.json]
"""
import argparse
import json
import os
import platform
import time
import tracemalloc

import numpy as np

from bst_fast.data import StarGraphData, StarGraphStream, generate_star_graphs


def rate(fn, n, repeat=3):
    best = float("inf")
    for _ in range(repeat):  # best of a few: the machine is shared
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return n / best


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=200_000, help="graphs per timing")
    ap.add_argument("--nodes", type=int, default=50, help="N, as in the paper")
    ap.add_argument("--memory-n", type=int, default=2_000_000,
                    help="training rows of the set whose build peak is measured (0: skip)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    n, big_n = args.n, args.nodes
    rows = []
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, numpy {np.__version__}")
    print(f"{'graph':>8} {'L':>4} {'generate/s':>12} {'split/s':>12} {'stream(256)/s':>14} "
          f"{'set GB':>7} {'build peak':>10}")
    for d, l in [(2, 5), (5, 5), (2, 20)]:
        gen = rate(lambda: generate_star_graphs(n, d, l, big_n, seed=0), n)
        # StarGraphData: 10k test graphs, n train graphs with the test graphs excluded
        split = rate(lambda: StarGraphData(d, l, big_n, n_train=n, n_test=10_000, seed=0), n + 10_000,
                     repeat=1)
        data = StarGraphData(d, l, big_n, n_train=10, n_test=10_000, seed=0)
        stream = StarGraphStream(d, l, big_n, seed=0, exclude=data)
        steps = max(1, n // 256)
        st = rate(lambda: [stream.batch(k, 256) for k in range(steps)], steps * 256, repeat=1)
        set_gb = peak = float("nan")
        if args.memory_n:
            # numpy's allocations are traced, so this is the build's own peak, not the process's
            tracemalloc.start()
            big = StarGraphData(d, l, big_n, n_train=args.memory_n, n_test=10_000, seed=0)
            peak = tracemalloc.get_traced_memory()[1] / 1e9
            tracemalloc.stop()
            set_gb = sum(t.numel() * t.element_size() for t in (big.train_tokens, big.test_tokens)) / 1e9
            del big
        rows.append(dict(d=d, l=l, n_nodes=big_n, row_length=data.row_length,
                         generate_per_s=gen, split_per_s=split, stream_per_s=st,
                         memory_n=args.memory_n, set_gb=set_gb, build_peak_gb=peak))
        print(f"{f'G({d},{l})':>8} {data.row_length:>4} {gen:>12,.0f} {split:>12,.0f} {st:>14,.0f} "
              f"{set_gb:>7.2f} {peak / set_gb:>9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
