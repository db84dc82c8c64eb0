"""Block AttnRes's DepthMix on one GPU: the stacked formulation against depth_mix's custom VJP.

Variants:
  stacked     the previous DepthMix body (copied here): fp32 values and RMS-normalised keys
              stacked to [S, B, T, d], differentiated by autodiff (which saves both).
  custom_vjp  k3jax.layers.attnres.depth_mix: a loop over the sources, residuals = the sources
              (bf16) + alpha and r ([S, B, T] fp32), hand-written backward.
  pallas      depth_mix(kernel='pallas'): the same math and residuals as one Pallas kernel forward
              and one backward (pallas_kernels/depth_mix, default DepthMixConfig; interpreted on
              CPU), each reading every source from HBM once.
  pallas_r{R}_w{W}_d{D}_s{P}  with --sweep_block_rows/--sweep_warps/--sweep_block_d/
              --sweep_stages: depth_mix_fused with DepthMixConfig(block_rows=R, num_warps=W,
              block_d=D, num_stages=P), one variant per combination (the others at their
              defaults).

Per variant and number of sources S (--sources): bf16 [B, T, d] sources, fp32 query [d], and
  fwd_ms / fwdbwd_ms  the jitted forward, and the jitted VJP (h, then d_sources and d_query from a
                      random bf16 dh); median over 5 batches of 10 calls dispatched back to back
                      and synchronised once, after 3 warm-up calls;
  residual_mib        bytes the VJP keeps from forward to backward (the vjp function's leaves,
                      the sources included when kept);
  temp_mib            the compiled fwd+bwd program's temporaries (XLA memory_analysis);
  err_h, err_ds, err_dq  RMS(x - ref) / RMS(ref): custom_vjp against stacked, the pallas variants
                      against custom_vjp.
One JSON line per result; a variant that fails prints {"error": ...} and the run goes on.
Run (one H200): PYTHONPATH=. python experiments/benchmarks/depth_mix_bench.py
  (defaults: small.gin's B 4, T 8192, d 768; S = 2, 5, 9); medium.gin's mixes: --d=1536
  --sources=2,3,4,5; kernel tiles: e.g. --sweep_block_rows=8,16,32 --sweep_warps=2,4,8.
--smoke: B 2, T 64, d 32, S = 1, 3 (CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.layers.attnres import depth_mix  # noqa: E402
from k3jax.layers.common import rms_norm  # noqa: E402
from pallas_kernels.depth_mix import DepthMixConfig, depth_mix_fused  # noqa: E402

EPS = 1e-6


def stacked_depth_mix(sources, query, valid, eps):
  """The previous DepthMix body: [S, B, T, d] fp32 values and keys, einsums at HIGHEST."""
  dtype = sources[0].dtype
  values = jnp.stack([s.astype(jnp.float32) for s in sources], axis=0)
  keys = rms_norm(values, eps)
  logits = jnp.einsum("s...d,d->s...", keys, query.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  if valid is not None:
    logits = jnp.where(valid.reshape((-1,) + (1,) * (logits.ndim - 1)), logits, -jnp.inf)
  alpha = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("s...,s...d->...d", alpha, values,
                    precision=jax.lax.Precision.HIGHEST).astype(dtype)


def pallas_depth_mix(sources, query, valid, eps):
  return depth_mix(sources, query, valid, eps, kernel="pallas")


def kernel_variants(block_rows, warps, block_d, stages) -> dict:
  """{name: mix} for every DepthMixConfig of the sweep (none when no sweep flag is given)."""
  if not (block_rows or warps or block_d or stages):
    return {}
  default = DepthMixConfig()
  variants = {}
  for config in (DepthMixConfig(block_rows=r, num_warps=w, block_d=d, num_stages=p,
                                interpret=jax.default_backend() == "cpu")
                 for r in block_rows or [default.block_rows]
                 for w in warps or [default.num_warps]
                 for d in block_d or [default.block_d]
                 for p in stages or [default.num_stages]):
    name = (f"pallas_r{config.block_rows}_w{config.num_warps}_d{config.block_d}"
            f"_s{config.num_stages}")
    variants[name] = lambda s, q, valid, eps, config=config: depth_mix_fused(s, q, valid, eps,
                                                                             config)
  return variants


VARIANTS = {"stacked": stacked_depth_mix, "custom_vjp": depth_mix, "pallas": pallas_depth_mix}
# The variant each is compared against (err_*); a variant not listed: custom_vjp.
REFERENCES = {"stacked": None, "custom_vjp": "stacked"}


def emit(**row):
  print(json.dumps(row), flush=True)


def time_ms(fn, *args) -> float:
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  batches = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(10):
      out = fn(*args)
    jax.block_until_ready(out)
    batches.append((time.perf_counter() - start) * 1e3 / 10)
  return statistics.median(batches)


def error_ratio(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((x - ref) ** 2)) / max(np.sqrt(np.mean(ref**2)), 1e-30))


def run_case(batch, seq, width, num_sources, variants):
  rng = np.random.default_rng(num_sources)
  sources = tuple(jnp.asarray(rng.normal(0, 1 + i, (batch, seq, width)), jnp.bfloat16)
                  for i in range(num_sources))
  query = jnp.asarray(rng.normal(0, 0.05, width), jnp.float32)
  dh = jnp.asarray(rng.normal(size=(batch, seq, width)), jnp.bfloat16)
  outputs = {}
  for name, mix in variants.items():
    try:
      def forward(s, q, mix=mix):
        return mix(s, q, None, EPS)

      def fwdbwd(s, q, g, forward=forward):
        h, vjp_fn = jax.vjp(forward, s, q)
        return h, vjp_fn(g)

      fwd_jit, fwdbwd_jit = jax.jit(forward), jax.jit(fwdbwd)
      residuals = jax.tree_util.tree_leaves(
          jax.eval_shape(lambda s, q, forward=forward: jax.vjp(forward, s, q)[1], sources, query))
      memory = fwdbwd_jit.lower(sources, query, dh).compile().memory_analysis()
      row = dict(variant=name, batch=batch, seq=seq, width=width, sources=num_sources,
                 fwd_ms=round(time_ms(fwd_jit, sources, query), 4),
                 fwdbwd_ms=round(time_ms(fwdbwd_jit, sources, query, dh), 4),
                 residual_mib=round(sum(x.size * x.dtype.itemsize for x in residuals) / 2**20, 2),
                 temp_mib=round(memory.temp_size_in_bytes / 2**20, 2))
      h, (d_sources, d_query) = fwdbwd_jit(sources, query, dh)
      outputs[name] = (h, d_sources, d_query)
      reference = REFERENCES.get(name, "custom_vjp")
      if reference in outputs:
        h_ref, d_sources_ref, d_query_ref = outputs[reference]
        row.update(err_h=error_ratio(h, h_ref),
                   err_ds=max(error_ratio(a, b) for a, b in zip(d_sources, d_sources_ref)),
                   err_dq=error_ratio(d_query, d_query_ref))
      emit(**row)
    except Exception as e:  # noqa: BLE001  (one failing variant must not stop the others)
      emit(variant=name, sources=num_sources, error=f"{type(e).__name__}: {e}".splitlines()[0])
      traceback.print_exc()


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--seq", type=int, default=8192)
  p.add_argument("--width", "--d", dest="width", type=int, default=768,
                 help="d: 768 (small.gin), 1536 (medium.gin)")
  ints = lambda text: [int(x) for x in text.split(",")]
  p.add_argument("--sources", type=ints, default=[2, 5, 9],
                 help="comma-separated numbers of sources S")
  p.add_argument("--sweep_block_rows", type=ints, default=[],
                 help="comma-separated DepthMixConfig.block_rows to time (pallas_r* variants)")
  p.add_argument("--sweep_warps", type=ints, default=[],
                 help="comma-separated DepthMixConfig.num_warps to time")
  p.add_argument("--sweep_block_d", type=ints, default=[],
                 help="comma-separated DepthMixConfig.block_d (channel chunk caps) to time")
  p.add_argument("--sweep_stages", type=ints, default=[],
                 help="comma-separated DepthMixConfig.num_stages (Triton pipelining) to time")
  p.add_argument("--smoke", action="store_true", help="B 2, T 64, d 32, S = 1, 3 (CPU)")
  args = p.parse_args()
  if args.smoke:
    args.batch, args.seq, args.width, args.sources = 2, 64, 32, [1, 3]
  variants = dict(VARIANTS, **kernel_variants(args.sweep_block_rows, args.sweep_warps,
                                              args.sweep_block_d, args.sweep_stages))
  emit(device=str(jax.devices()[0]), jax=jax.__version__)
  for num_sources in args.sources:
    run_case(args.batch, args.seq, args.width, num_sources, variants)


if __name__ == "__main__":
  main()
