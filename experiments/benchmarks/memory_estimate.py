r"""Compiled memory of a config's training step per stage, without running it (or allocating).

  PYTHONPATH=. python experiments/benchmarks/memory_estimate.py [--gin_file=gin_configs/small.gin]
      [--seq_lens=65536,262144,1048576] [--remat=full] [--position_chunk_tokens=65536] [--smoke]

For each row length: the stage's implementation settings (`Config.stage_impl`:
ImplConfig.stage_remat / --remat) and batch
(tokens_per_step // seq_len rows, micro-batched as StagesConfig.microbatch_tokens says), an
abstract train state (`jax.eval_shape`), `make_train_step(...).lower(state, batch).compile()`
and its `memory_analysis()`. Prints one JSON line per length: temp (the step's scratch: live
activations, saved residuals, gradients in flight), argument, output and alias bytes, and
peak_estimate = temp + argument + output - alias (GiB too). On CPU the KDA runs its XLA chunked path
and attention the blockwise XLA path, so a GPU compile (Pallas / tokamax kernels) differs: CPU
numbers are an estimate. On a GPU it is the compiler's own figure for that device.
--smoke: the tiny config at 64 and 256 tokens (seconds, CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp

from k3jax import config as config_lib
from k3jax import training as train_lib
from k3jax.model import K3Model, init_variables
from k3jax.training import optim

GIB = float(1 << 30)


def estimate(cfg: config_lib.Config, seq_len: int) -> dict:
  """Compiled memory of `cfg`'s train step at rows of `seq_len` (one stage of that length)."""
  stage = [s for s, _ in cfg.stages.stages].index(seq_len)
  impl = cfg.stage_impl(stage)
  stage_cfg = dataclasses.replace(cfg, impl=impl)
  # The state's shapes as `training.init_train_state` builds it, traced only (its jit cannot
  # nest).
  abstract_vars = jax.eval_shape(
      lambda: init_variables(cfg.model, jax.random.PRNGKey(0), 1, cfg.stages.stages[0][0],
                             impl=impl))
  optimizer, schedule = optim.make_optimizer(cfg.optimizer, cfg.stages.total_steps,
                                             optim.logical_axes(abstract_vars["params"]))

  def assemble(boxed):
    params = optim.unbox(boxed["params"])
    return train_lib.TrainState(step=jnp.zeros([], jnp.int32), params=params,
                                opt_state=optimizer.init(params),
                                moe_state=optim.unbox(boxed.get("moe_state", {})),
                                rng=jax.random.PRNGKey(0))

  state = jax.eval_shape(assemble, abstract_vars)
  step = train_lib.make_train_step(stage_cfg, K3Model(cfg.model, impl), optimizer, schedule)
  rows = cfg.stages.batch_size(stage)
  tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens,
           "loss_mask": jax.ShapeDtypeStruct((rows, seq_len), jnp.float32)}
  t0 = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  seconds = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  temp, arg = mem.temp_size_in_bytes, mem.argument_size_in_bytes
  out, alias = mem.output_size_in_bytes, mem.alias_size_in_bytes
  peak = temp + arg + out - alias
  return {"seq_len": seq_len, "stage": stage, "batch_rows": rows,
          "rows_per_microbatch": cfg.stages.microbatch_rows(seq_len, rows),
          "remat": impl.remat, "position_chunk_tokens": impl.position_chunk_tokens,
          "backend": jax.default_backend(), "temp_bytes": temp, "argument_bytes": arg,
          "output_bytes": out, "alias_bytes": alias, "temp_gib": round(temp / GIB, 2),
          "peak_estimate_gib": round(peak / GIB, 2), "compile_s": round(seconds, 1)}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--gin_file", default="gin_configs/small.gin")
  p.add_argument("--gin_bindings", action="append", default=[])
  p.add_argument("--seq_lens", default="65536,262144,1048576",
                 help="comma-separated row lengths, each one of the config's stage lengths")
  p.add_argument("--remat", default="", help="ImplConfig.remat for every stage (overrides "
                 "ImplConfig.stage_remat); empty: the config's")
  p.add_argument("--position_chunk_tokens", type=int, default=-1,
                 help="ImplConfig.position_chunk_tokens; -1: the config's")
  p.add_argument("--smoke", action="store_true", help="tiny.gin at 64 and 256 tokens (CPU)")
  args = p.parse_args()
  gin_file, seq_lens = args.gin_file, [int(s) for s in args.seq_lens.split(",") if s]
  bindings = list(args.gin_bindings)
  if args.smoke:
    gin_file, seq_lens = "gin_configs/tiny.gin", [64, 256]
    bindings.append("StagesConfig.stages = ((64, 2), (256, 2))")
  if args.remat:
    bindings += ["ImplConfig.stage_remat = ()", f"ImplConfig.remat = {args.remat!r}"]
  if args.position_chunk_tokens >= 0:
    bindings.append(f"ImplConfig.position_chunk_tokens = {args.position_chunk_tokens}")
  cfg = config_lib.from_gin([gin_file], bindings)
  for seq_len in seq_lens:
    try:
      record = estimate(cfg, seq_len)
    except Exception as e:  # one JSON line per case, errors included
      record = {"seq_len": seq_len, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
  main()
