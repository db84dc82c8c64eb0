"""Depthwise causal short convolution + SiLU (the KDA layer's q/k/v "ShortConvolution").

y[t, c] = silu( sum_{j=0}^{W-1} w[j, c] * x[t - (W-1) + j, c] ), no bias; w[W-1] weighs the current
token (PyTorch conv1d layout with left padding W-1, as in fla's ShortConvolution).

Packed rows: an input x[t-i] contributes to y[t] only when it lies in the same segment as t, so nothing
leaks across document boundaries; padding (segment 0) contributes nothing and its outputs are zero.

Decode: the last W-1 inputs of the row are kept in the 'cache' collection as `conv_state`
[B, W-1, C]; every call continues the row's document from that state. In decode mode segment ids only
mark padding (0): padding inputs are stored as zeros, nonzero ids all count as the one continuing
document.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.layers.common import logical_param


def causal_conv1d(x: jax.Array, kernel: jax.Array, segment_ids: Optional[jax.Array] = None,
                  initial_state: Optional[jax.Array] = None) -> Tuple[jax.Array, jax.Array]:
  """Depthwise causal conv, no activation.

  Args:
    x: [B, T, C] input.
    kernel: [W, C]; kernel[W-1] multiplies the current token.
    segment_ids: [B, T] int (0 = padding) or None. Inputs from another segment or padding are skipped.
      Must be None when `initial_state` is given (the state continues one document).
    initial_state: [B, W-1, C] inputs preceding x (oldest first), or None for zeros.

  Returns:
    y [B, T, C] in fp32, and the final state [B, W-1, C] in x.dtype: the last W-1 inputs of the
    state-extended sequence.
  """
  if x.ndim != 3:
    raise ValueError(f"x must be [B, T, C], got shape {x.shape}")
  width, channels = kernel.shape
  if channels != x.shape[-1]:
    raise ValueError(f"kernel has {channels} channels, x has {x.shape[-1]}")
  b, t, _ = x.shape
  if initial_state is None:
    initial_state = jnp.zeros((b, width - 1, channels), x.dtype)
  elif segment_ids is not None:
    raise ValueError("segment_ids must be None when initial_state is given; mask padding first")
  if initial_state.shape != (b, width - 1, channels):
    raise ValueError(f"initial_state must have shape {(b, width - 1, channels)}, "
                     f"got {initial_state.shape}")
  ext = jnp.concatenate([initial_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
  w32 = kernel.astype(jnp.float32)
  y = jnp.zeros((b, t, channels), jnp.float32)
  for i in range(width):  # i = how many tokens back; W is tiny (4), so this unrolls.
    xi = jax.lax.dynamic_slice_in_dim(ext, width - 1 - i, t, axis=1).astype(jnp.float32)
    if segment_ids is not None and i > 0:
      seg_prev = jnp.pad(segment_ids, ((0, 0), (i, 0)))[:, :t]
      xi = jnp.where((seg_prev == segment_ids)[..., None], xi, 0.0)
    y = y + w32[width - 1 - i] * xi
  if segment_ids is not None:
    y = jnp.where((segment_ids != 0)[..., None], y, 0.0)
  final_state = ext[:, ext.shape[1] - (width - 1):]
  return y, final_state


class ShortConv(nn.Module):
  """Depthwise causal conv (no bias) + SiLU with a decode cache.

  Attributes:
    width: kernel size W (>= 1).
    channel_axis: logical axis name of the channel dim of the kernel (kernel axes ('conv', this)).
    dtype: output dtype. param_dtype: kernel dtype.
  Call: x [B, T, C], segment_ids [B, T] int or None, decode -> [B, T, C] in `dtype`.
  """
  width: int = 4
  channel_axis: str = "heads"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: Optional[jax.Array] = None, *,
               decode: bool = False) -> jax.Array:
    if self.width < 1:
      raise ValueError(f"width must be >= 1, got {self.width}")
    b, t, c = x.shape
    bound = 1.0 / math.sqrt(self.width)  # PyTorch's default for a depthwise conv (fan_in = W)
    kernel = logical_param(self, "kernel", (self.width, c), ("conv", self.channel_axis),
                           _uniform(bound), self.param_dtype)
    if segment_ids is not None and segment_ids.shape != (b, t):
      raise ValueError(f"segment_ids must have shape {(b, t)}, got {segment_ids.shape}")
    if not decode:
      y, _ = causal_conv1d(x, kernel, segment_ids)
      return nn.silu(y).astype(self.dtype)

    initializing = self.is_initializing()
    state = self.variable("cache", "conv_state", jnp.zeros, (b, self.width - 1, c), x.dtype)
    if initializing:
      # The init call only sizes the cache; it leaves the state empty.
      y, _ = causal_conv1d(x, kernel, segment_ids)
      return nn.silu(y).astype(self.dtype)
    if state.value.shape[0] != b:
      raise ValueError(f"decode batch {b} differs from the cache batch {state.value.shape[0]}")
    valid = None
    if segment_ids is not None:
      valid = (segment_ids != 0)[..., None]
      x = jnp.where(valid, x, jnp.zeros_like(x))
    y, new_state = causal_conv1d(x, kernel, None, state.value)
    state.value = new_state.astype(state.value.dtype)
    if valid is not None:
      y = jnp.where(valid, y, 0.0)
    return nn.silu(y).astype(self.dtype)


def _uniform(bound: float):
  """U(-bound, bound) initializer."""

  def init(key, shape, dtype=jnp.float32):
    return jax.random.uniform(key, shape, dtype, -bound, bound)
  return init
