r"""The routed experts on the GPU's kernels with rows past the groups: the Pallas SiTU-GLU (which
zeroes those rows itself, so tokamax's grouped matmul skips its select) against XLA's SiTU-GLU
(which keeps the select), and both against an fp32 dense reference (`k3jax.ops.moe_reference`).

On the GPU tokamax's grouped matmul leaves the rows past Σ group_sizes unwritten (whatever the
memory held). Invalid tokens (padding) sort past the groups, so a third of the tokens here are
invalid. Printed as one JSON line per activation: the output's and each gradient's largest
difference from the 'xla' activation's (the same kernels apart from the SiTU-GLU and the select:
expected 0 or a few bf16 ulps) and its largest error relative to the reference's largest entry,
and whether everything is finite. Exits 1 on a non-finite value or a relative error above --rtol.

Shapes: medium.gin's MoE (ℓ = 768 latent, f = 768, 48 experts, top-4) at --tokens tokens, bf16.

  PYTHONPATH=. python experiments/benchmarks/moe_rows_check.py            # one H200
  PYTHONPATH=. python experiments/benchmarks/moe_rows_check.py --smoke    # tiny, CPU (interpreter)
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.grouped_matmul import default_ragged_dot
from k3jax.ops.moe import routed_experts
from k3jax.ops.moe_reference import dense_routed_experts

B1, B2 = 4.0, 25.0


def problem(tokens: int, latent: int, hidden: int, experts: int, k: int, seed: int = 0):
  """(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid): z and the weights bf16-rounded
  and kept in fp32 (the reference reads the same numbers), a third of the tokens invalid."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  z = bf(jax.random.normal(ks[0], (tokens, latent)))
  logits = jax.random.normal(ks[1], (tokens, experts))
  weight, idx = jax.lax.top_k(jax.nn.softmax(logits), k)
  scale = latent ** -0.5
  w_gate = bf(jax.random.normal(ks[2], (experts, latent, hidden)) * scale)
  w_up = bf(jax.random.normal(ks[3], (experts, latent, hidden)) * scale)
  w_out = bf(jax.random.normal(ks[4], (experts, hidden, latent)) * hidden ** -0.5)
  valid = jax.random.uniform(ks[5], (tokens,)) > 1 / 3
  return z, idx.astype(jnp.int32), weight, w_gate, w_up, w_out, valid


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--rtol", type=float, default=3e-2,
                 help="largest error / largest reference entry allowed (bf16 matmuls)")
  p.add_argument("--smoke", action="store_true", help="64 tokens, 8 experts, 32 wide; CPU")
  args = p.parse_args()
  if args.smoke:
    shapes = dict(tokens=64, latent=32, hidden=32, experts=8, k=2)
  else:
    shapes = dict(tokens=args.tokens, latent=768, hidden=768, experts=48, k=4)
  z, idx, weight, w_gate, w_up, w_out, valid = problem(**shapes)
  cot = jax.random.normal(jax.random.PRNGKey(9), z.shape)
  # 'auto' is tokamax's Mosaic kernels for bf16 on an H200 and the tiled matmul on CPU; 'tokamax'
  # on CPU is its XLA implementation (the same call sites, the select skipped the same way).
  ragged_dot = default_ragged_dot("auto" if jax.default_backend() == "gpu" else "tokamax")
  names = ("y", "z", "expert_weight", "w_gate", "w_up", "w_out")

  def grads(f):
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cot)
    y = jax.jit(f)(z, weight, w_gate, w_up, w_out)
    g = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(z, weight, w_gate, w_up, w_out)
    return [np.asarray(a, np.float32) for a in (y, *g)]

  def ours(activation):
    def f(z, weight, w_gate, w_up, w_out):
      return routed_experts(z.astype(jnp.bfloat16), idx, weight, w_gate, w_up, w_out, beta1=B1,
                            beta2=B2, valid=valid, ragged_dot_fn=ragged_dot,
                            activation=activation)[0]
    return f

  ref = grads(lambda *a: dense_routed_experts(a[0], idx, *a[1:], valid, B1, B2))
  results = {act: grads(ours(act)) for act in ("xla", "pallas")}
  ok = True
  for act, got in results.items():
    finite = all(bool(np.isfinite(a).all()) for a in got)
    rel = {n: float(np.abs(a - r).max() / max(np.abs(r).max(), 1e-30))
           for n, a, r in zip(names, got, ref)}
    vs_xla = {n: float(np.abs(a - b).max()) for n, a, b in zip(names, got, results["xla"])}
    ok &= finite and max(rel.values()) <= args.rtol
    print(json.dumps(dict(event="result", backend=jax.default_backend(), activation=act,
                          **shapes, finite=finite, rel_err=rel, max_abs_vs_xla=vs_xla)),
          flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
