"""The pair loss's peak GPU memory, predicted on the CPU from its allocations: no GPU, no FLOPs.

    python bench/memory_model.py                               # pairs-b: B=256, T=64, m=h=768, 2 layers, V=1000, bf16
    python bench/memory_model.py --batch 32 --T 256 --d-model 512 --hidden 512    # pairs-a
    python bench/memory_model.py --head swiglu --backend torch --batch 32 --T 256 --d-model 512  # the official head

What `bench/pairs.py` measures on a GPU as "peak MB" (max_memory_allocated's growth over one
forward + backward, gradients included) is a sum of tensor storages, which depends on shapes
alone. This runs the same code on the CPU under a dispatch mode that

- counts every storage made while the loss and its backward run, from its creation to its release
  (a weak reference on the storage), each rounded up to 512 bytes as the CUDA caching allocator
  rounds a block, and keeps the peak of their sum;
- hands every matrix product an uninitialised output of its shape instead of computing it;
- launches no Triton kernel (their outputs keep whatever they held: only sizes are modelled);
- takes the GPU's allocation paths where the CPU's differ: launch shapes for "cuda", and a 16-bit
  product with a float32 result as one float32 output (torch.mm(out_dtype=)), not float32 copies.

The materialised objective and the lean naive of bench/pairs.py run on the meta device under the
same count. Run 1 on the H100 (bench/results/nvidia-h100-80gb-hbm3) is the check: at pairs-b it
measured 504.2 MB for the triton backend and 13288.7 for the materialised objective.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import weakref
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend's Python side on the CPU

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bst_fast import belief_state_loss, head as head_module  # noqa: E402
from bst_fast._pairs import pair_counts, pair_mask  # noqa: E402
from bst_fast.backends import runtime  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_pairs", Path(__file__).resolve().parent / "pairs.py")
bench_pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pairs)

aten = torch.ops.aten
# the matrix products: an output of the right shape, not computed
PRODUCTS = {aten.mm.default, aten.mm.dtype, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten._addmm_activation.default}
BLOCK = 512  # the CUDA caching allocator's rounding of a block's size


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages made under the mode (rounded to BLOCK)."""

    def __init__(self):
        super().__init__()
        self.seen, self.now, self.peak = set(), 0, 0

    def _count(self, t):
        if not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        key = s._cdata
        if key in self.seen:
            return
        nbytes = -(-s.nbytes() // BLOCK) * BLOCK
        self.seen.add(key)
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(s, self._release, key, nbytes)

    def _release(self, key, nbytes):
        self.seen.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and not any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(args)):
            meta = lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t
            shaped = func(*tree_map(meta, args), **tree_map(meta, kwargs))
            out = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype), shaped)
        elif func._schema.name in OPDEFS:  # the package's Python ops: their bodies' allocations counted too
            with self:
                out = OPDEFS[func._schema.name]._init_fn(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        # a view or an in-place result shares an argument's storage: only fresh storages count
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in given:
                self._count(t)
        return out


def _mm_f32_cuda(a, b):
    """head.mm_f32 as on a GPU: one float32 output of 16-bit operands (torch.mm(out_dtype=))."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    return torch.mm(a, b, out_dtype=torch.float32)


@contextlib.contextmanager
def as_on_a_gpu():
    """The fused backends' CPU runs allocating as their CUDA runs do, their kernels not launched:
    the triton backend's launch shapes, the torch backend's GPU chunk budget and Triton engine."""
    from triton.runtime.interpreter import InterpretedFunction
    from bst_fast.backends import launch, torch_backend, triton_backend

    saved = [(InterpretedFunction, "run", InterpretedFunction.run), (head_module, "mm_f32", head_module.mm_f32),
             (triton_backend, "mm_f32", triton_backend.mm_f32), (triton_backend, "chunk_config", triton_backend.chunk_config),
             (torch_backend, "_budget", torch_backend._budget)]
    InterpretedFunction.run = lambda self, *a, **k: None
    head_module.mm_f32 = triton_backend.mm_f32 = _mm_f32_cuda
    triton_backend.chunk_config = lambda device_type, *a, **k: launch.chunk_config("cuda", *a, **k)
    torch_backend._budget = lambda device, switches: switches.torch_chunk_bytes
    try:
        with runtime.switched(triton_ops=True):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def peak_bytes(step) -> int:
    """The peak of the storages step() makes, as the GPU's allocator would hold them."""
    mode = LiveBytes()
    with mode:
        step()
    return mode.peak


def model(args) -> dict:
    dtype = getattr(torch, args.dtype)
    B, L, m, V = args.batch, args.T + 2, args.d_model, args.vocab  # rows of T tokens with BOS/EOS, as pairs.py
    torch.manual_seed(0)
    name = args.backend
    out = dict(shape=dict(batch=B, T=args.T, d_model=m, hidden=args.hidden, layers=args.layers, vocab=V,
                          dtype=args.dtype, head=args.head), backend=name)

    def inputs(device):
        head = bench_pairs.make_head(args.head, args, args.layers, V)[0].to(device, dtype)  # pairs.py's heads
        f = torch.randn(B, L, m, dtype=dtype).to(device).requires_grad_()
        b = torch.randn(B, L, m, dtype=dtype).to(device).requires_grad_()
        tokens = torch.randint(0, V, (B, L)).to(device)
        return head, f, b, tokens

    head, f, b, tokens = inputs("cpu")

    def fused():
        with as_on_a_gpu():
            belief_state_loss(f, b, tokens, head, backend=name).backward()

    def forward():
        with as_on_a_gpu(), torch.no_grad():
            belief_state_loss(f, b, tokens, head, backend=name)

    out[f"{name}_forward_mb"] = peak_bytes(forward) / 2**20
    out[f"{name}_mb"] = peak_bytes(fused) / 2**20
    lengths = torch.full((B,), L)
    start = torch.zeros(B, dtype=torch.long)
    row, i, j = pair_mask(lengths, start, 2, L, L).nonzero(as_tuple=True)
    out["pairs"] = int(pair_counts(lengths, start, 2, L, L).sum())
    head, f, b, tokens = inputs("meta")
    scale = torch.tensor(1.0 / out["pairs"], dtype=torch.float64, device="meta")
    row, i, j = (t.to("meta") for t in (row, i, j))

    def materialised():
        bench_pairs.materialised(f, b, tokens, head, row, i, j, scale, V).backward()

    out["materialised_mb"] = peak_bytes(materialised) / 2**20
    out[f"{name}_vs_materialised"] = out[f"{name}_mb"] / out["materialised_mb"]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--T", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--head", default="mlp", choices=["mlp", "swiglu"], help="TextHead (gelu) or ResidualSwiGLUHead")
    ap.add_argument("--swiglu-hidden", type=int, default=None, help="the SwiGLU head's width (default: the official one)")
    ap.add_argument("--backend", default="triton", choices=["triton", "torch"])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunk-mb", type=int, default=None,
                    help="the chunk budget (BST_FAST_CHUNK_MB, or BST_FAST_TORCH_CHUNK_MB with --backend torch)")
    ap.add_argument("--window-rows", type=int, default=None, help="a window's rows (Switches.window_rows)")
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    changes = dict(window_rows=args.window_rows)
    if args.chunk_mb is not None:
        changes["triton_chunk_bytes" if args.backend == "triton" else "torch_chunk_bytes"] = args.chunk_mb * 2**20
    with runtime.switched(**changes):
        res = model(args)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
