"""The MoE router's logits on one device: `k3jax.layers.common.dot_in_fp32` (x bf16 [T, d] @ w
fp32 [d, E] as one bf16 matmul against w's three exact bf16 pieces) against the fp32 HIGHEST
matmul it replaced; forward and both gradients (a value-and-grad of sum(logits · cotangent)).
Also timed: Quantile Balancing's thresholds (`quantile_balance_thresholds`) and the router's
lax.top_k, the other small ops of the router (a radix select and argmax rounds were tried
for them: RESULTS.md run 27).

Shapes: medium.gin's 32K-token micro-batch (d 1536, 48 experts, top-4), small.gin's (768, 32).
ms per call: median of 5 batches of 20 calls after a warm-up; the logits row says max |new − old|.
One JSON line per row.

Run (one GPU): PYTHONPATH=. python experiments/benchmarks/router_bench.py;  --smoke: tiny, on CPU.
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from conv_bench import time_ms   # the same timing loop (this folder is on sys.path)
from k3jax.layers import common
from k3jax.layers.moe import quantile_balance_thresholds


REPS = 20


def _fp32_logits(x, w):
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


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
  print(json.dumps(dict(case=name, op="logits fwd+bwd",
                        new_ms=round(time_ms(new, (x, w), REPS), 4),
                        old_ms=round(time_ms(old, (x, w), REPS), 4),
                        max_diff_logits=float(jnp.max(jnp.abs(y_n - y_o))),
                        max_diff_dw=float(jnp.max(jnp.abs(dw_n - dw_o))),
                        max_diff_dx=float(jnp.max(jnp.abs(dx_n.astype(jnp.float32)
                                                          - dx_o.astype(jnp.float32)))))),
        flush=True)

  scores = jax.nn.sigmoid(jax.jit(common.dot_in_fp32)(x, w))
  bias = 0.05 * jax.random.normal(kb, (experts,), jnp.float32)
  qb = jax.jit(lambda s, b: quantile_balance_thresholds(s, b, top_k)[0])
  top_k_fn = jax.jit(lambda s: jax.lax.top_k(s, top_k))
  print(json.dumps(dict(case=name, op="qb thresholds",
                        ms=round(time_ms(qb, (scores, bias), REPS), 4))), flush=True)
  print(json.dumps(dict(case=name, op=f"top_k {top_k} of {experts}",
                        ms=round(time_ms(top_k_fn, (scores + bias,), REPS), 4))), flush=True)


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
