#!/usr/bin/env bash
# One GPU run: build, check the backends against float64, time them against the naive
# materialised objective at the GPU issues' shapes, time a training step, then the cuda-marked
# tests. Everything lands in bench/results/ (or $RESULTS_DIR), named after the GPU. Steps are
# ordered by what matters most, each under its own timeout (their sum: 24 min, QUICK=1 20; a
# step usually takes well under its limit).
#
#   bash bench/gpu.sh            # from anywhere; needs torch with CUDA and triton
#   QUICK=1 bash bench/gpu.sh    # no torch.compile column, subsampling rows or cuda tests
#   STEPS="heads heads-variants check" bash bench/gpu.sh   # only the named steps (the names below)
#
# Through the device tool (at most 8 files come back, and a command over its limit is killed, so
# ARCHIVE is rewritten after every step: what finished comes back even if the rest is cut off):
#   RESULTS_DIR=/tmp/r ARCHIVE=$OUT/results.tgz QUICK=1 \
#       STEPS="heads heads-512mb profile-swiglu heads-variants check" timeout 560 bash bench/gpu.sh
#
# Every step runs even if an earlier one failed; the exit status is nonzero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must be compiled, not interpreted
ALL_STEPS="heads heads-512mb profile-swiglu heads-variants pairs-a pairs-b check profile pairs-d pairs-long pairs-c subsample tests"
for s in ${STEPS:-}; do
    [[ " $ALL_STEPS " == *" $s "* ]] || { echo "bench/gpu.sh: unknown step '$s' (steps: $ALL_STEPS)" >&2; exit 2; }
done
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || {
    echo "bench/gpu.sh: no CUDA device visible to torch" >&2; exit 1; }
out=${RESULTS_DIR:-bench/results}
quick=${QUICK:-0}
mkdir -p "$out"
status=0
step() {  # step <seconds> <log name> <command...>
    local t=$1 log=$2; shift 2
    [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $log "* ]] && return 0
    echo "== $name: $log"
    timeout "$t" "$@" 2>&1 | tee "$out/$name-$log.txt" || { echo "!! $log failed or timed out"; status=1; }
    if [ -n "${ARCHIVE:-}" ]; then  # written whole, then renamed: a kill never leaves half an archive
        # without the profiler's traces: a file over the device tool's 16 MiB would not come back
        tar czf "$ARCHIVE.part" --exclude='*.trace.json' -C "$out" . && mv "$ARCHIVE.part" "$ARCHIVE"
    fi
}

# The C++ extension (the subsampler, needed only by sampled pairs: the check step's pairs=0.3
# cases and the subsample rows) builds in the background at the lowest priority on 4 cores, so
# that the host-bound timings running meanwhile keep their cores.
(MAX_JOBS=4 timeout 150 nice -n 19 python3 setup.py build_ext --inplace > "$out/$name-build.txt" 2>&1) & build=$!
P="python3 bench/pairs.py --device cuda --dtype bfloat16 --forward --subsample-T 0"
[ "$quick" = 1 ] && P="$P --reps 5 --no-compile" || P="$P --reps 7"
# Any head: TextHead and the official residual SwiGLU head through every backend that takes them.
step 90 heads python3 bench/pairs.py --device cuda --dtype bfloat16 --batch 32 --T 256 --d-model 512 --hidden 512 \
    --layers 2 --vocab 1000 --head mlp swiglu --backends all --no-compile --subsample-T 0 --reps 5 --out "$out/$name-heads.json"
# the torch backend's chunk budget at twice the default (fewer chunks: ~100 launches each, host-bound
# if a chunk's GPU work is short), its memory against the 5% bar
step 60 heads-512mb env BST_FAST_TORCH_CHUNK_MB=512 python3 bench/pairs.py --device cuda --dtype bfloat16 --batch 32 --T 256 \
    --d-model 512 --vocab 1000 --head swiglu --backends torch --no-compile --subsample-T 0 --reps 5 --out "$out/$name-heads-512mb.json"
# where the SwiGLU head's time goes, in a training step at the issue's shape (the torch backend)
step 90 profile-swiglu python3 bench/profile.py --device cuda --head swiglu --batch 32 --T 256 --d-model 512 \
    --enc-layers 4 --steps 2 --out "$out"
# the SwiGLU head through the torch backend's variants side by side: the fused swiglu part (the
# default) against gate and up summed apart (the code before it), and the per-pair tail under
# torch.compile (used only where measured faster; its first run compiles, untimed)
step 240 heads-variants python3 bench/pairs.py --device cuda --dtype bfloat16 --batch 32 --T 256 --d-model 512 \
    --vocab 1000 --head swiglu --backends torch torch+unfused torch+compile --no-compile --subsample-T 0 --reps 5 \
    --out "$out/$name-heads-variants.json"
step 120 pairs-a $P --batch 32 --T 256 --d-model 512 --hidden 512 --layers 2 --vocab 1000 --out "$out/$name-pairs-a.json"
step 60 pairs-b $P --batch 256 --T 64 --d-model 768 --hidden 768 --layers 2 --vocab 1000 --no-compile --out "$out/$name-pairs-b.json"
wait $build || { echo "!! build failed"; status=1; }
# QUICK: without the torch+compile cases (each dtype and chunk size compiles anew)
[ "$quick" = 1 ] && C="cuda triton torch torch+unfused" || C=""
step 240 check python3 bench/gpu_check.py $C
step 120 profile python3 bench/profile.py --device cuda --batch 256 --T 256 --d-model 768 --hidden 768 --head-layers 2 --out "$out"
step 60 pairs-d $P --batch 8 --T 256 --d-model 512 --hidden 512 --layers 2 --vocab 32000 --no-compile --out "$out/$name-pairs-d.json"
step 60 pairs-long $P --batch 4 --T 1024 --d-model 512 --hidden 512 --layers 2 --vocab 1000 --no-compile --out "$out/$name-pairs-long.json"
step 60 pairs-c $P --batch 32 --T 256 --d-model 512 --hidden 512 --layers 3 --vocab 1000 --no-compile --out "$out/$name-pairs-c.json"
if [ "$quick" != 1 ]; then
    step 90 subsample python3 bench/pairs.py --device cuda --dtype bfloat16 --no-compile --reps 7 --batch 32 --T 256 \
        --d-model 512 --hidden 512 --vocab 1000 --subsample-T 256 --mem-limit-gb 0 --out "$out/$name-subsample.json"
    step 150 tests python3 -m pytest -m cuda -q tests/test_triton.py tests/test_belief_state_loss.py tests/test_heads.py
fi
exit $status
