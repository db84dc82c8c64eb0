"""`flash_attention`: softmax attention over per-query key ranges, differentiable through Pallas.

The forward is the caller's (`forward`: tokamax's Mosaic GPU kernel in k3jax, a dense reference
in the tests), returning the output and its log-sum-exp; the backward is this package's Mosaic GPU
dq, dV and dK kernels (`mosaic_bwd.py`, sm90, or its interpreter), which skip the blocks outside
the ranges. `reference_attention` is the dense definition for tests, small shapes only.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import mosaic_bwd as mb

# forward(q, k, v, aux) -> (out [B, T, H, Dv] in q.dtype, lse [B, H, T] fp32, +inf where nothing is
# seen). `aux` is `flash_attention`'s forward_aux, an array argument of the custom VJP: arrays the
# forward needs (e.g. segment ids) must come through it, never closed over, or they would leak as
# tracers out of the custom VJP's nondiff arguments (UnexpectedTracerError on the second trace).
ForwardFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad(x, axis: int, length: int, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _padded_shape(t: int, s: int, d: int, dv: int, cfg: mb.MosaicBwdConfig
                  ) -> tuple[int, int, int, int]:
  """T, S, D, Dv padded to the kernels' tiles: whole query and key tiles of both kernels, and
  head dims of whole 128-byte swizzle rows (64 bf16), the value dim a power of two."""
  tq = math.lcm(cfg.tile_q, cfg.block_q_dkv)
  tk = math.lcm(cfg.tile_k, cfg.block_k_dq)
  return (_round_up(t, tq), _round_up(s, tk), _round_up(d, 64),
          max(64, 1 << (dv - 1).bit_length()))


def _pad_inputs(q, k, v, k_lo, k_hi, q_lo, q_hi, cfg):
  tp, sp, dp, dvp = _padded_shape(q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], cfg)
  q = _pad(_pad(q, 1, tp), 3, dp)
  k = _pad(_pad(k, 1, sp), 3, dp)
  v = _pad(_pad(v, 1, sp), 3, dvp)
  # Padded queries see nothing (empty range) and padded keys list no query: neither widens a loop.
  k_lo, k_hi = _pad(k_lo, 1, tp, sp), _pad(k_hi, 1, tp, 0)
  q_lo, q_hi = _pad(q_lo, 1, sp, tp), _pad(q_hi, 1, sp, 0)
  return q, k, v, k_lo, k_hi, q_lo, q_hi


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _attention(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, forward, backward):
  return _attention_fwd(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, forward, backward)[0]


def _attention_fwd(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, forward, backward):
  del scale, backward
  out, lse = forward(q, k, v, aux)
  return out, (q, k, v, k_lo, k_hi, q_lo, q_hi, out, lse)


def _attention_bwd(scale, forward, backward, res, dout):
  del forward
  q, k, v, k_lo, k_hi, q_lo, q_hi, out, lse = res
  t, s = q.shape[1], k.shape[1]
  d, dv = q.shape[-1], v.shape[-1]
  # delta_t = o_t . do_t, the softmax backward's row term, [B, H, T] fp32.
  delta = jnp.einsum("bthv,bthv->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
  qp, kp, vp, klo, khi, qlo, qhi = _pad_inputs(q, k, v, k_lo, k_hi, q_lo, q_hi, backward)
  tp = qp.shape[1]
  dop = _pad(_pad(dout.astype(v.dtype), 1, tp), 3, vp.shape[-1])
  lse = _pad(lse, 2, tp, jnp.inf)
  delta = _pad(delta, 2, tp)
  dq = mb.mosaic_flash_dq(qp, kp, vp, dop, lse, delta, klo, khi, scale=scale, cfg=backward)
  dk, dv_ = mb.mosaic_flash_dkv(qp, kp, vp, dop, lse, delta, klo, khi, qlo, qhi, scale=scale,
                                cfg=backward)
  return (dq[:, :t, :, :d], dk[:, :s, :, :d], dv_[:, :s, :, :dv], None, None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_lo: jax.Array, k_hi: jax.Array,
                    q_lo: jax.Array, q_hi: jax.Array, *, scale: float, forward: ForwardFn,
                    forward_aux: jax.Array | None = None,
                    backward: mb.MosaicBwdConfig = mb.MosaicBwdConfig()) -> jax.Array:
  """Attention where query t sees keys [k_lo[t], k_hi[t]); differentiable in q, k, v.

  Args:
    q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv]: one dtype (bf16/fp16 on a GPU; any float in
      the interpreter), H % Hk == 0.
    k_lo, k_hi [B, T] int32: each query's key range (empty when k_lo >= k_hi: zeros out).
    q_lo, q_hi [B, S] int32: a range of queries that covers every query seeing key s (used only to
      bound the dk/dv loops; a superset is correct, only slower).
    scale: logit scale.
    forward: (q, k, v, forward_aux) -> (out, lse [B, H, T] fp32) computing the same attention,
      e.g. tokamax's Mosaic GPU kernel. It must be free of traced values (a module-level function,
      or a partial over Python constants).
    forward_aux: the array `forward` reads besides q, k, v (e.g. segment ids); not differentiated.
    backward: the Mosaic GPU backward's tiles and launch (sm90 GPUs, or its interpreter).

  Returns:
    [B, T, H, Dv] in q.dtype.
  """
  b, t, h, d = q.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"k must be [B={b}, S, Hk, D={d}] and v [B, S, Hk, Dv]; got {k.shape}, "
                     f"{v.shape}")
  if h % k.shape[2]:
    raise ValueError(f"query heads {h} must be a multiple of key heads {k.shape[2]}")
  if not callable(forward):
    raise ValueError(f"forward must be a callable (q, k, v, forward_aux) -> (out, lse), got "
                     f"{forward!r}")
  s = k.shape[1]
  for name, x, n in (("k_lo", k_lo, t), ("k_hi", k_hi, t), ("q_lo", q_lo, s), ("q_hi", q_hi, s)):
    if x.shape != (b, n) or x.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 [{b}, {n}], got {x.dtype} {x.shape}")
  aux = jnp.zeros((0,), jnp.int32) if forward_aux is None else forward_aux
  return _attention(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, float(scale), forward, backward)


def reference_attention(q, k, v, k_lo, k_hi, *, scale: float) -> jax.Array:
  """Dense fp32 definition of `flash_attention` ([B, H, T, S] logits: tests only)."""
  b, t, h, _ = q.shape
  s, hk = k.shape[1], k.shape[2]
  qg = q.astype(jnp.float32).reshape(b, t, hk, h // hk, -1)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST) * scale
  cols = jnp.arange(s)[None, None, :]
  seen = (cols >= k_lo[:, :, None]) & (cols < k_hi[:, :, None])          # [B, T, S]
  logits = jnp.where(seen[:, None, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isneginf(m), 0.0, m))
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)
  out = jnp.einsum("bkgts,bskv->btkgv", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(b, t, h, v.shape[-1])
