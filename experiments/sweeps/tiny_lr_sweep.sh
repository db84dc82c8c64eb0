#!/usr/bin/env bash
# A small grid over learning rate x MoE balancing on gin_configs/tiny.gin, one run directory per
# point, run one after the other. Each run resumes if its directory already has a checkpoint, so the
# script can simply be re-launched after an interruption.
#
#   experiments/sweeps/tiny_lr_sweep.sh [ROOT_DIR] [extra k3jax.train flags...]
#
# e.g.  experiments/sweeps/tiny_lr_sweep.sh /tmp/sweep --max_steps=60
# Results: ROOT_DIR/<name>/{metrics.jsonl,eval.json,plots/} (also when --max_steps stops a run
# early: eval.json then holds a validation pass at that step); a summary table of each run's last
# evaluation is printed at the end. Re-launching with the same --max_steps finds every run done
# and only prints the table; a larger --max_steps continues them.
set -euo pipefail

ROOT="${1:-runs/tiny_lr_sweep}"
shift || true
EXTRA=("$@")
cd "$(dirname "$0")/../.."

LEARNING_RATES=(1e-3 3e-3 1e-2)
BALANCE=(quantile aux_loss)

for lr in "${LEARNING_RATES[@]}"; do
  for balance in "${BALANCE[@]}"; do
    name="lr${lr}_${balance}"
    echo "=== ${name}"
    python -m k3jax.train \
      --gin_file=gin_configs/tiny.gin \
      --gin_bindings="OptimizerConfig.learning_rate = ${lr}" \
      --gin_bindings="ModelConfig.moe_balance = '${balance}'" \
      --workdir="${ROOT}/${name}" \
      --noprogress \
      "${EXTRA[@]}"
  done
done

python - "${ROOT}" <<'PY'
import json, os, sys
root = sys.argv[1]
print(f"{'run':<24} {'step':>6} {'val_loss':>9} {'val_bpb':>8}")
for name in sorted(os.listdir(root)):
  path = os.path.join(root, name, "metrics.jsonl")
  if not os.path.exists(path):
    continue
  evals = [json.loads(l) for l in open(path) if '"kind": "eval"' in l]
  if evals:
    e = evals[-1]
    print(f"{name:<24} {e['step']:>6} {e['val_loss']:>9.4f} {e['val_bpb']:>8.4f}")
  else:
    print(f"{name:<24} (no evaluation yet)")
PY
