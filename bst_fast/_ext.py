"""The C++ extension, loaded once, below everything that uses it: the pair-loss engine of the cpp
backend and the pair sampler of bst_fast._pairs (both registered as torch ops by TORCH_LIBRARY).

The package imports without it (a clone not built yet, a build for another torch): the torch,
reference and triton backends need none of it; `require` names what is missing where a feature
needs it (the cpp backend, whose `supports` says so, and a `pairs=` subsample's C++ sampler)."""
from __future__ import annotations

import importlib

import torch

try:  # loads the library; TORCH_LIBRARY registers the ops
    importlib.import_module(f"{__package__}._C")  # a missing one raises ModuleNotFoundError itself
    LOAD_ERROR = None
except ImportError as e:  # not built (ModuleNotFoundError), or built against another torch
    LOAD_ERROR = e


def problem(what: str):
    """None when the extension is loaded, else why `what` cannot run and how to build it."""
    if LOAD_ERROR is None:
        return None
    how = ("is not built" if isinstance(LOAD_ERROR, ModuleNotFoundError)
           else f"failed to load ({str(LOAD_ERROR)[:300]})")
    return (f"{what} needs bst_fast's C++ extension (bst_fast._C), which {how}: build it against the torch you "
            f"run ({torch.__version__}) with `python -m pip install --no-build-isolation -e .` in the project "
            f"folder (or `python setup.py build_ext --inplace`), or reinstall the package with "
            f"`pip install --no-build-isolation --force-reinstall` of its source")


def require(what: str):
    """Raise a ValueError (a set-up fault, as the cpp backend's refusal is) naming `what` and the fix
    when the extension is not loaded."""
    why = problem(what)
    if why is not None:
        raise ValueError(why) from LOAD_ERROR


if LOAD_ERROR is None:
    @torch.library.register_fake("bst_fast::sample_pairs")
    def _sample_pairs_fake(lengths, prefix_start, min_gap, max_gap, k, seed):
        if len({t.device for t in (lengths, prefix_start, k)}) > 1:  # one meta argument among CPU ones
            raise ValueError(f"sample_pairs takes lengths, prefix_start and k on the CPU, got "
                             f"{[str(t.device) for t in (lengths, prefix_start, k)]}")
        n = torch.library.get_ctx().new_dynamic_size()
        return tuple(lengths.new_empty(n) for _ in range(3))
