"""GPU implementations of `k3jax.ops.attention.attention`; none builds a [T, S] array.

Packed rows (segment ids) are handed to the kernels as documents: maximal runs of equal segment
ids (`document_bounds`), so each query needs only its document's first and last token. Padding
(segment 0) runs are documents too, so that every kernel sees finite rows everywhere; their
outputs are zeroed afterwards (`jnp.where`, so their gradients are zero as well). A segment id that
occurs in two separate runs of a row is two documents here (the XLA path, which compares ids,
would join them): packed rows (`k3jax.data.packing`) number their documents in order, one run each.

  * `tokamax_attention`: tokamax's Mosaic GPU flash attention (sm90+), `Mask(k_start=document
    start, is_causal=True)`, which keeps k_start a [B, 1, T] vector in its forward and in its stock
    sm90 backward (`tokamax/_src/ops/attention/pallas_mosaic_gpu_vjp_kernel_sm90.py`). The forward
    skips key blocks outside each query tile's documents; that backward skips only the causally
    masked blocks (a whole causal pass per row).
  * `mosaic_backward_attention`: tokamax's forward (its log-sum-exp residuals) with
    `pallas_kernels.flash_attention`'s Mosaic GPU backward, whose dq, dV and dK kernels skip every
    block outside the documents.
  (cuDNN's packed THD layout, one sequence per document, was tried: 10.9 ms forward+backward at
  T = 65536 with 8 documents on an H200, but outputs off by an error ratio of ~1 and NaN gradients
  against the dense reference, so it is not a k3jax path. RESULTS.md, run 9.)
  * `cudnn_causal_attention`: rows without segment ids (plain causal or no mask).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.common import kernel_entry_point
from pallas_kernels.flash_attention import MosaicBwdConfig, flash_attention


def document_bounds(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """First token and one past the last token of each token's run of equal segment ids.

  segment_ids [B, T] int -> (start, end), each [B, T] int32; O(T) (two cumulative scans).
  """
  b, t = segment_ids.shape
  idx = jnp.arange(t, dtype=jnp.int32)[None]
  change = segment_ids[:, 1:] != segment_ids[:, :-1]
  edge = jnp.ones((b, 1), bool)
  is_first = jnp.concatenate([edge, change], axis=1)
  is_last = jnp.concatenate([change, edge], axis=1)
  start = lax.cummax(jnp.where(is_first, idx, 0), axis=1)
  end = lax.cummin(jnp.where(is_last, idx + 1, t), axis=1, reverse=True)
  return start.astype(jnp.int32), end.astype(jnp.int32)


def key_ranges(segment_ids: jax.Array, causal: bool) -> tuple[jax.Array, ...]:
  """Per-query key range [k_lo, k_hi) and per-key query range [q_lo, q_hi), each [B, T] int32."""
  start, end = document_bounds(segment_ids)
  idx = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), start.shape)
  if causal:
    return start, idx + 1, idx, end
  return start, end, start, end


def _zero_padding(out: jax.Array, segment_ids: jax.Array) -> jax.Array:
  return jnp.where((segment_ids != 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def compute_capability() -> Optional[tuple[int, int]]:
  """The first GPU's CUDA compute capability, or None without an NVIDIA GPU backend."""
  try:
    if jax.default_backend() != "gpu":
      return None
    return tuple(int(x) for x in jax.devices("gpu")[0].compute_capability.split("."))
  except (RuntimeError, AttributeError, ValueError):
    return None


@functools.cache
def _tokamax_mosaic():
  """(op, Mask): tokamax 0.0.17's Mosaic GPU flash attention op and its mask class.

  The only place that reaches into tokamax's private `_src`: the public
  `tokamax.dot_product_attention` takes arbitrary masks only as dense [T, S] booleans.
  """
  from tokamax._src.ops.attention import base as tk_base  # pylint: disable=import-outside-toplevel
  from tokamax._src.ops.attention import pallas_mosaic_gpu as tk_mgpu  # pylint: disable=import-outside-toplevel
  return tk_mgpu.PallasMosaicGpuFlashAttention(), tk_base.Mask


def _tokamax_mask(segment_ids: Optional[jax.Array], t: int, causal: bool):
  _, mask_cls = _tokamax_mosaic()
  if segment_ids is None:
    return mask_cls(is_causal=causal)
  start, end = document_bounds(segment_ids)
  # [B, 1, T]: one range per query, shared by all heads.
  if causal:
    return mask_cls(k_start=start[:, None, :], is_causal=True)
  return mask_cls(k_start=start[:, None, :], k_end=end[:, None, :])


# Jitted (as the other kernels' entry points are): the MLA layers of a step call it with equal
# shapes, and JAX then traces it, lowers its Mosaic GPU kernels and differentiates it once for all
# of them, not once per layer (RESULTS.md, run 32).
@kernel_entry_point("scale", "causal")
def tokamax_attention(q, k, v, segment_ids: Optional[jax.Array], *, scale: float,
                      causal: bool) -> jax.Array:
  """tokamax Mosaic GPU forward and its stock backward. q [B,T,H,D], k/v [B,T,Hk,D|Dv],
  segment_ids [B, T] int32 or None -> [B, T, H, Dv] in q.dtype."""
  op, _ = _tokamax_mosaic()
  out = op(q, k, v, mask=_tokamax_mask(segment_ids, q.shape[1], causal), logits_scale=scale)
  return out if segment_ids is None else _zero_padding(out, segment_ids)


def tokamax_forward_lse(q, k, v, segment_ids, *, scale: float, causal: bool):
  """tokamax's forward with its residuals as a log-sum-exp: (out, lse [B, H, T] fp32, +inf where
  a query sees nothing): `flash_attention`'s forward contract."""
  op, _ = _tokamax_mosaic()
  out, (m, l) = op(q, k, v, mask=_tokamax_mask(segment_ids, q.shape[1], causal),
                   logits_scale=scale, return_residuals=True)
  # tokamax's m is the row max of the scaled logits and l the sum of exp(logit - m).
  lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)
  return out, lse


@kernel_entry_point("scale", "causal", "backward", "forward")
def mosaic_backward_attention(q, k, v, segment_ids: jax.Array, *, scale: float, causal: bool,
                              backward: MosaicBwdConfig = MosaicBwdConfig(),
                              forward=tokamax_forward_lse) -> jax.Array:
  """Document attention: tokamax's forward, `pallas_kernels.flash_attention`'s block-skipping
  Mosaic GPU backward (sm90), padding outputs zeroed. Shapes as `tokamax_attention`; segment_ids
  required. backward: its tiles and launch. forward: a function with `tokamax_forward_lse`'s
  signature (the tests give a dense one, for the interpreter)."""
  k_lo, k_hi, q_lo, q_hi = key_ranges(segment_ids, causal)
  # Segment ids reach the forward as its aux array: a partial over them would leak a tracer.
  fwd = functools.partial(forward, scale=scale, causal=causal)
  out = flash_attention(q, k, v, k_lo, k_hi, q_lo, q_hi, scale=scale, forward=fwd,
                        forward_aux=segment_ids, backward=backward)
  return _zero_padding(out, segment_ids)


def cudnn_causal_attention(q, k, v, *, scale: float, causal: bool) -> jax.Array:
  """cuDNN flash attention without a mask (rows without segment ids)."""
  d, dv = q.shape[-1], v.shape[-1]
  if dv < d:
    # jax.nn.dot_product_attention wants V shaped like K; zero columns add nothing to the output.
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, d - dv)))
  out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                     implementation="cudnn")
  return out[..., :dv]
