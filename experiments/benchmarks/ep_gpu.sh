#!/usr/bin/env bash
# Issue 5's measurements on one host with two GPUs, in priority order, each step with its own time
# limit so that one stuck step cannot eat the others' time. Logs go to ${OUT:-runs/ep_gpu}.
#   source experiments/benchmarks/gpu_env.sh && bash experiments/benchmarks/ep_gpu.sh
# Start-up on an H200 is about 3 minutes per process (session 3: compiling the initialisation
# 74-95 s, the training step 53-57 s plus 21-24 s of tracing, the evaluation 23 s), so each step
# below fits one 10-minute device call: EP_GPU_STEPS picks them ("train" by default; "bench",
# "bench64"). The "bench" figures of session 3 are in RESULTS.md.
set -u
out=${OUT:-runs/ep_gpu}
mkdir -p "$out"
steps=${EP_GPU_STEPS:-train}
bench=experiments/benchmarks/ep_bench.py
common=(--gin_file=gin_configs/small.gin --steps=6 --warmup=2 --profile_steps=2)

for step in $steps; do
  case $step in
    bench)  # tokens/s on one GPU vs two (expert-parallel), same global batch of 32K tokens.
      timeout 560 python3 "$bench" "${common[@]}" --layouts=single,expert:2 --seq_len=2048 \
        --batch=16 --layout_timeout=275 2>&1 | grep '^{' | tee "$out/ep_32k.jsonl" ;;
    train)  # small.gin trains with expert parallelism on text: a short run of the real CLI.
      timeout 420 python3 -m k3jax.train --gin_file=gin_configs/small.gin --mesh=expert:2 \
        --workdir=/tmp/small_ep --max_steps=16 --noprogress \
        --gin_bindings='StagesConfig.tokens_per_step = 32768' \
        --gin_bindings='StagesConfig.stages = ((2048, 40), (8192, 10))' \
        --gin_bindings='DataConfig.max_bytes = 8000000' \
        --gin_bindings='EvalConfig.every_steps = 4' --gin_bindings='EvalConfig.num_batches = 2' \
        --gin_bindings='EvalConfig.passkey_multipliers = (1,)' \
        --gin_bindings='EvalConfig.log_every_steps = 1' \
        --gin_bindings='CheckpointConfig.every_steps = 1000' > "$out/train_ep.log" 2>&1
      echo "train exit $?" | tee -a "$out/train_ep.log"
      cp /tmp/small_ep/metrics.jsonl /tmp/small_ep/eval.json "$out/" 2>/dev/null ;;
    bench64)  # 64K tokens at once (no micro-batches): the memory limit of one GPU.
      timeout 560 python3 "$bench" "${common[@]}" --layouts=single,expert:2 --seq_len=2048 \
        --batch=32 --gin_bindings='StagesConfig.microbatch_tokens = 0' ${EP_GPU_BINDINGS:-} \
        --layout_timeout=275 2>&1 | grep '^{' | tee "$out/ep_64k.jsonl" ;;
    *) echo "ep_gpu.sh: unknown step $step (allowed: bench train bench64)"; exit 2 ;;
  esac
done
