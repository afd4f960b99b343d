"""The C++ extension bst_fast._C (the CPU pair-tile engine) and the runtime dependencies; the rest of
the package's metadata and its console script are in pyproject.toml. Built against the installed
torch: `pip install --no-build-isolation -e .`."""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# The extension links against this torch's C++ library, which keeps no ABI across versions: the
# package requires the torch it was built with (a local label such as +cu130 matches any build of
# that version). An isolated build (pip without --no-build-isolation) would take the newest torch.
RUNTIME = [f"torch=={torch.__version__.split('+')[0]}", "numpy", "tqdm", "pyyaml", "safetensors", "tokenizers",
           "triton; sys_platform == 'linux'"]

# -march=native: the extension is built where it runs (pip install -e .); BST_FAST_PORTABLE=1
# builds for any x86-64 / aarch64 instead.
flags = ["-O3", "-std=c++17", "-fopenmp"]
if os.environ.get("BST_FAST_PORTABLE", "0") != "1":
    flags.append("-march=native")

setup(
    # configs/ ships inside the package as bst_fast/configs, so `bst-fast star` and
    # TrainConfig.load("configs/star_cpu.yaml") find them after a plain `pip install .` too.
    packages=find_packages(include=["bst_fast", "bst_fast.*"]) + ["bst_fast.configs"],
    package_dir={"bst_fast.configs": "configs"},
    package_data={"bst_fast.configs": ["*.yaml"]},
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
