r"""The gradient accumulation's add for the routed experts' gate and up weights, two ways.

In the host micro-batch loop (`k3jax.microbatch`) every micro-batch adds its weighted gradients to
fp32 accumulators: acc += w · grad. The experts' gate and up projections run as one grouped matmul
against [E, ℓ, 2f] (`k3jax.ops.moe.grouped_situ_glu`), so their gradient is one [E, ℓ, 2f] bf16
array whose two halves XLA slices inside the two accumulators' (multi-output) add fusion:

  sliced    acc_gate += w · g[..., :f];  acc_up += w · g[..., f:]   (g bf16 [E, ℓ, 2f])
  separate  acc_gate += w · g_gate;      acc_up += w · g_up         (two bf16 [E, ℓ, f])

Both move the same bytes (fp32 read and write of each accumulator, the bf16 gradient read once).
Prints one JSON line per variant: ms per call, GB/s. medium.gin's shape by default.

    python experiments/benchmarks/accumulate_bench.py --experts=48 --latent=768 --hidden=768
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp


def sliced(acc_g, acc_u, g, w):
  f = acc_g.shape[-1]
  return (acc_g + w * g[..., :f].astype(jnp.float32), acc_u + w * g[..., f:].astype(jnp.float32))


def separate(acc_g, acc_u, g_gate, g_up, w):
  return acc_g + w * g_gate.astype(jnp.float32), acc_u + w * g_up.astype(jnp.float32)


def _time(fn, accs, grads, w, reps: int) -> float:
  """Seconds per call of fn(*accs, *grads, w), the accumulators donated and carried."""
  for _ in range(3):
    accs = fn(*accs, *grads, w)
  jax.block_until_ready(accs)
  t0 = time.perf_counter()
  for _ in range(reps):
    accs = fn(*accs, *grads, w)
  jax.block_until_ready(accs)
  return (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--experts", type=int, default=48)
  p.add_argument("--latent", type=int, default=768)
  p.add_argument("--hidden", type=int, default=768)
  p.add_argument("--reps", type=int, default=50)
  args = p.parse_args(argv)
  e, l, f = args.experts, args.latent, args.hidden
  key = jax.random.PRNGKey(0)
  acc = lambda: (jnp.zeros((e, l, f), jnp.float32), jnp.zeros((e, l, f), jnp.float32))
  g = jax.random.normal(key, (e, l, 2 * f), jnp.bfloat16)
  w = jnp.float32(0.03125)
  moved = 2 * e * l * f * (4 + 4 + 2)       # both accumulators read and written, g read
  variants = {"sliced": (sliced, (g,)), "separate": (separate, (g[..., :f], g[..., f:]))}
  results = {}
  for name, (fn, grads) in variants.items():
    jitted = jax.jit(fn, donate_argnums=(0, 1))
    s = _time(jitted, acc(), grads, w, args.reps)
    results[name] = jitted(*acc(), *grads, w)
    print(json.dumps({"variant": name, "shape": [e, l, f], "ms": round(s * 1e3, 4),
                      "gb_per_s": round(moved / s / 1e9, 1),
                      "device": jax.devices()[0].device_kind}), flush=True)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(results["sliced"], results["separate"]))
  print(json.dumps({"same_results": same}), flush=True)
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
