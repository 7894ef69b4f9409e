#!/usr/bin/env bash
# The GPU bars (benchmarks/bars.py) on one CUDA GPU in one go, inside GPU_BUDGET_S seconds (default 470: the
# script fits 8 minutes with its set-up): first the device check against the float64 reference,
# then op level (Block read fwd+bwd vs fla-core's fused_attnres), model level (194m, bf16, compiled:
# block and full step time vs baseline, block peak memory), inference (194m, bf16: prefill and
# per-token decode latency, block vs baseline), then every bar with the machine (bars.py).
#
#   bash benchmarks/run_gpu.sh              # a CUDA machine with Triton
#   bash benchmarks/run_gpu.sh --dry-run    # the whole script at a tiny size on CPU (tests it)
#
# Each stage gets at most its share and what the budget has left, is stopped with SIGTERM at its
# limit (the benchmarks then report what they measured), and a stage that fails or runs out does
# not stop the next. Results land in ${OUT:-benchmarks/results}: gpu.txt (the machine, every
# stage's output, the bars), gpu_check.rc and one JSON file per benchmark. fla-core: wheels in
# .whl/ are installed first (benchmarks/RESULTS.md, "GPU runbook"); without it that bar is reported
# as not measured. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
out="${OUT:-benchmarks/results}"
dry=0 scale=1
case "${1:-}" in
  "") ;;
  --dry-run) dry=1 scale=4 ;;  # the interpreter and a small CPU: more time for less work
  *) echo "run_gpu.sh: unknown argument '$1'; allowed: --dry-run" >&2; exit 2 ;;
esac
budget="${GPU_BUDGET_S:-$((470 * scale))}"
export PYTHONUNBUFFERED=1

if ((!dry)) && ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "run_gpu.sh: no CUDA device visible to $py (torch.cuda.is_available() is False); allowed: a machine with an NVIDIA GPU, or --dry-run" >&2
  exit 2
fi
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/attnres-wheels .whl/*.whl \
    && export PYTHONPATH="/tmp/attnres-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
if ((dry)); then
  echo "dry run: CPU, tiny sizes; the figures mean nothing" | tee "$out/gpu.txt"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
fi
"$py" -c 'import torch; print("torch", torch.__version__, end=" ")
try:
    import triton; print("triton", triton.__version__)
except ImportError: print("triton not installed")' | tee -a "$out/gpu.txt"

stage() {  # stage NAME SHARE_S COMMAND...: output appended to $out/gpu.txt, its tail printed, rc in $out/NAME.rc
  local name=$1 share=$(($2 * scale))
  shift 2
  local left=$((budget - SECONDS))
  local limit=$((share < left ? share : left))
  if ((limit < 15)); then
    echo "== $name: skipped (the budget of $budget s is spent)" | tee -a "$out/gpu.txt"
    return
  fi
  echo "== $name (at most $limit s): $*"
  local t0=$SECONDS log
  log=$(mktemp)
  timeout --kill-after=15 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  local summary="== $name: exit $rc after $((SECONDS - t0)) s$( ((rc == 124)) && echo ' (stopped at its limit)')"
  echo "$summary"
  tail -n 25 "$log"
  { echo "== $name: $*"; cat "$log"; echo "$summary"; } >>"$out/gpu.txt"
  rm -f "$log"
  [[ $name == gpu_check ]] && echo "$rc" >"$out/gpu_check.rc"
}

if ((dry)); then
  check=(--smoke --quick)
  op=(--sublayers 4 --block-size 2 --tokens 64 --d 32 --dtype float32 --reps 2 --warmup 1 --threads 1)
  model=(--layers 2 --batch 2 --seq-len 16 --rounds 2 --warmup 1 --threads 1)
  decode=(--layers 2 --prompt 16 --new 4 --rounds 2 --threads 1)
else
  check=()
  op=(--reps 10 --warmup 2)
  model=(--preset 194m --compile --rounds 6 --warmup 2)
  decode=(--preset 194m --prompt 512 --new 64 --rounds 5)
fi
impls="fused per read,fused two-phase"
if "$py" -c 'import fla.ops.attnres' 2>/dev/null && ((!dry)); then
  impls="$impls,fla fused_attnres"
else
  echo "# fla-core is not importable: the op-level bar's fla-core side is not measured" | tee -a "$out/gpu.txt"
fi

# 1. The kernels are right on the device: every read against the float64 reference, fp32 and bf16, gradients too.
stage gpu_check 90 "$py" benchmarks/gpu_check.py "${check[@]}"
# 2. Op level: 32 sublayers, S = 4, 16k tokens, d = 2048, bf16, forward + backward of every read.
stage op_bench 90 "$py" benchmarks/op_bench.py "${op[@]}" --only "$impls" --json "$out/op_bench.json"
# 3. Model level: block and full against the baseline in one process (alternating rounds), then memory.
stage model_bench 210 "$py" benchmarks/model_bench.py "${model[@]}" --variants block,full --json "$out/model_bench.json"
# 4. Inference: prefill and per-token decode from the KV cache, block against the baseline.
stage decode_bench 60 "$py" benchmarks/decode_bench.py "${decode[@]}" --variants block --json "$out/decode_bench.json"
"$py" benchmarks/bars.py "$out" | tee -a "$out/gpu.txt"
echo "== done in $SECONDS s; files in $out"
