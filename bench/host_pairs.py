"""Host time of a subsampled pair set (pairs=0.02) before the triton backend's kernels: the C++
sampler, prepare (draw, checks, the host pair set) and pair_list (sorted, counted, cut into chunks,
uploaded), at T = 256 for B = 32 (pairs-a) and B = 256 (the paper's step), on 1 and 2 threads. The meta
device stands in for the GPU (nothing is read back from it), so only the host's work is timed.

    python bench/host_pairs.py OUT.json
"""
import json
import statistics
import sys
import time
from pathlib import Path

# bench/ off sys.path (its profile.py would shadow the standard library's, which torch imports); the
# repository's bst_fast first
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bst_fast import _pairs  # noqa: E402

META = torch.device("meta")
T, FRACTION, REPS = 256, 0.02, 15
CHUNK = 40000  # pairs a chunk, about the triton backend's at the paper's shape


def median_ms(times):
    return statistics.median(times) * 1e3


def main(out_path):
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for B in (32, 256):
            lengths, start = torch.full((B,), T), torch.zeros(B, dtype=torch.long)
            f = torch.empty(B, T, 768, device=META)
            tokens = torch.empty(B, T, dtype=torch.long, device=META)
            sampler, prepare, listing = [], [], []
            for rep in range(REPS):
                t0 = time.perf_counter()
                p = _pairs.prepare(f, f, tokens, 1000, lengths=lengths, prefix_start=0, min_gap=2, max_gap=None,
                                   pairs=FRACTION, next_weight=0.5, reduction="mean",
                                   generator=torch.Generator().manual_seed(rep), op_checks=True, host_pairs=True)
                t1 = time.perf_counter()
                _pairs.pair_list(p, B, T, CHUNK, device=META)
                t2 = time.perf_counter()
                k = torch.full((B,), p.row.numel() // B)  # the sampler alone, the same draw sizes
                torch.ops.bst_fast.sample_pairs(lengths, start, 2, T, k, rep)
                t3 = time.perf_counter()
                prepare.append(t1 - t0)
                listing.append(t2 - t1)
                sampler.append(t3 - t2)
            key = f"B={B} threads={threads}"
            out[key] = dict(pairs=int(p.row.numel()), sampler_ms=median_ms(sampler), prepare_ms=median_ms(prepare),
                            pair_list_ms=median_ms(listing))
            print(key, {k: round(v, 2) for k, v in out[key].items()}, flush=True)
    Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
