"""The KDA layer's short convolution + SiLU (`k3jax.layers.conv.conv_silu`) on one device: forward and
backward of its hand-written VJP against a tried alternative (copied here) and plain autodiff.

Shapes: small.gin's and medium.gin's 4 × 8192-token micro-batch, channels = KDA heads × head dim
(768, 1536), width 4, bf16, packed rows (geometric documents of mean length 8192, as train_bench's).
Timed: a jitted value-and-gradient of sum(conv_silu(x) · cotangent) with respect to x and the kernel;
ms per call, median of 5 batches of 20 calls after a warm-up. One JSON line per row.

  vjp                k3jax's conv_silu: dy materialised in fp32, dx from shifted copies of it, one
                     reduction per tap for the kernel gradient.
  pallas             conv_silu(..., kernel_choice='pallas'): the forward and the backward as Pallas
                     kernels (pallas_kernels/short_conv; ImplConfig.kda_conv_kernel = 'pallas').
  shifted_recompute  tried and not adopted (1.7-1.8x slower on an H200, RESULTS.md
                     run 16): each of dx's W terms recomputes y and dy at its shift from the inputs,
                     so that nothing [B, T, C] is materialised; XLA's fused kernel is then bound by
                     the W² taps and W sigmoids per element, not by memory.
  autodiff           jax.grad of causal_conv1d then silu (what the layer ran before its VJP).

Run (one GPU): PYTHONPATH=. python experiments/benchmarks/conv_bench.py;  --smoke: tiny, on CPU.
--sweep=128:256:1:1,64:256:1:1,...: the forward alone and the backward alone, XLA's against the
Pallas kernels at each chunk_t:block_c:num_warps:num_stages.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers import conv
from pallas_kernels import short_conv


def _shifted_recompute_bwd(out_dtype, residuals, dout):
  del out_dtype
  x, kernel, segment_ids = jax.lax.optimization_barrier(residuals)
  width, t = kernel.shape[0], x.shape[1]
  w32 = kernel.astype(jnp.float32)
  # Zero-padded so that x[t + s] (|s| < W) and dout[t + s] (0 <= s < W) are static slices; past the
  # row's end dout is 0, so those positions contribute nothing.
  halo = width - 1
  x_pad = jnp.pad(x, ((0, 0), (halo, halo), (0, 0)))
  dout_pad = jnp.pad(dout, ((0, 0), (0, halo), (0, 0)))
  seg_pad = None if segment_ids is None else jnp.pad(segment_ids, ((0, 0), (halo, halo)))

  def x_at(s):
    return jax.lax.slice_in_dim(x_pad, halo + s, halo + s + t, axis=1).astype(jnp.float32)

  def seg_at(s):
    return jax.lax.slice_in_dim(seg_pad, halo + s, halo + s + t, axis=1)

  def mask(j, s):
    """[B, T, 1] fp32: x[t+s-j] reaches y[t+s] (same segment, t+s a token); None: every tap."""
    if seg_pad is None:
      return None
    here = seg_at(s)
    m = (here != 0) if j == 0 else (here != 0) & (seg_at(s - j) == here)
    return m[..., None].astype(jnp.float32)

  def masked(a, j, s):
    m = mask(j, s)
    return a if m is None else a * m

  def dy_at(s):
    """dy[t + s] [B, T, C] fp32, from x[t+s-W+1 .. t+s] and dout[t+s]."""
    y = sum(w32[width - 1 - j] * masked(x_at(s - j), j, s) for j in range(width))
    sig = jax.nn.sigmoid(y)
    d = jax.lax.slice_in_dim(dout_pad, s, s + t, axis=1).astype(jnp.float32)
    return d * sig * (1.0 + y * (1.0 - sig))

  dx = sum(w32[width - 1 - i] * masked(dy_at(i), i, i) for i in range(width))
  dy = dy_at(0)
  dkernel = jnp.stack([jnp.sum(masked(dy, i, 0) * x_at(-i), axis=(0, 1))
                       for i in range(width)][::-1])     # tap i weighs kernel[W-1-i]
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _shifted_recompute(x, kernel, segment_ids, out_dtype):
  return conv._conv_silu_fwd(x, kernel, segment_ids, out_dtype)[0]


_shifted_recompute.defvjp(conv._conv_silu_fwd, _shifted_recompute_bwd)


def _autodiff(x, kernel, segment_ids, out_dtype):
  y, _ = conv.causal_conv1d(x, kernel, segment_ids)
  return jax.nn.silu(y).astype(out_dtype)


def _pallas(x, kernel, segment_ids, out_dtype):
  return conv.conv_silu(x, kernel, segment_ids, out_dtype, kernel_choice="pallas")


VARIANTS = {"vjp": conv.conv_silu, "pallas": _pallas, "shifted_recompute": _shifted_recompute,
            "autodiff": _autodiff}


def packed_segments(batch: int, t: int, mean_doc: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  seg = np.zeros((batch, t), np.int32)
  for b in range(batch):
    pos, doc = 0, 1
    while pos < t:
      n = int(rng.geometric(1.0 / mean_doc))
      seg[b, pos:pos + n] = doc
      pos, doc = pos + n, doc + 1
  return seg


def time_ms(fn, args, reps: int, batches: int = 5) -> float:
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) * 1e3 / reps)
  return statistics.median(ts)


def sweep(x, kernel, seg, dout, configs: str, reps: int):
  """Times the forward alone (x, the kernel and segment ids to the output) and the backward alone
  (given x, the kernel, segment ids and dout): XLA's (`conv_silu`'s default), the W-1-row pad
  that XLA's forward materialises, and the Pallas kernels at each config; each result's largest
  difference from XLA's."""
  b, t, c = x.shape
  xla_fwd = jax.jit(lambda x, k, s: conv._conv_silu_fwd(x, k, s, jnp.bfloat16)[0])
  xla_bwd = jax.jit(lambda x, k, s, d: conv._conv_silu_bwd(jnp.bfloat16, (x, k, s), d)[:2])
  halo = kernel.shape[0] - 1
  pads = jax.jit(lambda x: jnp.pad(x, ((0, 0), (halo, 0), (0, 0))))
  print(json.dumps(dict(kind="sweep", what="pads_only", B=b, T=t, C=c,
                        ms=round(time_ms(pads, (x,), reps), 4))), flush=True)
  rows = [("xla", xla_fwd, xla_bwd)]
  for text in configs.split(","):
    chunk, bc, warps, stages = (int(v) for v in text.split(":"))
    cfg = short_conv.ConvConfig(chunk_t=chunk, block_c=bc, launch=(warps, stages),
                                interpret=jax.default_backend() == "cpu")
    rows.append((text,
                 jax.jit(lambda x, k, s, cfg=cfg: short_conv.conv_silu_fwd(x, k, s, jnp.bfloat16,
                                                                           cfg)),
                 jax.jit(functools.partial(short_conv.conv_silu_bwd, config=cfg))))
  ref_fwd, ref_bwd = xla_fwd(x, kernel, seg), xla_bwd(x, kernel, seg, dout)
  for name, fwd, bwd in rows:
    for direction, fn, args, ref in (("fwd", fwd, (x, kernel, seg), (ref_fwd,)),
                                     ("bwd", bwd, (x, kernel, seg, dout), ref_bwd)):
      try:
        ms = time_ms(fn, args, reps)
        out = fn(*args)
        out = (out,) if direction == "fwd" else out
        err = [float(np.max(np.abs(np.asarray(o, np.float32) - np.asarray(r, np.float32))))
               for o, r in zip(out, ref)]
        print(json.dumps(dict(kind="sweep", what=name, direction=direction, B=b, T=t, C=c,
                              ms=round(ms, 4), max_abs_diff_vs_xla=err)), flush=True)
      except Exception as e:  # a config that does not lower (shared memory, registers) is reported
        print(json.dumps(dict(kind="sweep", what=name, direction=direction, B=b, T=t, C=c,
                              error=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default="4x8192x768,4x8192x1536", help="BxTxC,...")
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--smoke", action="store_true", help="2 x 64 x 16 on CPU, 2 reps")
  p.add_argument("--sweep", default="",
                 help="forward and backward alone: XLA's against the Pallas kernels at each "
                      "chunk_t:block_c:num_warps:num_stages of this comma list (skips the "
                      "variants above)")
  args = p.parse_args()
  if args.smoke:
    args.shapes, args.reps = "2x64x16", 2
  print(json.dumps(dict(kind="setup", backend=jax.default_backend(),
                        device=str(jax.devices()[0].device_kind))), flush=True)
  for shape in args.shapes.split(","):
    b, t, c = (int(v) for v in shape.split("x"))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(keys[0], (b, t, c), jnp.float32).astype(jnp.bfloat16)
    kernel = 0.5 * jax.random.normal(keys[1], (4, c), jnp.float32)
    cot = jax.random.normal(keys[2], (b, t, c), jnp.float32).astype(jnp.bfloat16)
    seg = jnp.asarray(packed_segments(b, t, min(8192, t // 2)))
    if args.sweep:
      sweep(x, kernel.astype(jnp.bfloat16), seg, cot, args.sweep, args.reps)
      continue
    grads = {}
    for name, f in VARIANTS.items():
      def loss(x, k, f=f):
        return jnp.sum(f(x, k.astype(jnp.bfloat16), seg, jnp.bfloat16).astype(jnp.float32)
                       * cot.astype(jnp.float32))
      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
      ms = time_ms(fn, (x, kernel), args.reps)
      grads[name] = fn(x, kernel)[1]
      print(json.dumps(dict(kind="time", variant=name, B=b, T=t, C=c, ms=round(ms, 4))), flush=True)
    # Each VJP's gradients against autodiff's (all from bf16 inputs, fp32 math).
    for name in ("vjp", "pallas", "shifted_recompute"):
      for i, g in enumerate(("dx", "dkernel")):
        a = np.asarray(grads[name][i], np.float32)
        r = np.asarray(grads["autodiff"][i], np.float32)
        err = float(np.sqrt(np.mean((a - r) ** 2)) / max(np.sqrt(np.mean(r ** 2)), 1e-30))
        print(json.dumps(dict(kind="numerics", variant=name, shape=shape, grad=g,
                              error_ratio_vs_autodiff=err)), flush=True)


if __name__ == "__main__":
  main()
