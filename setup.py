"""Builds bst_fast and its C++ extension bst_fast._C (the CPU pair-tile engine)."""
import glob
import os

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# -march=native: the extension is built where it runs (pip install -e .); BST_FAST_PORTABLE=1
# builds for any x86-64 / aarch64 instead.
flags = ["-O3", "-std=c++17", "-fopenmp"]
if os.environ.get("BST_FAST_PORTABLE", "0") != "1":
    flags.append("-march=native")

setup(
    name="bst_fast",
    version="0.1.0",
    description="Belief State Transformer training with a fused all-pairs objective",
    packages=find_packages(include=["bst_fast", "bst_fast.*"]),
    ext_modules=[
        CppExtension(
            "bst_fast._C",
            sorted(glob.glob("csrc/*.cpp")),
            extra_compile_args={"cxx": flags},
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    python_requires=">=3.9",
)
