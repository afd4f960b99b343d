"""Host time of a subsampled pair set (pairs=0.02) before the triton backend's kernels: the C++
sampler, prepare (draw, checks, the host pair set) and pair_list (sorted, counted, cut into chunks,
uploaded), at T = 256 for B = 32 (pairs-a) and B = 256 (the paper's step), on 1 and 2 threads. The meta
device stands in for the GPU (nothing is read back from it), so only the host's work is timed.

    python bench/host_pairs.py OUT.json
"""
import time, statistics, torch, json, sys
from bst_fast import _pairs
META = torch.device("meta")
out = {}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for B in (32, 256):
        T, frac = 256, 0.02
        lengths = torch.full((B,), T); start = torch.zeros(B, dtype=torch.long)
        f = torch.empty(B, T, 768, device=META); tokens = torch.empty(B, T, dtype=torch.long, device=META)
        samp, prep, lst = [], [], []
        for rep in range(15):
            g = torch.Generator().manual_seed(rep)
            t0 = time.perf_counter()
            p = _pairs.prepare(f, f, tokens, 1000, lengths=lengths, prefix_start=0, min_gap=2, max_gap=None, pairs=frac,
                               next_weight=0.5, reduction="mean", generator=g, op_checks=True, host_pairs=True)
            t1 = time.perf_counter()
            _pairs.pair_list(p, B, T, 40000, device=META)
            t2 = time.perf_counter()
            kk = torch.full((B,), int(p.row.numel()) // B)
            t3 = time.perf_counter()
            torch.ops.bst_fast.sample_pairs(lengths, start, 2, T, kk, rep)
            t4 = time.perf_counter()
            prep.append((t1 - t0) * 1e3); lst.append((t2 - t1) * 1e3); samp.append((t4 - t3) * 1e3)
        key = f"B={B} threads={threads}"
        out[key] = dict(pairs=int(p.row.numel()), sampler_ms=statistics.median(samp), prepare_ms=statistics.median(prep),
                        pair_list_ms=statistics.median(lst))
        print(key, {k: round(v, 2) if isinstance(v, float) else v for k, v in out[key].items()}, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
