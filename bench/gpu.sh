#!/usr/bin/env bash
# One GPU run: build the C++ extension (the package imports it), the paper's Table 3 with the
# project's trainer (bench/paper_speed.py), its BST columns also with the levers not yet timed on a
# GPU (the fused last layer, the hidden layers') side by side in that process, the levers' float64
# checks and timings alone, then the backends against the naive materialised objective at the GPU
# issues' shapes, float64 checks, profiles of training steps and the cuda-marked tests. Everything
# lands in bench/results/ (or $RESULTS_DIR), named after the GPU (paper_speed's table in
# <results>/<card slug>/paper_speed.{json,md}). Steps are ordered by what matters most, each under
# its own timeout, and the whole run keeps to BUDGET seconds (default 570: one 10-minute device
# call): a step's timeout is cut to what is left, and a step with under 30 s left is skipped and
# named at the end (the steps' timeouts add up to far more than one call: a default run gets through
# the build, the paper's table and the levers' steps; name others with STEPS, or raise BUDGET where
# there is time).
#
#   bash bench/gpu.sh            # from anywhere; needs torch with CUDA and triton
#   QUICK=1 bash bench/gpu.sh    # no torch.compile column, subsampling rows or cuda tests (unless STEPS names them)
#   STEPS="heads heads-variants check" bash bench/gpu.sh   # only the named steps (the names below)
#   BUDGET=1500 bash bench/gpu.sh                          # a longer run: every step
#
# Through the device tool (at most 8 files come back, and a command over its limit is killed, so
# ARCHIVE is rewritten after every step: what finished comes back even if the rest is cut off;
# where $OUT is set, ARCHIVE defaults to $OUT/results.tgz; <card>-steps.tsv in it says how each step
# ended). Issue 23's table and levers, about 9 minutes (what the budget leaves of the last is cut;
# levers.py and logits_ce.py write what they timed as they go):
#   RESULTS_DIR=/tmp/r QUICK=1 ARCHIVE=$OUT/results.tgz STEPS="paper lce levers-paper check-fused" timeout 590 bash bench/gpu.sh
# A second call must fit the device time left (`status`'s budget_left_s, a fresh machine's start
# included): issue it at once, while the machine is warm, with BUDGET and timeout below what is left.
#
# Every step runs even if an earlier one failed; the exit status is nonzero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must be compiled, not interpreted
ALL_STEPS="paper lce levers-paper check-fused paper-compiled paper-ac levers ce segments gemm check check-levers paper-levers packed heads heads-512mb profile-swiglu heads-variants pairs-a pairs-b profile pairs-d pairs-long pairs-c subsample tests"
for s in ${STEPS:-}; do
    [[ " $ALL_STEPS " == *" $s "* ]] || { echo "bench/gpu.sh: unknown step '$s' (steps: $ALL_STEPS)" >&2; exit 2; }
done
# (under a timeout: a hung CUDA start would spend the whole call and bring nothing back)
name=$(timeout -k 5 90 python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || {
    echo "bench/gpu.sh: no CUDA device visible to torch (or its start took over 90 s)" >&2; exit 1; }
out=${RESULTS_DIR:-bench/results}
[ -n "${OUT:-}" ] && [ -z "${ARCHIVE:-}" ] && ARCHIVE=$OUT/results.tgz  # the device tool brings back $OUT only
quick=${QUICK:-0}
budget=${BUDGET:-570}
mkdir -p "$out"
status=0
skipped=""
# How each step ended, in the archive too (the "!!" lines go to stdout only): step, exit status
# (124: its timeout, 137: killed after it; "skipped": no time left), seconds, timeout, started at
steps_tsv="$out/$name-steps.tsv"
printf 'step\trc\tseconds\ttimeout\tstarted_s\n' > "$steps_tsv"
archive() {  # written whole, then renamed: a kill never leaves half an archive
    # without the profiler's traces: a file over the device tool's 16 MiB would not come back
    [ -n "${ARCHIVE:-}" ] && tar czf "$ARCHIVE.part" --exclude='*.trace.json' -C "$out" . && mv "$ARCHIVE.part" "$ARCHIVE"
}
step() {  # step <seconds> <log name> <command...>
    local t=$1 log=$2; shift 2
    [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $log "* ]] && return 0
    local left=$((budget - SECONDS))
    if [ "$left" -lt 30 ]; then
        echo "!! $log skipped: ${left}s of the ${budget}s budget left"; skipped="$skipped $log"
        printf '%s\tskipped\t0\t%s\t%s\n' "$log" "$t" "$SECONDS" >> "$steps_tsv"; archive; return 0
    fi
    [ "$t" -gt "$left" ] && t=$left
    echo "== $name: $log (timeout ${t}s)"
    local start=$SECONDS rc
    timeout -k 10 "$t" "$@" 2>&1 | tee "$out/$name-$log.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "!! $log failed or timed out (exit $rc)"; status=1; }
    echo "## $log: exit $rc after $((SECONDS - start))s (timeout ${t}s)" >> "$out/$name-$log.txt"
    printf '%s\t%s\t%s\t%s\t%s\n' "$log" "$rc" "$((SECONDS - start))" "$t" "$start" >> "$steps_tsv"
    archive
}

# The C++ extension first, on every core: bst_fast imports it (the pair sampler and the CPU
# engine), so no step runs without it. Incremental: quick where it is built already.
echo "== $name: build"
build_start=$SECONDS  # after the CUDA probe above: its time is not the build's
MAX_JOBS=$(nproc) timeout -k 10 200 python3 setup.py build_ext --inplace > "$out/$name-build.txt" 2>&1
rc=$?
[ "$rc" = 0 ] || { echo "!! build failed (see $out/$name-build.txt)"; tail -20 "$out/$name-build.txt"; status=1; }
printf 'build\t%s\t%s\t200\t%s\n' "$rc" "$((SECONDS - build_start))" "$build_start" >> "$steps_tsv"
git rev-parse HEAD > "$out/$name-commit.txt" 2>/dev/null || true  # what ran (a copy of the tree: may be absent)
nvidia-smi > "$out/$name-nvidia-smi.txt" 2>&1 || true
slug=$(echo "$name" | tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
# The paper's Table 3 (GPT, BST original, BST improved, and with the SwiGLU head) through
# bst_fast.trainer.train_step at the paper's shape, 20 timed steps a column, first. Each BST column
# runs again right after with the four untimed levers on (issue 23; docs/backends.md "Levers"), and
# the subsampled ones with their pair list made on the device (host_pairs off, as before it was
# built): side by side in one process (paper_speed.py --variant; the SwiGLU column takes
# split_16bit alone: the torch backend).
V4="fused=fused_ce=1,relu_in_gemm=1,hidden_sums=1,split_16bit=1"
step 330 paper python3 bench/paper_speed.py --device cuda --shape paper --out "$out/$slug" --variant "$V4" \
    --variant device-pairs=host_pairs=0
# The last layer alone on one chunk of the paper's step: unfused (cuBLAS addmm, the cross-entropy, the
# column sum) against the fused kernel (the switch fused_ce) under its block shapes, each checked.
step 120 lce python3 bench/logits_ce.py --out "$out/$name-lce.json"
# the levers at the paper's head (3 x 512, relu: the hidden layers' levers apply) on 32 rows of the
# paper's encoders' width, each against the defaults, interleaved
step 150 levers-paper python3 bench/levers.py --device cuda --reps 7 --batch 32 --T 256 --d-model 768 --hidden 512 \
    --layers 3 --activation relu --levers default fused_ce relu_in_gemm hidden_sums relu_in_gemm+hidden_sums \
    fused_ce+relu_in_gemm+hidden_sums split_16bit ce_bias_sums "pairs=0.02 device pair list" --out "$out/$slug-levers-paper"
# the float64 checks (after the timings, which check each setting themselves: a cut run keeps
# them; its cases' lines print as they pass) with fused_ce, relu_in_gemm, hidden_sums and split_16bit on (the cases' V = 101,
# 3001, 64, 77 and hidden widths 40, 200, 48-24-40, 96, 96-40: unaligned halves and K-loops with a
# tail; relu at 2 and 3 layers (the last case is where relu_in_gemm acts), 3-4 layer heads), and the count of a subsampled loss's synchronisations (host pair lists: one)
F="env BST_FAST_FUSED_CE=1 BST_FAST_RELU_IN_GEMM=1 BST_FAST_HIDDEN_SUMS=1 BST_FAST_SPLIT_16BIT=1"
step 200 check-fused $F python3 bench/gpu_check.py cuda triton  # mostly compiles: ~135 kernel signatures
# Table 3 with the encoders compiled (TrainConfig.compile, as `bst_fast.train` does with compile: true;
# the warm-up steps compile): the switches in force are the caller's (export BST_FAST_FUSED_CE=1 ...)
step 300 paper-compiled python3 bench/paper_speed.py --device cuda --shape paper --set compile=true --warmup 4 \
    --out "$out/$slug-compiled"
# GPT and the original BST, each again right after with its encoder blocks recomputed in the
# backward (model.activation_checkpointing): the memory it saves and the time it costs, side by side
step 150 paper-ac python3 bench/paper_speed.py --device cuda --shape paper --columns gpt bst-original \
    --variant ac=model.activation_checkpointing=true --out "$out/$slug-ac"
# the pair loss's levers (runtime switches, off unless timed faster here) against the defaults, each
# checked against them first, interleaved reps, at the pairs-a shape: a lever that pays becomes a default
# (LEVERS="default fused_ce ...": only those, names without spaces)
step 120 levers python3 bench/levers.py --device cuda --reps 9 ${LEVERS:+--levers $LEVERS} --out "$out/$slug"
# the cross-entropy kernel alone on one chunk of the paper's step, under its launch shapes (one row
# a program with two passes, as before; blocks of rows), with and without the column sums
# (ce_bias_sums), and torch's column sum; then a chunk at V = 32000 (halves of several blocks)
step 60 ce bash -c "python3 bench/cross_entropy.py --out $out/$name-ce.json && \
    python3 bench/cross_entropy.py --vocab 32000 --rows 4096 --out $out/$name-ce-32k.json"
# the TextHead's gelu segment sums alone, one chunk at the pairs-a shape: the listed kernels, then
# structured_grad_kernel (the structured_sums lever), each over a short sweep of launch shapes
step 90 segments bash -c "python3 bench/segment_sums.py --parts text-gelu --quick --out $out/$name-segments.json && \
    python3 bench/segment_sums.py --parts text-gelu --quick --structured --out $out/$name-segments-structured.json"
# the chunk's three GEMM shapes (h = 512 and 768, 2V = 2000 and 2048): cuBLAS against a plain Triton
# wgmma GEMM, the base a fused gather prologue or cross-entropy epilogue would build on
step 120 gemm python3 bench/gemm_shapes.py --device cuda --quick --out "$out/$name-gemm.json"
# the backends against float64 (what the table ran on). QUICK: without the torch+compile cases
# (each dtype and chunk size compiles anew)
[ "$quick" = 1 ] && C="cuda triton torch torch+unfused" || C=""
step 240 check python3 bench/gpu_check.py $C
# the same float64 checks with all nine levers on at once (bench/gpu_check.py --levers), the backends they touch
step 300 check-levers python3 bench/gpu_check.py cuda triton torch --levers
# Table 3 again with every lever on that changes its columns (the sampler, the bias fold, the
# structured sums, the cross-entropy's bias sums): the whole step's gain, once levers.py has shown which pay
step 270 paper-levers env BST_FAST_BIAS_IN_GEMM=1 BST_FAST_CE_BIAS_SUMS=1 BST_FAST_STRUCTURED_SUMS=1 BST_FAST_DEVICE_SAMPLER=1 \
    python3 bench/paper_speed.py --device cuda --shape paper --out "$out/$slug-levers"
# packed rows (docs/contract.md §10) against one document a row, the same documents and pairs, the
# triton backend (issue 22's GPU line): 256 documents of 8..256 tokens at the profile's width; then both encoders (4 blocks) with SDPA and flex_attention
step 60 packed python3 bench/packed.py --device cuda --dtype bfloat16 --docs 256 --T 256 --d-model 512 --hidden 512 \
    --backend triton --reps 7 --enc-layers 4 --enc-heads 8 --out "$out/$slug"
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
    --enc-layers 4 --steps 2 --out "$out/profiles"
# the SwiGLU head through the torch backend's variants side by side: the fused swiglu part (the
# default) against gate and up summed apart (the code before it), and the per-pair tail under
# torch.compile (used only where measured faster; its first run compiles, untimed)
step 240 heads-variants python3 bench/pairs.py --device cuda --dtype bfloat16 --batch 32 --T 256 --d-model 512 \
    --vocab 1000 --head swiglu --backends torch torch+unfused torch+compile --no-compile --subsample-T 0 --reps 5 \
    --out "$out/$name-heads-variants.json"
step 120 pairs-a $P --batch 32 --T 256 --d-model 512 --hidden 512 --layers 2 --vocab 1000 --out "$out/$name-pairs-a.json"
step 60 pairs-b $P --batch 256 --T 64 --d-model 768 --hidden 768 --layers 2 --vocab 1000 --no-compile --out "$out/$name-pairs-b.json"
# (its report in profiles/: <card>-profile.txt in $out is this step's log, which tee writes as it goes)
step 120 profile python3 bench/profile.py --device cuda --batch 256 --T 256 --d-model 768 --hidden 768 --head-layers 2 \
    --out "$out/profiles"
step 60 pairs-d $P --batch 8 --T 256 --d-model 512 --hidden 512 --layers 2 --vocab 32000 --no-compile --out "$out/$name-pairs-d.json"
step 60 pairs-long $P --batch 4 --T 1024 --d-model 512 --hidden 512 --layers 2 --vocab 1000 --no-compile --out "$out/$name-pairs-long.json"
step 60 pairs-c $P --batch 32 --T 256 --d-model 512 --hidden 512 --layers 3 --vocab 1000 --no-compile --out "$out/$name-pairs-c.json"
if [ "$quick" != 1 ] || [ -n "${STEPS:-}" ]; then  # QUICK leaves them out unless STEPS names them
    step 90 subsample python3 bench/pairs.py --device cuda --dtype bfloat16 --no-compile --reps 7 --batch 32 --T 256 \
        --d-model 512 --hidden 512 --vocab 1000 --subsample-T 256 --mem-limit-gb 0 --out "$out/$name-subsample.json"
    step 150 tests python3 -m pytest -p no:xdist -m cuda -q tests  # every cuda-marked test (the README's GPU block too)
fi
[ -n "$skipped" ] && echo "skipped for the ${budget}s budget:$skipped (run them with STEPS=... or a larger BUDGET)"
echo "bench/gpu.sh: ${SECONDS}s"
printf 'total\t%s\t%s\t%s\t0\n' "$status" "$SECONDS" "$budget" >> "$steps_tsv"
archive
exit $status
