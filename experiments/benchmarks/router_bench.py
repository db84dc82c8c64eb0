"""The MoE router's small ops on one device, k3jax's against what they replaced (copied here):

  logits     `k3jax.layers.common.dot_in_fp32` (x bf16 [T, d] @ w fp32 [d, E], one bf16 matmul
             against w's three exact bf16 pieces) against the fp32 HIGHEST matmul; forward and
             both gradients (a value-and-grad of sum(logits · cotangent)).
  qb         Quantile Balancing's thresholds (`quantile_balance_thresholds`, a radix select)
             against lax.top_k of the ⌊q⌋+2 largest margins per expert (the code before).
  top_k      `top_k_by_rounds(scores, k)` against lax.top_k (the router's pick of k of E).

Shapes: medium.gin's 32K-token micro-batch (d 1536, 48 experts, top-4), small.gin's (768, 32).
ms per call: median of 5 batches of 20 calls after a warm-up; each row says max |new − old|
(0 where the results must be identical). One JSON line per row.

Run (one GPU): PYTHONPATH=. python experiments/benchmarks/router_bench.py;  --smoke: tiny, on CPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import common
from k3jax.layers.moe import quantile_balance_thresholds
from k3jax.ops.moe import qb_margins
from k3jax.ops.order_statistics import top_k_by_rounds


def _time_ms(fn, *args, reps: int = 20, batches: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  per_batch = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    per_batch.append((time.perf_counter() - t0) / reps * 1e3)
  return statistics.median(per_batch)


def _fp32_logits(x, w):
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _old_thresholds(scores, bias, top_k):
  """quantile_balance_thresholds before the radix select (cutoff='token', no mask)."""
  rows, n = scores.shape
  margin = qb_margins(scores + bias, top_k, "token")
  q = rows * top_k / n
  depth = min(rows, int(rows * top_k // n) + 2)
  top = jax.lax.top_k(margin.T, depth)[0]
  lo = min(int(q), rows - 1)
  hi = min(lo + 1, rows - 1)
  rank = jnp.arange(depth)
  t_lo = jnp.sum(jnp.where(rank == lo, top, 0.0), axis=1)
  t_hi = jnp.sum(jnp.where(rank == hi, top, 0.0), axis=1)
  return t_lo + (q - int(q)) * (t_hi - t_lo)


def run(tokens: int, width: int, experts: int, top_k: int, name: str) -> None:
  kx, kw, kc, kb = jax.random.split(jax.random.PRNGKey(0), 4)
  x = jax.random.normal(kx, (tokens, width), jnp.float32).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (width, experts), jnp.float32)
  cot = jax.random.normal(kc, (tokens, experts), jnp.float32)

  def grad_of(f):
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * cot), argnums=(0, 1)))

  new, old = grad_of(common.dot_in_fp32), grad_of(_fp32_logits)
  (_, (dx_n, dw_n)), (_, (dx_o, dw_o)) = new(x, w), old(x, w)
  y_n, y_o = jax.jit(common.dot_in_fp32)(x, w), jax.jit(_fp32_logits)(x, w)
  print(json.dumps(dict(case=name, op="logits fwd+bwd", new_ms=round(_time_ms(new, x, w), 4),
                        old_ms=round(_time_ms(old, x, w), 4),
                        max_diff_logits=float(jnp.max(jnp.abs(y_n - y_o))),
                        max_diff_dw=float(jnp.max(jnp.abs(dw_n - dw_o))),
                        max_diff_dx=float(jnp.max(jnp.abs(dx_n.astype(jnp.float32)
                                                          - dx_o.astype(jnp.float32)))))),
        flush=True)

  scores = jax.nn.sigmoid(jax.jit(common.dot_in_fp32)(x, w))
  bias = 0.05 * jax.random.normal(kb, (experts,), jnp.float32)
  new_qb = jax.jit(lambda s, b: quantile_balance_thresholds(s, b, top_k)[0])
  old_qb = jax.jit(lambda s, b: _old_thresholds(s, b, top_k))
  print(json.dumps(dict(case=name, op="qb thresholds", new_ms=round(_time_ms(new_qb, scores, bias), 4),
                        old_ms=round(_time_ms(old_qb, scores, bias), 4),
                        max_diff=float(jnp.max(jnp.abs(new_qb(scores, bias)
                                                       - old_qb(scores, bias)))))), flush=True)

  biased = scores + bias
  new_tk = jax.jit(lambda s: top_k_by_rounds(s, top_k))
  old_tk = jax.jit(lambda s: jax.lax.top_k(s, top_k))
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(new_tk(biased), old_tk(biased)))
  print(json.dumps(dict(case=name, op=f"top_k {top_k} of {experts}",
                        new_ms=round(_time_ms(new_tk, biased), 4),
                        old_ms=round(_time_ms(old_tk, biased), 4), identical=same)), flush=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
  args = p.parse_args()
  print(json.dumps(dict(device=str(jax.devices()[0].device_kind))), flush=True)
  if args.smoke:
    run(256, 64, 8, 2, "smoke")
    return
  run(32768, 1536, 48, 4, "medium.gin")
  run(32768, 768, 32, 4, "small.gin")


if __name__ == "__main__":
  main()
