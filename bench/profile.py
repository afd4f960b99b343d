"""torch.profiler trace of one BST training step: two causal encoders, a head (TextHead, or with
--head swiglu the official ResidualSwiGLUHead), belief_state_loss, AdamW.

Writes bench/results/<device name>-profile[-swiglu].json (chrome trace, open in chrome://tracing or
Perfetto) and bench/results/<device name>-profile[-swiglu].txt (the top-kernel table). NVTX ranges mark the encoders,
the pair loss and the optimizer, so an nsys capture of this script shows the same phases.

    python bench/profile.py --device cuda            # the H100 profiling run (bf16, auto backend)
    python bench/profile.py --device cpu --T 16      # smoke test
    python bench/profile.py --head swiglu --batch 32 --d-model 512   # the torch backend's SwiGLU path
"""
from __future__ import annotations

import os
import statistics
import sys
import time

# This file is named profile.py: drop its own folder from the path so that `import profile`
# (cProfile, pulled in by torch) finds the standard library, and put the repository root there.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import argparse  # noqa: E402
import contextlib  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function

from bst_fast import ResidualSwiGLUHead, TextHead, belief_state_loss  # noqa: E402


class Encoder(nn.Module):
    """A small causal Transformer encoder: embeddings -> nn.TransformerEncoder with a causal mask."""

    def __init__(self, vocab, d_model, n_layers, n_heads, max_len):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.body = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)

    def forward(self, tokens):  # (B, L) -> (B, L, m); position t has read tokens[:, :t+1]
        L = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(L, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(L, device=tokens.device, dtype=x.dtype)
        return self.body(x, mask=mask, is_causal=True)


def nvtx(name, on):
    """An NVTX range (for nsys) and a profiler label (for the trace) around one phase."""
    if not on:
        return record_function(name)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.nvtx.range(name))
    stack.enter_context(record_function(name))
    return stack


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu by default")
    ap.add_argument("--batch", type=int, default=None, help="32 on cuda, 2 on cpu")
    ap.add_argument("--T", type=int, default=None, help="sequence length without BOS/EOS: 256 on cuda, 16 on cpu")
    ap.add_argument("--d-model", type=int, default=None, help="768 on cuda, 32 on cpu")
    ap.add_argument("--enc-layers", type=int, default=None, help="8 on cuda, 1 on cpu")
    ap.add_argument("--hidden", type=int, default=None, help="head width: 512 on cuda, 32 on cpu")
    ap.add_argument("--head-layers", type=int, default=3)
    ap.add_argument("--head", choices=["mlp", "swiglu"], default="mlp",
                    help="mlp: TextHead (--hidden, --head-layers); swiglu: ResidualSwiGLUHead (default width)")
    ap.add_argument("--vocab", type=int, default=None, help="1000 on cuda, 50 on cpu")
    ap.add_argument("--backend", default=None, help="belief_state_loss backend (default: auto on cuda, torch on cpu)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps after 2 warm-up steps")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = ap.parse_args()
    dev = torch.device(a.device)
    gpu = dev.type == "cuda"
    pick = lambda v, big, small: v if v is not None else (big if gpu else small)
    dtype = getattr(torch, pick(a.dtype, "bfloat16", "float32"))
    B, T, m = pick(a.batch, 32, 2), pick(a.T, 256, 16), pick(a.d_model, 768, 32)
    n_enc, h, V = pick(a.enc_layers, 8, 1), pick(a.hidden, 512, 32), pick(a.vocab, 1000, 50)
    backend = pick(a.backend, "auto", "torch")
    L = T + 2
    name = torch.cuda.get_device_name(dev).replace(" ", "-") if gpu else "cpu"

    torch.manual_seed(0)
    fwd = Encoder(V, m, n_enc, max(1, m // 64), L).to(dev, dtype)
    bwd = Encoder(V, m, n_enc, max(1, m // 64), L).to(dev, dtype)
    if a.head == "swiglu":
        head = ResidualSwiGLUHead(m, V).to(dev, dtype)
    else:
        head = TextHead(m, V, hidden=h, n_layers=a.head_layers, activation="gelu").to(dev, dtype)
    params = [*fwd.parameters(), *bwd.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    tokens = torch.randint(0, V, (B, L), device=dev)

    phases = ("encoders", "pair_loss", "backward", "optimizer")
    marks = []  # per step: one CUDA event (or host time) at each phase boundary

    def mark():
        if gpu:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            marks[-1].append(e)
        else:
            marks[-1].append(time.perf_counter())

    def step():
        marks.append([])
        mark()
        with nvtx("encoders", gpu):
            f = fwd(tokens)  # (B, L, m)
            b = bwd(tokens.flip(1)).flip(1)  # (B, L, m): b[:, j] has read tokens[:, j:]
        mark()
        with nvtx("pair_loss", gpu):
            loss = belief_state_loss(f, b, tokens, head, backend=backend)
        mark()
        with nvtx("backward", gpu):
            loss.backward()
        mark()
        with nvtx("optimizer", gpu):
            opt.step()
            opt.zero_grad(set_to_none=True)
        mark()
        return loss

    for _ in range(2):  # warm-up: Triton compilation, cuBLAS heuristics, allocator
        step()
    if gpu:
        torch.cuda.synchronize()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=acts, record_shapes=True) as prof:
        for _ in range(a.steps):
            loss = step()
        if gpu:
            torch.cuda.synchronize()
    # Per-phase times outside the profiler (it slows the host side): median over a.steps steps.
    marks.clear()
    for _ in range(a.steps):
        step()
    if gpu:
        torch.cuda.synchronize()
    ms = lambda x, y: x.elapsed_time(y) if gpu else (y - x) * 1e3
    per = {ph: statistics.median(ms(m_[k], m_[k + 1]) for m_ in marks) for k, ph in enumerate(phases)}
    total = statistics.median(ms(m_[0], m_[-1]) for m_ in marks)
    phase_table = "| phase | ms |\n| --- | --- |\n" + "".join(f"| {ph} | {v:.1f} |\n" for ph, v in per.items())
    phase_table += f"| step | {total:.1f} ({1e3 / total:.2f} it/s) |\n"

    os.makedirs(a.out, exist_ok=True)
    base = os.path.join(a.out, f"{name}-profile" + ("-swiglu" if a.head == "swiglu" else ""))
    prof.export_chrome_trace(base + ".trace.json")  # large: kept out of git and of gpu.sh's ARCHIVE
    key = "cuda_time_total" if gpu else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    shape = f"swiglu {head.hidden}" if a.head == "swiglu" else f"{a.head_layers}x{h}"
    head_line = (f"# {name}: B={B} T={T} m={m} enc_layers={n_enc} head={shape} V={V} "
                 f"{dtype} backend={backend}, {a.steps} steps, loss {loss.item():.4f}\n")
    with open(base + ".txt", "w") as fh:
        fh.write(head_line + phase_table + "\n" + table + "\n")
    print(head_line + table)
    print(phase_table)
    print(f"wrote {base}.trace.json and {base}.txt")


if __name__ == "__main__":
    main()
