"""Triton kernels of the GPU backends, one file per kernel family (run on the CPU under TRITON_INTERPRET=1)."""
