#!/usr/bin/env bash
# The GPU measurements of benchmarks/RESULTS.md in one go (a CUDA machine with triton; fla-core
# optional: pip install fla-core einops to race fla.ops.attnres.fused_attnres). About 10 minutes
# on an H200. Results land in ${OUT:-benchmarks/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
# 1. the kernels are right on the device (the CPU tests run them under Triton's interpreter)
python benchmarks/gpu_check.py 2>&1 | tee "$out/gpu_check.txt"
# 2. op level: the issue's work, 32 sublayers, S = 4, 16k tokens, d = 2048, bf16, fwd+bwd
python benchmarks/op_bench.py --json "$out/op_bench_cuda.json" 2>&1 | tee "$out/op_bench_cuda.txt"
# 3. model level: the 194m preset, bf16 autocast, compiled, step time and peak memory vs baseline
python benchmarks/model_bench.py --preset 194m --compile --variants block,full --rounds 6 --warmup 3 \
  --json "$out/model_bench_cuda_194m.json" 2>&1 | tee "$out/model_bench_cuda_194m.txt"
