#!/usr/bin/env bash
# The GPU run of issue 3 on one CUDA machine: the cuda-marked tests, the pair-loss benchmark and the
# profiler trace of a training step. Everything lands in bench/results/, named after the GPU.
#
#   bash bench/gpu.sh            # from anywhere; needs torch with CUDA, triton and this package built
#
# Every step runs even if an earlier one failed; the exit status is nonzero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # the kernels must be compiled, not interpreted
name=$(python -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || {
    echo "bench/gpu.sh: no CUDA device visible to torch" >&2; exit 1; }
out=bench/results
mkdir -p "$out"
status=0

echo "== $name: cuda tests"
python -m pytest -m cuda -v tests 2>&1 | tee "$out/$name-tests.txt" || status=1

echo "== $name: pair-loss benchmark (fused vs materialised vs torch.compile, bf16)"
python bench/pairs.py --device cuda --dtype bfloat16 --T 64 128 256 512 1024 --hidden 512 --layers 2 3 \
    --vocab 1000 32000 --batch 32 2>&1 | tee "$out/$name-pairs.txt" || status=1

echo "== $name: profiler trace of a training step"
python bench/profile.py --device cuda 2>&1 | tee "$out/$name-profile-log.txt" || status=1

exit $status
