#!/usr/bin/env bash
# The CPU study on a 2-core machine, designed to resolve (docs/STUDY.md): the ablation at the study
# recipe (sweeps/study_cpu.yaml: model.layers=16, 1M tokens), block and full against the baseline
# with adaptive seeds until their paired 95% interval is at most ±0.03 nats, the block-size curve
# at the same recipe, the scaling ladder with Block at 4-5 blocks per size, the architecture grid
# with two seeds, and the multi-hop probe.
#
#   bash results/reproduce.sh
#
# Lane time estimated from the previous study's runs (train_seconds × tokens): adaptive 76-152
# minutes (4-8 seeds of baseline, block, full), the other ten ablation variants at 3 seeds 282,
# block size 112, scaling 55, arch 48, probe 45: 5.2-5.8 hours in two lanes. The learning-rate grid
# (sweep tuned_lr) is not rerun at this recipe; its section says so.
#
# Resumable: run the same command again after an interruption. Every job's folder is keyed by its
# resolved config (harness/checkpoint.py), so finished runs return their recorded result without
# training, interrupted ones resume from their last checkpoint, and the adaptive stage rereads its
# runs from the store and reaches the same decisions (its rule and verdicts: results/adaptive.json,
# which REPORT.md quotes). Runs go to study/mlflow.db (not committed);
# results/runs.csv is the committed snapshot, and REPORT.md is regenerated from it (last line).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p study
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$PWD/study/mlflow.db}"
# train.code_change=keep: a study continued after the code changed keeps its finished runs' results
# and resumes the interrupted ones (the default refuses them in one line naming the changed files).
common=(train.threads=1 train.progress=false train.checkpoint_dir="$PWD/study/checkpoints"
        train.code_change=keep hydra.sweep.dir="study/multirun/\${sweep.name}")
recipe=(model.layers=16 train.tokens=1000000)  # sweeps/study_cpu.yaml, for sweeps with their own file
status=0

# 1. Block and Full against the baseline: seeds 0-3, then 2 more at a time up to 8, each comparison
#    stopping once its interval (Bonferroni over the looks) is within ±0.03.
python -m analysis.adaptive --recipe study_cpu --experiment ablation --compare block:baseline \
    --compare full:baseline --start-seeds 4 --step 2 --max-seeds 8 --stop width --half-width 0.03 \
    --lanes 2 --out results/ -- "${common[@]}" >> study/adaptive.log 2>&1 \
    || { echo "adaptive stage failed: study/adaptive.log" >&2; status=1; }

lane_a() {
  python run.py -m +sweep=study_cpu sweep.name=ablation "${common[@]}" train.seed=0,1,2 \
      residual=denseformer,hc,full_input_query,full_scalar,block_no_rmsnorm || return 1
  python run.py -m +sweep=block_size "${recipe[@]}" "${common[@]}" || return 1  # S = 1…32, baseline × 2 seeds
  python run.py -m +sweep=multihop "${common[@]}" || return 1
}
lane_b() {
  python run.py -m +sweep=study_cpu sweep.name=ablation "${common[@]}" train.seed=0,1,2 \
      residual=mhc,full_sigmoid,full_no_rmsnorm,sliding_window,block_multihead || return 1
  python run.py -m +sweep=scaling "${common[@]}" || return 1   # 5 sizes × 3 variants × 2 seeds
  python run.py -m +sweep=arch "${common[@]}" train.seed=0,1 || return 1
}
lane_a >> study/lane_a.log 2>&1 & a=$!
lane_b >> study/lane_b.log 2>&1 & b=$!
wait $a || { echo "lane a failed: study/lane_a.log" >&2; status=1; }
wait $b || { echo "lane b failed: study/lane_b.log" >&2; status=1; }

python -m analysis export --tracking-uri "$MLFLOW_TRACKING_URI" --out results/runs.csv || exit 1
python -m analysis report --snapshot results/runs.csv --out results/ || exit 1
exit $status
