"""The C++ extension bst_fast._C (the CPU pair-tile engine) and the runtime dependencies; the rest of
the package's metadata and its console script are in pyproject.toml. Built against the installed
torch: `pip install --no-build-isolation -e .`."""
import glob
import os

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # an isolated build (pip without --no-build-isolation), or torch not installed yet
    raise SystemExit("bst_fast builds its C++ extension against the torch it will run with, so it needs that torch "
                     "installed first and pip's build isolation off: `pip install torch==2.13.0` (or your CUDA "
                     "build of torch), then `pip install --no-build-isolation .` (or `-e .`)") from None

# The extension links against this torch's C++ library, which keeps no ABI across versions: the
# package requires the torch it was built with (a local label such as +cu130 matches any build of
# that version). An isolated build (pip without --no-build-isolation) has no torch: refused above.
RUNTIME = [f"torch=={torch.__version__.split('+')[0]}", "numpy", "tqdm", "pyyaml", "safetensors", "tokenizers",
           "triton; sys_platform == 'linux'"]

# -march=native: the extension is built where it runs (pip install -e .); BST_FAST_PORTABLE=1
# builds for any x86-64 / aarch64 instead. The C++ standard is torch's own choice (torch 2.14's
# headers need C++20, which a -std=c++17 here overrode).
flags = ["-O3", "-fopenmp"]
if os.environ.get("BST_FAST_PORTABLE", "0") != "1":
    flags.append("-march=native")

setup(
    # configs/ ships inside the package as bst_fast/configs, so `bst-fast star` and
    # TrainConfig.load("configs/star_cpu.yaml") find them after a plain `pip install .` too.
    # docs/ likewise as bst_fast/docs: the error messages cite docs/contract.md and docs/data.md.
    packages=find_packages(include=["bst_fast", "bst_fast.*"]) + ["bst_fast.configs", "bst_fast.docs"],
    package_dir={"bst_fast.configs": "configs", "bst_fast.docs": "docs"},
    package_data={"bst_fast.configs": ["*.yaml"], "bst_fast.docs": ["*.md"]},
    install_requires=RUNTIME,
    ext_modules=[
        CppExtension(
            "bst_fast._C",
            sorted(glob.glob("csrc/*.cpp")),
            extra_compile_args={"cxx": flags},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
