#!/usr/bin/env bash
# Issue 5's measurements on one host with two GPUs, in priority order, each step with its own time
# limit so that one stuck step cannot eat the others' time. Logs go to ${OUT:-runs/ep_gpu}.
#   source experiments/benchmarks/gpu_env.sh && bash experiments/benchmarks/ep_gpu.sh
# Budget: about 9 minutes in all (compilation of small.gin's step is 1-2 minutes per layout).
set -u
out=${OUT:-runs/ep_gpu}
mkdir -p "$out"
bench=experiments/benchmarks/ep_bench.py
common=(--gin_file=gin_configs/small.gin --steps=6 --warmup=2 --profile_steps=2)

# 1. tokens/s on one GPU vs two (expert-parallel, and data-parallel for reference), 32K tokens.
timeout 300 python3 "$bench" "${common[@]}" --layouts=single,expert:2,data:2 --seq_len=2048 \
  --batch=16 --layout_timeout=140 2>&1 | grep '^{' | tee "$out/ep_32k.jsonl"
# 2. small.gin trains with expert parallelism on text: a short run of the real CLI.
timeout 150 python3 -m k3jax.train --gin_file=gin_configs/small.gin --mesh=expert:2 \
  --workdir=/tmp/small_ep --max_steps=15 \
  --gin_bindings='StagesConfig.tokens_per_step = 32768' \
  --gin_bindings='StagesConfig.stages = ((2048, 40), (8192, 10))' \
  --gin_bindings='DataConfig.max_bytes = 8000000' --gin_bindings='EvalConfig.every_steps = 5' \
  --gin_bindings='CheckpointConfig.every_steps = 1000' > "$out/train_ep.log" 2>&1
echo "train exit $?"
cp /tmp/small_ep/metrics.jsonl "$out/train_ep_metrics.jsonl" 2>/dev/null
# 3. the same at 64K tokens at once (no micro-batches; 1/16 of small.gin's 1M), if time is left.
timeout 200 python3 "$bench" "${common[@]}" --layouts=single,expert:2 --seq_len=2048 --batch=32 \
  --gin_bindings='StagesConfig.microbatch_tokens = 0' \
  --layout_timeout=95 2>&1 | grep '^{' | tee "$out/ep_64k.jsonl"
