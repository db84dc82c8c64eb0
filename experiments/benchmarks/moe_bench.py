r"""The MoE's routed experts on one device: the grouped matmul alone, then the LatentMoE layer.

One JSON line per result (`event: result`), three parts (--parts, default all):

  grouped  the grouped matmul alone, bf16 inputs and fp32 outputs as in `grouped_situ_glu`, at
           small.gin's shapes (16 x 2048 tokens x top-4 = 131072 rows; gate+up 384 -> 32 experts x
           1024, out 512 -> 384), random group sizes summing to the rows, for 'ragged_dot'
           (jax.lax.ragged_dot), 'tiled' (tiled_ragged_dot) and 'tokamax' (tokamax_ragged_dot:
           Mosaic GPU on an H200, XLA on CPU; the row says which), from k3jax.ops.grouped_matmul:
           fwd_ms, fwdbwd_ms (value and both gradients), TFLOP/s of each (2·rows·K·N per matmul,
           three matmuls for fwd+bwd).
  layer    `k3jax.layers.moe.LatentMoE` with small.gin's ModelConfig and ImplConfig at 16 x 2048
           tokens (bf16), forward+backward (gradients of the parameters and the input) for each
           of --matmuls (ImplConfig.moe_grouped_matmul: 'tiled' = the old choice, 'tokamax' = the
           new one), fwdbwd_ms, and the loss value
           (equal across choices up to bf16 rounding).
  trace    the same layer step under jax.profiler: device time of the kernels whose name has
           'scatter' or 'gather' in it, and the total, per choice (trace_times.py reads the
           trace; on CPU there is no device plane and the row says so).

Times: the median of --iters calls after --warmup calls, each call ended by block_until_ready.

  PYTHONPATH=. python experiments/benchmarks/moe_bench.py                 # one H200
  PYTHONPATH=. python experiments/benchmarks/moe_bench.py --smoke         # tiny shapes, CPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import config as config_lib
from k3jax.layers import common
from k3jax.layers.moe import LatentMoE
from k3jax.ops import grouped_matmul

GROUPED_CHOICES = ("ragged_dot", "tiled", "tokamax")


def emit(**row):
  print(json.dumps(row), flush=True)


def time_ms(fn, *args, warmup: int, iters: int) -> float:
  """Median wall time of fn(*args) in ms, each call ended by block_until_ready."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(times)


def grouped_fn(choice: str):
  """(the grouped matmul of `choice`, a name saying which implementation runs)."""
  fn = grouped_matmul.default_ragged_dot(choice)
  if choice == "tokamax":
    return fn, f"tokamax:{fn.keywords['implementation']}"
  return fn, choice


def random_group_sizes(rows: int, groups: int, seed: int = 0) -> np.ndarray:
  """Group sizes of `rows` rows drawn uniformly over `groups` groups (sum = rows)."""
  return np.random.default_rng(seed).multinomial(rows, np.full(groups, 1.0 / groups)).astype(
      np.int32)


def bench_grouped(rows: int, shapes: dict, experts: int, args) -> None:
  """Part 'grouped' of the module docstring, for each of `shapes` {name: (K, N)}."""
  gs = jnp.asarray(random_group_sizes(rows, experts))
  for name, (k_dim, n_dim) in shapes.items():
    key_x, key_w, key_c = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(key_x, (rows, k_dim), jnp.bfloat16)
    w = (jax.random.normal(key_w, (experts, k_dim, n_dim), jnp.float32) / k_dim**0.5).astype(
        jnp.bfloat16)
    cot = jax.random.normal(key_c, (rows, n_dim), jnp.float32)
    flops = 2.0 * rows * k_dim * n_dim
    for choice in GROUPED_CHOICES:
      fn, impl = grouped_fn(choice)
      fwd = jax.jit(lambda x, w, fn=fn: fn(x, w, gs, preferred_element_type=jnp.float32))
      fwdbwd = jax.jit(jax.value_and_grad(
          lambda x, w, fn=fn: jnp.sum(fn(x, w, gs, preferred_element_type=jnp.float32) * cot),
          argnums=(0, 1)))
      row = dict(part="grouped", matmul=name, impl=impl, rows=rows, k=k_dim, n=n_dim,
                 experts=experts, dtype="bfloat16")
      try:
        fwd_ms = time_ms(fwd, x, w, warmup=args.warmup, iters=args.iters)
        fwdbwd_ms = time_ms(fwdbwd, x, w, warmup=args.warmup, iters=args.iters)
      except Exception as e:  # e.g. XLA's dense ragged_dot running out of memory: report, go on
        emit(event="result", **row, error=f"{type(e).__name__}: {str(e)[:300]}")
        continue
      emit(event="result", **row, fwd_ms=round(fwd_ms, 4), fwdbwd_ms=round(fwdbwd_ms, 4),
           fwd_tflops=round(flops / fwd_ms / 1e9, 2),
           fwdbwd_tflops=round(3 * flops / fwdbwd_ms / 1e9, 2))


def layer_step(model_cfg, impl_cfg, choice: str, batch: int, seq_len: int):
  """(jitted fwd+bwd of LatentMoE(model_cfg, impl_cfg) with ImplConfig.moe_grouped_matmul =
  choice, params, x)."""
  layer = LatentMoE(model_cfg, dataclasses.replace(impl_cfg, moe_grouped_matmul=choice))
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, model_cfg.d_model), jnp.float32)
  x = x.astype(common.to_dtype(model_cfg.dtype))
  variables = layer.init(jax.random.PRNGKey(0), x)
  params, moe_state = variables["params"], variables["moe_state"]

  def loss(params, x):
    y = layer.apply({"params": params, "moe_state": moe_state}, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, x


def bench_layer(model_cfg, impl_cfg, args) -> None:
  for choice in args.matmuls:
    step, params, x = layer_step(model_cfg, impl_cfg, choice, args.batch, args.seq_len)
    ms = time_ms(step, params, x, warmup=args.warmup, iters=args.iters)
    value = float(step(params, x)[0])
    impl = grouped_fn(choice)[1] if choice in GROUPED_CHOICES else choice
    emit(event="result", part="layer", matmul=choice, impl=impl, batch=args.batch,
         seq_len=args.seq_len, dtype=model_cfg.dtype, fwdbwd_ms=round(ms, 3), loss=value)


def bench_trace(model_cfg, impl_cfg, args) -> None:
  from experiments.benchmarks.trace_times import device_line_times, stream_kernel_times
  for choice in args.matmuls:
    step, params, x = layer_step(model_cfg, impl_cfg, choice, args.batch, args.seq_len)
    jax.block_until_ready(step(params, x))
    with tempfile.TemporaryDirectory() as logdir:
      with jax.profiler.trace(logdir):
        for _ in range(args.trace_steps):
          jax.block_until_ready(step(params, x))
      lines = device_line_times(logdir)
    row = dict(part="trace", matmul=choice, batch=args.batch, seq_len=args.seq_len,
               steps=args.trace_steps)
    if lines is None:
      emit(event="result", **row, note="no device plane (CPU): nothing to read")
      continue
    kernels = stream_kernel_times(lines)
    per_step = lambda ns: round(ns / 1e6 / args.trace_steps, 4)
    pick = lambda word: sum(t for name, t in kernels.items() if word in name.lower())
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    emit(event="result", **row, total_ms=per_step(sum(kernels.values())),
         scatter_ms=per_step(pick("scatter")), gather_ms=per_step(pick("gather")),
         top_kernels_ms={name[:80]: per_step(t) for name, t in top})


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes (tiny.gin's layer), runs on CPU")
  p.add_argument("--parts", default="grouped,layer,trace")
  p.add_argument("--matmuls", default="tiled,tokamax",
                 help="the layer's ImplConfig.moe_grouped_matmul choices")
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--seq_len", type=int, default=None)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--trace_steps", type=int, default=3)
  args = p.parse_args(argv)
  args.matmuls = args.matmuls.split(",")
  parts = args.parts.split(",")
  for part in parts:
    if part not in ("grouped", "layer", "trace"):
      raise ValueError(f"--parts: {part!r} is not one of grouped, layer, trace")
  if args.smoke:
    gin, rows, experts, shapes = "gin_configs/tiny.gin", 512, 8, {"gate_up": (32, 128),
                                                                  "out": (64, 32)}
    args.batch, args.seq_len = args.batch or 2, args.seq_len or 64
    args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
  else:
    gin, rows, experts, shapes = "gin_configs/small.gin", 131072, 32, {"gate_up": (384, 1024),
                                                                       "out": (512, 384)}
    args.batch, args.seq_len = args.batch or 16, args.seq_len or 2048
  cfg = config_lib.from_gin([gin])
  model_cfg, impl_cfg = cfg.model, cfg.impl
  if args.smoke:  # tiny.gin trains in fp32 on CPU; the GPU shapes are bf16 like small.gin
    model_cfg = dataclasses.replace(model_cfg, dtype="bfloat16")
  devices = jax.devices()
  emit(event="start", backend=jax.default_backend(), device=devices[0].device_kind,
       jax=jax.__version__, gin=gin, smoke=args.smoke, argv=sys.argv[1:])
  if "grouped" in parts:
    bench_grouped(rows, shapes, experts, args)
  if "layer" in parts:
    bench_layer(model_cfg, impl_cfg, args)
  if "trace" in parts:
    bench_trace(model_cfg, impl_cfg, args)


if __name__ == "__main__":
  main()
