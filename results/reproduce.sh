#!/usr/bin/env bash
# Reproduce results/ on a 2-core CPU: the paper's experiments at micro scale (issue 8).
#
#   bash results/reproduce.sh          # 141 runs; about 2 hours here on a 2-core machine shared with other work
#
# Resumable: a study that is interrupted (Ctrl-C, a reboot, kill -9) is continued by running the
# same command again. Every job's folder is keyed by its resolved config (harness/checkpoint.py), so
# finished runs return their recorded result without training, interrupted ones resume from their
# last checkpoint into the same MLflow run, and nothing is trained twice.
#
# Two lanes of one thread each keep both cores busy (one thread per job is faster per core than
# two threads on this machine). The runs go to their own tracking store, study/mlflow.db (not
# committed); results/runs.csv is the committed snapshot and results/REPORT.md is regenerated
# from it with one command (last line).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p study
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$PWD/study/mlflow.db}"
# train.code_change=keep: a study continued after the code changed keeps its finished runs' results
# and resumes the interrupted ones (the default refuses them in one line naming the changed files).
common=(train.threads=1 train.progress=false train.checkpoint_dir="$PWD/study/checkpoints"
        train.code_change=keep hydra.sweep.dir="study/multirun/\${sweep.name}")
status=0
# The learning-rate grid's variants, split over the two lanes.
LR_A=baseline,denseformer,hc,mhc,full,full_input_query,full_scalar
LR_B=full_sigmoid,full_no_rmsnorm,sliding_window,block,block_multihead,block_no_rmsnorm

lane_a() {
  python run.py -m +sweep=ablation "${common[@]}" || return 1   # Table 4: 13 variants x 3 seeds
  python run.py -m +sweep=multihop "${common[@]}" || return 1   # multi-hop probe: 4 variants x 2 seeds
  python run.py -m +sweep=tuned_lr residual="$LR_A" "${common[@]}" || return 1   # Table 4 at lr 1e-3, 1e-2
}
lane_b() {
  python run.py -m +sweep=block_size "${common[@]}" || return 1 # Fig. 6: S = 1…32 and the baseline x 2 seeds
  python run.py -m +sweep=scaling "${common[@]}" || return 1    # Fig. 4: 4 sizes x 3 variants x 2 seeds
  python run.py -m +sweep=arch "${common[@]}" || return 1       # Fig. 7: 5 x 3 shapes x baseline/block
  python run.py -m +sweep=tuned_lr residual="$LR_B" "${common[@]}" || return 1
}
lane_a >> study/lane_a.log 2>&1 & a=$!
lane_b >> study/lane_b.log 2>&1 & b=$!
wait $a || { echo "lane a (ablation, multihop) failed: study/lane_a.log" >&2; status=1; }
wait $b || { echo "lane b (block_size, scaling, arch) failed: study/lane_b.log" >&2; status=1; }

python -m analysis export --tracking-uri "$MLFLOW_TRACKING_URI" --out results/runs.csv || exit 1
python -m analysis report --snapshot results/runs.csv --out results/ || exit 1
exit $status
