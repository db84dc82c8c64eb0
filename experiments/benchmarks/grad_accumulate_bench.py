r"""The routed experts' weight gradients added to the micro-batch accumulators, two ways.

In the host micro-batch loop (`k3jax.microbatch`) every micro-batch adds its weighted gradients to
fp32 accumulators: acc += w · grad. For the experts' weights the gradient comes from the grouped
weight-gradient kernel (`pallas_kernels.grouped_matmul`):

  separate  the kernel writes the bf16 gradient [E, ℓ, n]; an XLA add reads it back with the fp32
            accumulator and writes the accumulator (gate|up: one [E, ℓ, 2f] gradient, sliced by
            the two accumulators' adds), as the step does today;
  fused     `grouped_weight_grad_accumulate`: the kernel reads the fp32 accumulator tile and
            writes acc + w · sum into the accumulator's (donated) buffer.

medium.gin's shapes by default: 32K tokens × top-4 = 131072 rows in 48 groups (a random
partition), ℓ = f = 768; gate|up (lhs [M, ℓ], dout [M, 2f]) and out (lhs [M, f], dout [M, ℓ]).
Prints one JSON line per variant and matmul (ms per call, accumulators donated and carried) and one
with the fused results' largest difference from the fp32 sums (the same kernel with fp32 output).

    python experiments/benchmarks/grad_accumulate_bench.py --rows=131072 --experts=48
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import grouped_weight_grad, grouped_weight_grad_accumulate


def separate(lhs, dout, sizes, accs, w):
  g = grouped_weight_grad(lhs, dout, sizes, jnp.bfloat16)
  out, offset = [], 0
  for a in accs:
    n = a.shape[-1]
    out.append(a + w * g[..., offset:offset + n].astype(jnp.float32))
    offset += n
  return tuple(out)


def fused(lhs, dout, sizes, accs, w):
  return grouped_weight_grad_accumulate(lhs, dout, sizes, accs, w)


def _time(fn, lhs, dout, sizes, accs, w, reps: int) -> tuple[float, tuple]:
  """(seconds per call, final accumulators) of fn with the accumulators donated and carried."""
  for _ in range(3):
    accs = fn(lhs, dout, sizes, accs, w)
  jax.block_until_ready(accs)
  t0 = time.perf_counter()
  for _ in range(reps):
    accs = fn(lhs, dout, sizes, accs, w)
  jax.block_until_ready(accs)
  return (time.perf_counter() - t0) / reps, accs


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", type=int, default=131072)
  p.add_argument("--experts", type=int, default=48)
  p.add_argument("--latent", type=int, default=768)
  p.add_argument("--hidden", type=int, default=768)
  p.add_argument("--reps", type=int, default=30)
  args = p.parse_args(argv)
  m, e, l, f = args.rows, args.experts, args.latent, args.hidden
  rng = np.random.default_rng(0)
  cuts = np.sort(rng.integers(0, m + 1, e - 1))
  sizes = jnp.asarray(np.diff(np.concatenate([[0], cuts, [m]])), jnp.int32)
  key = jax.random.split(jax.random.PRNGKey(0), 4)
  cases = {"gate_up": (jax.random.normal(key[0], (m, l), jnp.bfloat16),
                       jax.random.normal(key[1], (m, 2 * f), jnp.bfloat16), (f, f)),
           "out": (jax.random.normal(key[2], (m, f), jnp.bfloat16),
                   jax.random.normal(key[3], (m, l), jnp.bfloat16), (l,))}
  w = jnp.float32(0.03125)
  device = jax.devices()[0].device_kind
  ok = True
  for case, (lhs, dout, widths) in cases.items():
    k = lhs.shape[1]
    zeros = lambda: tuple(jnp.zeros((e, k, n), jnp.float32) for n in widths)
    times = {}
    for name, fn in (("separate", separate), ("fused", fused)):
      jitted = jax.jit(fn, donate_argnums=(3,))
      times[name], _ = _time(jitted, lhs, dout, sizes, zeros(), w, args.reps)
      print(json.dumps({"case": case, "variant": name, "lhs": list(lhs.shape),
                        "dout": list(dout.shape), "ms": round(times[name] * 1e3, 4),
                        "device": device}), flush=True)
    exact = grouped_weight_grad(lhs, dout, sizes, jnp.float32)
    once = jax.jit(fused)(lhs, dout, sizes, zeros(), w)
    got = jnp.concatenate(once, axis=-1) / w
    err = float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
    ok &= err < 1e-5
    print(json.dumps({"case": case, "fused_over_separate": round(times["fused"] /
                                                                 times["separate"], 4),
                      "saved_ms": round((times["separate"] - times["fused"]) * 1e3, 4),
                      "fused_max_rel_error": err}), flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
