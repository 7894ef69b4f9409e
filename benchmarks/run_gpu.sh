#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md in one go, on a CUDA machine with Triton, inside a
# time budget: GPU_BUDGET_S seconds (default 560; a lent machine runs one command for at most 600).
# Stages run in the order the issue's bars need them; each gets at most its share and what the
# budget has left, is stopped with SIGTERM at its limit (the benchmarks then report what they
# measured), and a stage that fails or runs out does not stop the next. Results land in
# ${OUT:-benchmarks/results}: gpu.txt (the machine, then every stage's output in turn) and one
# JSON file per benchmark, eight files (a lent machine returns at most eight).
# fla-core, to race fla.ops.attnres.fused_attnres: wheels found in .whl/ are installed first, for
# a machine that cannot reach an index (`pip download --no-deps -d .whl fla-core==0.6.0`; it needs
# einops too). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-benchmarks/results}"
budget="${GPU_BUDGET_S:-560}"
export PYTHONUNBUFFERED=1
mkdir -p "$out"

if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "run_gpu.sh: no CUDA device visible to $py (torch.cuda.is_available() is False); allowed: a machine with an NVIDIA GPU" >&2
  exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/attnres-wheels .whl/*.whl \
    && export PYTHONPATH="/tmp/attnres-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out/gpu.txt"

stage() {  # stage NAME SHARE_S COMMAND...: output appended to $out/gpu.txt, its tail printed
  local name=$1 share=$2
  shift 2
  local left=$((budget - SECONDS))
  local limit=$((share < left ? share : left))
  if ((limit < 20)); then
    echo "== $name: skipped (the budget of $budget s is spent)"
    return
  fi
  echo "== $name (at most $limit s): $*"
  local t0=$SECONDS log
  log=$(mktemp)
  timeout --kill-after=20 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local summary="== $name: exit $rc after $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (stopped at its limit)')"
  echo "$summary"
  tail -n 30 "$log"
  { echo "== $name: $*"; cat "$log"; echo "$summary"; } >>"$out/gpu.txt"
  rm -f "$log"
}

# 1. The kernels are right on the device (the CPU tests run them under Triton's interpreter).
stage gpu_check 100 "$py" benchmarks/gpu_check.py
# 2. Model level: the 194m preset, bf16 autocast, compiled; step time and peak memory vs baseline,
#    one process per bar (the baseline's second compile hits Inductor's cache), and the costliest
#    kernels of one step of each (where the extra time goes).
stage model_bench_block 100 "$py" benchmarks/model_bench.py --preset 194m --compile --variants block \
  --rounds 8 --warmup 2 --profile 14 --json "$out/model_bench_cuda_194m_block.json"
# 3. Op level: the issue's work (32 sublayers, S = 4, 16k tokens, d = 2048, bf16, fwd+bwd); the
#    eager reference, our Block schedule and fla-core first, then the other implementations.
stage op_bench 160 "$py" benchmarks/op_bench.py --json "$out/op_bench_cuda.json"
stage model_bench_full 75 "$py" benchmarks/model_bench.py --preset 194m --compile --variants full \
  --rounds 8 --warmup 2 --profile 14 --json "$out/model_bench_cuda_194m_full.json"
# 4. Full with one read per sublayer instead of two-phase (never timed on a GPU; block's per-read
#    schedule was the faster of block's two on 2026-11-30).
ATTNRES_SCHEDULE=per_read stage model_bench_full_per_read 70 "$py" benchmarks/model_bench.py --preset 194m \
  --compile --variants full --rounds 6 --warmup 2 --json "$out/model_bench_cuda_194m_full_per_read.json"
# 5. Block with one read per sublayer instead of the two-phase schedule (faster at op level on both
#    H200 runs, and at 194m on the second: 1.18 vs 1.23): which one block should use on CUDA.
ATTNRES_SCHEDULE=per_read stage model_bench_block_per_read 65 "$py" benchmarks/model_bench.py --preset 194m \
  --compile --variants block --rounds 6 --warmup 2 --json "$out/model_bench_cuda_194m_block_per_read.json"
# 6. The fused reads' kernels against their wall time, and the Triton knobs one at a time (what is left).
stage tile_sweep 120 "$py" benchmarks/tile_sweep.py --json "$out/tile_sweep_cuda.json"
echo "== done in $SECONDS s; files in $out"
