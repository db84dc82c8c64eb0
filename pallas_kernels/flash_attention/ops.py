"""`flash_attention`: softmax attention over per-query key ranges, differentiable through Pallas.

The forward is this package's kernel or a caller's (`forward`, e.g. tokamax's Mosaic GPU kernel,
which returns the same log-sum-exp); the backward is always this package's dq and dk/dv kernels,
which skip the blocks outside the ranges: Triton's (`kernels.py`) or, given a `MosaicBwdConfig`,
Mosaic GPU's (`mosaic_bwd.py`, sm90). `reference_attention` is the dense
definition for tests, small shapes only.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import kernels as fk
from pallas_kernels.flash_attention import mosaic_bwd as mb

# forward(q, k, v, aux) -> (out [B, T, H, Dv] in q.dtype, lse [B, H, T] fp32, +inf where nothing is
# seen). `aux` is `flash_attention`'s forward_aux, an array argument of the custom VJP: arrays the
# forward needs (e.g. segment ids) must come through it, never closed over, or they would leak as
# tracers out of the custom VJP's nondiff arguments (UnexpectedTracerError on the second trace).
ForwardFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pow2(n: int) -> int:
  # Triton tiles are powers of two, and its dots want at least 16 along each dimension.
  return max(16, 1 << (n - 1).bit_length())


def _pad(x, axis: int, length: int, value=0):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _padded_shape(t: int, s: int, d: int, dv: int, cfg: fk.FlashConfig,
                  mosaic: Optional[mb.MosaicBwdConfig] = None) -> tuple[int, int, int, int]:
  """T, S, D, Dv padded for the Triton kernels' tiles and, given `mosaic`, the Mosaic ones'."""
  tq, tk = max(cfg.block_q, cfg.block_q_dkv), max(cfg.block_k, cfg.block_k_dkv)
  # q/k: a multiple of 16, read in power-of-two pieces by the Triton kernels; v: one power-of-two
  # tile. The Mosaic kernels want whole 128-byte swizzle rows (64 bf16) as well.
  dp, dvp = _round_up(d, 16), _pow2(dv)
  if mosaic is not None:
    tq = math.lcm(tq, mosaic.tile_q, mosaic.block_q_dkv)
    tk = math.lcm(tk, mosaic.tile_k, mosaic.block_k_dq)
    dp, dvp = _round_up(d, 64), max(64, dvp)
  return _round_up(t, tq), _round_up(s, tk), dp, dvp


def _pad_inputs(q, k, v, k_lo, k_hi, q_lo, q_hi, cfg, mosaic=None):
  tp, sp, dp, dvp = _padded_shape(q.shape[1], k.shape[1], q.shape[-1], v.shape[-1], cfg, mosaic)
  q = _pad(_pad(q, 1, tp), 3, dp)
  k = _pad(_pad(k, 1, sp), 3, dp)
  v = _pad(_pad(v, 1, sp), 3, dvp)
  # Padded queries see nothing (empty range) and padded keys list no query: neither widens a loop.
  k_lo, k_hi = _pad(k_lo, 1, tp, sp), _pad(k_hi, 1, tp, 0)
  q_lo, q_hi = _pad(q_lo, 1, sp, tp), _pad(q_hi, 1, sp, 0)
  return q, k, v, k_lo, k_hi, q_lo, q_hi


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _attention(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, cfg, forward, mosaic):
  return _attention_fwd(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, cfg, forward, mosaic)[0]


def _own_forward(q, k, v, k_lo, k_hi, q_lo, q_hi, scale, cfg):
  t, dv = q.shape[1], v.shape[-1]
  qp, kp, vp, klo, khi, _, _ = _pad_inputs(q, k, v, k_lo, k_hi, q_lo, q_hi, cfg)
  out, lse = fk.flash_fwd(qp, kp, vp, klo, khi, scale=scale, cfg=cfg)
  return out[:, :t, :, :dv], lse[:, :, :t]


def _attention_fwd(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, scale, cfg, forward, mosaic):
  del mosaic
  if forward is None:
    out, lse = _own_forward(q, k, v, k_lo, k_hi, q_lo, q_hi, scale, cfg)
  else:
    out, lse = forward(q, k, v, aux)
  return out, (q, k, v, k_lo, k_hi, q_lo, q_hi, out, lse)


def _attention_bwd(scale, cfg, forward, mosaic, res, dout):
  del forward
  q, k, v, k_lo, k_hi, q_lo, q_hi, out, lse = res
  t, s = q.shape[1], k.shape[1]
  d, dv = q.shape[-1], v.shape[-1]
  # delta_t = o_t . do_t, the softmax backward's row term, [B, H, T] fp32.
  delta = jnp.einsum("bthv,bthv->bht", out.astype(jnp.float32), dout.astype(jnp.float32))
  qp, kp, vp, klo, khi, qlo, qhi = _pad_inputs(q, k, v, k_lo, k_hi, q_lo, q_hi, cfg, mosaic)
  tp = qp.shape[1]
  dop = _pad(_pad(dout.astype(v.dtype), 1, tp), 3, vp.shape[-1])
  lse = _pad(lse, 2, tp, jnp.inf)
  delta = _pad(delta, 2, tp)
  if mosaic is not None:
    dq = mb.mosaic_flash_dq(qp, kp, vp, dop, lse, delta, klo, khi, scale=scale, cfg=mosaic)
  else:
    dq = fk.flash_bwd_dq(qp, kp, vp, dop, lse, delta, klo, khi, scale=scale, cfg=cfg)
  if mosaic is not None and mosaic.dkv != "triton":
    dk, dv_ = mb.mosaic_flash_dkv(qp, kp, vp, dop, lse, delta, klo, khi, qlo, qhi, scale=scale,
                                  cfg=mosaic)
  else:
    dk, dv_ = fk.flash_bwd_dkv(qp, kp, vp, dop, lse, delta, klo, khi, qlo, qhi, scale=scale,
                               cfg=cfg)
  return (dq[:, :t, :, :d], dk[:, :s, :, :d], dv_[:, :s, :, :dv], None, None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_lo: jax.Array, k_hi: jax.Array,
                    q_lo: jax.Array, q_hi: jax.Array, *, scale: float,
                    config: fk.FlashConfig = fk.FlashConfig(),
                    forward: Optional[ForwardFn] = None,
                    forward_aux: Optional[jax.Array] = None,
                    mosaic_backward: Optional[mb.MosaicBwdConfig] = None) -> jax.Array:
  """Attention where query t sees keys [k_lo[t], k_hi[t]); differentiable in q, k, v.

  Args:
    q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv]: one dtype (bf16/fp16 on a GPU; any float in
      the interpreter), H % Hk == 0.
    k_lo, k_hi [B, T] int32: each query's key range (empty when k_lo >= k_hi: zeros out).
    q_lo, q_hi [B, S] int32: a range of queries that covers every query seeing key s (used only to
      bound the dk/dv loops; see `kernels.py`).
    scale: logit scale.
    config: block sizes, launches, interpret mode.
    forward: None (this package's forward kernel) or a callable (q, k, v, forward_aux) -> (out,
      lse [B, H, T] fp32) computing the same attention, e.g. tokamax's Mosaic GPU kernel. It must
      be free of traced values (a module-level function, or a partial over Python constants).
    forward_aux: the array `forward` reads besides q, k, v (e.g. segment ids); not differentiated.
    mosaic_backward: None (the Triton backward, `config`'s tiles), or the Mosaic GPU backward's
      tiles: its dq kernel, and dk/dv from Triton or Mosaic kernels (`MosaicBwdConfig.dkv`);
      sm90 GPUs, or its interpreter.

  Returns:
    [B, T, H, Dv] in q.dtype.
  """
  b, t, h, d = q.shape
  if k.ndim != 4 or k.shape[0] != b or k.shape[3] != d or v.shape[:3] != k.shape[:3]:
    raise ValueError(f"k must be [B={b}, S, Hk, D={d}] and v [B, S, Hk, Dv]; got {k.shape}, "
                     f"{v.shape}")
  if h % k.shape[2]:
    raise ValueError(f"query heads {h} must be a multiple of key heads {k.shape[2]}")
  s = k.shape[1]
  for name, x, n in (("k_lo", k_lo, t), ("k_hi", k_hi, t), ("q_lo", q_lo, s), ("q_hi", q_hi, s)):
    if x.shape != (b, n) or x.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32 [{b}, {n}], got {x.dtype} {x.shape}")
  aux = jnp.zeros((0,), jnp.int32) if forward_aux is None else forward_aux
  return _attention(q, k, v, k_lo, k_hi, q_lo, q_hi, aux, float(scale), config, forward,
                    mosaic_backward)


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
