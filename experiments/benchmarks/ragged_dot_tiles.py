r"""Tile sweep of the MoE's grouped-matmul kernels at its shapes, with their errors (one H200).

The routed experts run three kernels per matmul (`k3jax.ops.grouped_matmul.tokamax_ragged_dot`):
the forward and dlhs on tokamax's `ragged_dot_sm90` (dlhs against the weights transposed), and
drhs, the weights' gradient, on k3jax's `pallas_kernels.grouped_matmul` (tokamax's
`ragged_contracting_dim_dot_sm90` returned wrong sums: RESULTS.md run 18). Without an
autotuning-cache entry tokamax picks 64 x 64 x 128 tiles with two stages on sm90.

Each kernel runs with each of --configs at small.gin's and medium.gin's shapes (4 x 8192 tokens,
top-4: 131072 rows), bf16 in and out as in `grouped_situ_glu`. A config is 'heuristic' (tokamax's
choice), 'block_m:block_n:block_k:stages:persistent' (tokamax's kernel with those tiles), or for
drhs 'pallas:block_k:block_n:block_rows:warps:stages' (k3jax's kernel). One JSON line per (shape,
kernel, config): median ms of --iters calls, TFLOP/s (2·M·K·N), the error ratio against a dense
fp32 reference per --draws of group sizes (max |difference| over max |reference|; bf16 output
rounding alone gives ~0.004; batched matmuls over the groups' rows padded to the largest group),
whether a second call returned the same bits, or the error a config raised. Configs whose error
ratio exceeds --max_err are reported but not ranked; a last line per (shape, kernel) names the
fastest correct config and its ratio against tokamax's heuristic, timed in the same run.

  PYTHONPATH=. python experiments/benchmarks/ragged_dot_tiles.py              # one H200
  PYTHONPATH=. python experiments/benchmarks/ragged_dot_tiles.py --kernels=drhs \
      --draws=uniform,skewed,empty,short --configs=heuristic,pallas:128:128:64:8:3
"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops import grouped_matmul
from k3jax.ops.moe_rows import zero_rows
from moe_bench import time_ms   # this folder (the script's) is on sys.path
from pallas_kernels.grouped_matmul import GroupedGradConfig, grouped_weight_grad

# (rows, K, N, experts) of each grouped matmul's forward: gate+up (latent -> 2·expert_dim) and
# down (expert_dim -> latent), at 4 x 8192 tokens, top-4.
CASES = {
    "small_up": (131072, 384, 1024, 32),
    "small_down": (131072, 512, 384, 32),
    "medium_up": (131072, 768, 1536, 48),
    "medium_down": (131072, 768, 768, 48),
}
KERNELS = ("fwd", "dlhs", "drhs")
HEURISTIC = "heuristic"
DEFAULT_CONFIGS = ",".join([
    HEURISTIC, "64:64:128:2:0", "128:64:128:2:0", "128:64:64:4:0", "128:64:128:4:0",
    "128:128:64:2:0", "128:128:64:3:0", "128:128:64:4:0", "128:128:128:2:0", "128:128:128:3:0",
    "64:128:64:4:0", "64:128:128:4:0", "128:256:64:2:0", "128:128:64:4:1", "128:64:128:4:1",
    "64:64:256:4:0"])


def emit(**row):
  print(json.dumps(row), flush=True)


def parse_config(text: str):
  """'bm:bn:bk:stages:persistent' -> tokamax's sm90 ragged-dot Config; 'heuristic' -> None."""
  if text == HEURISTIC:
    return None
  bm, bn, bk, stages, persistent = (int(x) for x in text.split(":"))
  return grouped_matmul.sm90_config(bm, bn, bk, stages, bool(persistent))


def dimension_numbers(kernel: str) -> jax.lax.RaggedDotDimensionNumbers:
  """The ragged-dot dimension numbers of the forward, dlhs and drhs (as k3jax's VJP calls them)."""
  if kernel == "fwd":
    return jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
  return {"dlhs": grouped_matmul._DLHS_DIMS,  # pylint: disable=protected-access
          "drhs": grouped_matmul._DRHS_DIMS}[kernel]  # pylint: disable=protected-access


def kernel_fn(kernel: str, text: str):
  """A jitted fn(lhs, rhs_or_dout, group_sizes) running one kernel: tokamax's with the tiles of
  `text`, or for drhs 'pallas:bk:bn:rows:warps:stages', k3jax's `grouped_weight_grad`."""
  if text.startswith("pallas:"):
    if kernel != "drhs":
      raise ValueError(f"{text}: the Pallas kernel computes drhs only")
    bk, bn, br, warps, stages = (int(x) for x in text.split(":")[1:])
    cfg = GroupedGradConfig(block_k=bk, block_n=bn, block_rows=br, launch=(warps, stages))
    return jax.jit(lambda a, b, gs: grouped_weight_grad(a, b, gs, jnp.bfloat16, cfg))
  config = parse_config(text)
  from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu  # pylint: disable=import-outside-toplevel
  op = pallas_mosaic_gpu.PallasMosaicGpuRaggedDot(config=config)
  dims = dimension_numbers(kernel)

  def fn(a, b, group_sizes):
    return op(a, b, group_sizes=group_sizes, ragged_dot_dimension_numbers=dims,
              preferred_element_type=jnp.bfloat16)
  return jax.jit(fn)


def operands(kernel: str, rows: int, k: int, n: int, experts: int):
  """The operands of `kernel` for the forward matmul [rows, k] x [experts, k, n]."""
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
  w = (jax.random.normal(kw, (experts, k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
  dout = jax.random.normal(kd, (rows, n), jnp.bfloat16)
  return {"fwd": (x, w), "dlhs": (dout, w), "drhs": (x, dout)}[kernel]


def reference(kernel: str, a: jax.Array, b: jax.Array, sizes: np.ndarray) -> jax.Array:
  """`kernel`'s result in fp32 from dense batched matmuls over the groups' rows, padded to the
  largest group (one [G, C, ·] gather, no ragged op involved): fwd [M, N], dlhs [M, K],
  drhs [G, K, N]. Rows past Σ sizes are zero in fwd and dlhs."""
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  cap = max(int(sizes.max()), 1)
  pos = np.arange(cap)[None]
  valid = pos < sizes[:, None]                                  # [G, C]
  idx = np.where(valid, starts[:, None] + pos, 0)               # [G, C]
  hi = jax.lax.Precision.HIGHEST
  a_pad = jnp.where(valid[..., None], a.astype(jnp.float32)[idx], 0.0)        # [G, C, ·]
  if kernel == "drhs":
    b_pad = jnp.where(valid[..., None], b.astype(jnp.float32)[idx], 0.0)
    return jnp.einsum("gck,gcn->gkn", a_pad, b_pad, precision=hi)
  w = b.astype(jnp.float32)
  out_pad = (jnp.einsum("gck,gkn->gcn", a_pad, w, precision=hi) if kernel == "fwd" else
             jnp.einsum("gcn,gkn->gck", a_pad, w, precision=hi))
  rows = np.arange(a.shape[0])
  group = np.searchsorted(np.cumsum(sizes), rows, side="right")  # G for rows past Σ sizes
  in_group = group < len(sizes)
  g = np.minimum(group, len(sizes) - 1)
  out = out_pad[g, np.where(in_group, rows - starts[g], 0)]
  return jnp.where(in_group[:, None], out, 0.0)


def defined_part(kernel: str, out: jax.Array, sizes: np.ndarray) -> jax.Array:
  """`out` with the rows past Σ sizes zeroed for fwd and dlhs: the kernels leave them unwritten
  (k3jax zeroes them after the call, `k3jax.ops.moe_rows.zero_rows`)."""
  if kernel == "drhs":
    return out
  rows_in_groups = grouped_matmul._rows_in_groups  # pylint: disable=protected-access
  keep = rows_in_groups(out.shape[0], jnp.asarray(sizes))
  return zero_rows(out, keep)


DRAWS = ("uniform", "skewed", "empty", "short")


def draw_group_sizes(draw: str, rows: int, experts: int) -> np.ndarray:
  """Group sizes summing to `rows` ('short': min(1000, rows / 10) fewer, as padding leaves them).
  uniform: multinomial over the experts; skewed: Dirichlet(0.3) proportions (groups of very
  different sizes, some tiny); empty: uniform with the first two and a middle group empty."""
  rng = np.random.default_rng(DRAWS.index(draw))
  if draw == "skewed":
    return rng.multinomial(rows, rng.dirichlet(np.full(experts, 0.3))).astype(np.int32)
  p = np.full(experts, 1.0)
  if draw == "empty":
    p[[0, 1, experts // 2]] = 0.0
  total = rows - min(1000, rows // 10) if draw == "short" else rows
  return rng.multinomial(total, p / p.sum()).astype(np.int32)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--kernels", default=",".join(KERNELS))
  p.add_argument("--configs", default=DEFAULT_CONFIGS)
  p.add_argument("--iters", type=int, default=15)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--draws", default="uniform",
                 help=f"group-size draws, comma-separated, of {DRAWS}; times are of the first")
  p.add_argument("--max_err", type=float, default=0.02,
                 help="largest error ratio against the fp32 reference that counts as correct")
  p.add_argument("--budget_s", type=float, default=1e9, help="stop starting new rows after this")
  args = p.parse_args()
  start = time.time()
  emit(kind="setup", device=jax.devices()[0].device_kind, jax=jax.__version__)
  for case in args.cases.split(","):
    rows, k, n, experts = CASES[case]
    draws = args.draws.split(",")
    sizes = {d: draw_group_sizes(d, rows, experts) for d in draws}
    for kernel in args.kernels.split(","):
      a, b = operands(kernel, rows, k, n, experts)
      refs = {}
      for d in draws:
        ref = reference(kernel, a, b, sizes[d])
        refs[d] = (ref, float(jnp.max(jnp.abs(ref))))
      times = {}
      for text in args.configs.split(","):
        if time.time() - start > args.budget_s:
          emit(kind="stopped", reason="budget_s")
          return
        row = dict(kind="time", case=case, kernel=kernel, config=text)
        try:
          fn = kernel_fn(kernel, text)
          errs, same = {}, True
          for d in draws:
            gs = jnp.asarray(sizes[d])
            out = defined_part(kernel, fn(a, b, gs), sizes[d])
            same &= bool(jnp.array_equal(out, defined_part(kernel, fn(a, b, gs), sizes[d])))
            ref, scale = refs[d]
            errs[d] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / scale
          ms = time_ms(fn, a, b, jnp.asarray(sizes[draws[0]]), warmup=args.warmup,
                       iters=args.iters)
        except Exception as e:  # a tile the kernel cannot take: report it and go on
          emit(**row, error=f"{type(e).__name__}: {str(e)[:200]}")
          continue
        correct = max(errs.values()) <= args.max_err
        if correct:
          times[text] = ms
        emit(**row, ms=round(ms, 4), tflops=round(2.0 * rows * k * n / ms / 1e9, 1),
             err_ratio={d: round(e, 5) for d, e in errs.items()}, correct=correct,
             repeatable=same)
      if times:
        best = min(times, key=times.get)
        emit(kind="best", case=case, kernel=kernel, config=best, ms=round(times[best], 4),
             heuristic_ms=times.get(HEURISTIC),
             speedup=round(times[HEURISTIC] / times[best], 3) if HEURISTIC in times else None)

if __name__ == "__main__":
  main()
