r"""What KDA's state passing costs one slice under context parallelism, on one device.

Each device of a `context` axis runs, per KDA layer, the chunked kernel on its slice with the values
widened by K zero columns and the initial state [0 | I] (k3jax/parallel/context.py), then a small
[t, K] x [K, V] product per head to add the carried state. This times, forward + backward (the
gradient of every input, of the final state where the variant returns one):

  plain     the single-device op on the slice: chunk_kda(q, k, v) with segment ids;
  widened   the context-parallel slice: chunk_kda(q, k, [v | 0], h0 = [0 | I]) and the correction;
  two_pass  the alternative with the existing kernels and no widening: the identity propagated
            alone (v = 0 with K columns, h0 = I) for M, and the plain op from a given state for
            the output and S_ext.

The all-gather and the merge (C products of [K, K] x [K, V] per head) are not timed: they do not
depend on the slice length. Prints one JSON line per (shape, variant), and the ratios to `plain`.

  PYTHONPATH=. python experiments/benchmarks/context_kda_bench.py --shapes=1x32768x16x128 \
      [--backend=pallas]
--smoke: a tiny shape on the XLA backend (CPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops import kda as kda_ops


def inputs(b, t, h, d, seed=0):
  rng = np.random.default_rng(seed)
  mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
  seg = np.ones((b, t), np.int32)
  seg[:, t // 3:] = 2                       # a document starts inside the slice
  return dict(q=mk(b, t, h, d), k=mk(b, t, h, d), v=mk(b, t, h, d), gate_x=mk(b, t, h, d),
              beta=jax.nn.sigmoid(mk(b, t, h)).astype(jnp.bfloat16),
              a_log=jnp.zeros((h,), jnp.float32), dt_bias=jnp.zeros((h * d,), jnp.float32)), \
      jnp.asarray(seg)


def variants(backend: str, chunk: int, seg):
  def op(q, k, v, gate_x, beta, seg, a_log, dt_bias, h0=None, final=False):
    return kda_ops.chunk_kda(q, k, v, gate_x, beta, use_qk_l2norm=True, segment_ids=seg,
                             chunk_size=chunk, backend=backend, A_log=a_log, dt_bias=dt_bias,
                             lower_bound=-5.0, initial_state=h0, output_final_state=final)

  def plain(x):
    o, _ = op(x["q"], x["k"], x["v"], x["gate_x"], x["beta"], seg, x["a_log"], x["dt_bias"])
    return jnp.sum(o.astype(jnp.float32))

  def widened(x):
    b, _, h, d = x["q"].shape
    v = jnp.concatenate([x["v"], jnp.zeros_like(x["v"])], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (b, h, d, d))
    h0 = jnp.concatenate([jnp.zeros((b, h, d, d), jnp.float32), eye], axis=-1)
    o, s = op(x["q"], x["k"], v, x["gate_x"], x["beta"], seg, x["a_log"], x["dt_bias"],
              h0, True)
    s_in = jnp.ones((b, h, d, d), jnp.float32) * 1e-3       # stands for the gathered state
    o = o[..., :d].astype(jnp.float32) + jnp.einsum("bthk,bhkv->bthv", o[..., d:], s_in)
    return jnp.sum(o) + jnp.sum(s)

  def two_pass(x):
    b, _, h, d = x["q"].shape
    eye = jnp.broadcast_to(jnp.eye(d, dtype=jnp.float32), (b, h, d, d))
    _, m = op(x["q"], x["k"], jnp.zeros_like(x["v"]), x["gate_x"], x["beta"], seg,
              x["a_log"], x["dt_bias"], eye, True)
    s_in = jnp.ones((b, h, d, d), jnp.float32) * 1e-3
    o, s = op(x["q"], x["k"], x["v"], x["gate_x"], x["beta"], seg, x["a_log"],
              x["dt_bias"], s_in, True)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s) + jnp.sum(m)

  return {"plain": plain, "widened": widened, "two_pass": two_pass}


def time_ms(fn, x, calls=10, repeats=5) -> float:
  out = fn(x)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(x)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e3)
  return statistics.median(times)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="1x32768x16x128,1x131072x16x128",
                 help="BxTxHxD per slice (K = V = D), comma-separated")
  p.add_argument("--backend", default="auto", choices=("auto", "xla", "pallas"))
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--smoke", action="store_true")
  args = p.parse_args()
  shapes, backend = args.shapes, args.backend
  if args.smoke:
    shapes, backend = "1x128x2x16", "xla"
  for shape in shapes.split(","):
    b, t, h, d = (int(n) for n in shape.split("x"))
    x, seg = inputs(b, t, h, d)
    rows = {}
    for name, loss in variants(backend, args.chunk, seg).items():
      step = jax.jit(jax.grad(loss))
      rows[name] = time_ms(step, x, calls=2 if args.smoke else 10, repeats=2 if args.smoke else 5)
      print(json.dumps({"shape": shape, "variant": name, "fwdbwd_ms": round(rows[name], 3),
                        "device": jax.devices()[0].device_kind}), flush=True)
    print(json.dumps({"shape": shape, "widened_over_plain": round(rows["widened"] / rows["plain"], 3),
                      "two_pass_over_plain": round(rows["two_pass"] / rows["plain"], 3)}),
          flush=True)


if __name__ == "__main__":
  main()
