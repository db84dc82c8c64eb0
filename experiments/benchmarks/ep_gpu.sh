#!/usr/bin/env bash
# Expert parallelism on one machine with two GPUs: small.gin's training step on one GPU against two
# (ep_bench.py), and a short run of the training CLI with its experts split over both GPUs.
#
#   bash experiments/benchmarks/ep_gpu.sh [LOG_DIR] [STEP...]
#
# Run from anywhere (it runs in the repository root); needs k3jax installed with its GPU extras
# (pip install -e ".[gpu]"). LOG_DIR (default runs/ep_gpu) receives one log per step. STEP is any
# of, in the order given (default: bench train):
#   bench    tokens/s on one GPU against two (layout expert:2) at the same global batch of 32K
#            tokens (16 rows of 2048, micro-batched as small.gin says) -> LOG_DIR/ep_32k.jsonl
#   train    small.gin trains with --mesh=expert:2 on text for 16 steps -> LOG_DIR/train_ep.log,
#            with the run's metrics.jsonl and eval.json (its run directory: LOG_DIR/train_ep)
#   bench64  64K tokens a step without micro-batches (32 rows of 2048): one GPU's memory limit
#            -> LOG_DIR/ep_64k.jsonl
# Each step has its own time limit, so that a stuck one leaves the others their time; start-up is
# a few minutes per process (compiling the initialisation, the step and the evaluation).
set -u
out=${1:-runs/ep_gpu}
shift || true
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(bench train)
mkdir -p "$out" && out=$(cd "$out" && pwd)   # LOG_DIR is relative to where the script is run
cd "$(dirname "$0")/../.."
bench=experiments/benchmarks/ep_bench.py
common=(--gin_file=gin_configs/small.gin --steps=6 --warmup=2 --profile_steps=2)
export XLA_PYTHON_CLIENT_PREALLOCATE=false

for step in "${steps[@]}"; do
  echo "=== $step"
  case $step in
    bench)
      timeout 600 python3 "$bench" "${common[@]}" --layouts=single,expert:2 --seq_len=2048 \
        --batch=16 --layout_timeout=290 2>&1 | grep '^{' | tee "$out/ep_32k.jsonl" ;;
    train)
      rm -rf "$out/train_ep"
      timeout 900 python3 -m k3jax.train --gin_file=gin_configs/small.gin --mesh=expert:2 \
        --workdir="$out/train_ep" --max_steps=16 --noprogress \
        --gin_bindings='StagesConfig.tokens_per_step = 32768' \
        --gin_bindings='StagesConfig.stages = ((2048, 40), (8192, 10))' \
        --gin_bindings='DataConfig.max_bytes = 8000000' \
        --gin_bindings='EvalConfig.every_steps = 4' --gin_bindings='EvalConfig.num_batches = 2' \
        --gin_bindings='EvalConfig.passkey_multipliers = (1,)' \
        --gin_bindings='EvalConfig.log_every_steps = 1' \
        --gin_bindings='CheckpointConfig.every_steps = 1000' > "$out/train_ep.log" 2>&1
      echo "train exit $?" | tee -a "$out/train_ep.log"
      cp "$out/train_ep/metrics.jsonl" "$out/train_ep/eval.json" "$out/" 2>/dev/null ;;
    bench64)
      timeout 600 python3 "$bench" "${common[@]}" --layouts=single,expert:2 --seq_len=2048 \
        --batch=32 --gin_bindings='StagesConfig.microbatch_tokens = 0' \
        --layout_timeout=290 2>&1 | grep '^{' | tee "$out/ep_64k.jsonl" ;;
    *) echo "ep_gpu.sh: unknown step $step (allowed: bench train bench64)"; exit 2 ;;
  esac
done
