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

import dataclasses
import functools
import math
from typing import Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from k3jax.parallel import context, sharding
from k3jax.layers.common import logical_param
from k3jax.ops.kernel_choice import pallas_or_xla
from pallas_kernels.short_conv import ConvConfig, conv_silu_bwd, conv_silu_fwd


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
  b = x.shape[0]
  if initial_state is None:
    initial_state = jnp.zeros((b, width - 1, channels), x.dtype)
  elif segment_ids is not None:
    raise ValueError("segment_ids must be None when initial_state is given; mask padding first")
  if initial_state.shape != (b, width - 1, channels):
    raise ValueError(f"initial_state must have shape {(b, width - 1, channels)}, "
                     f"got {initial_state.shape}")
  ext = jnp.concatenate([initial_state.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
  y = _conv_taps(ext, kernel, _tap_masks(segment_ids, width))
  final_state = ext[:, ext.shape[1] - (width - 1):]
  return y, final_state


def _shifted(a: jax.Array, i: int) -> jax.Array:
  """a[:, t - i] along axis 1 (zeros for t < i): [B, T, ...]."""
  if i == 0:
    return a
  pad = [(0, 0), (i, 0)] + [(0, 0)] * (a.ndim - 2)
  return jnp.pad(a, pad)[:, :a.shape[1]]


def _ahead(a: jax.Array, i: int) -> jax.Array:
  """a[:, t + i] along axis 1 (zeros past the end): the transpose of `_shifted`."""
  if i == 0:
    return a
  pad = [(0, 0), (0, i)] + [(0, 0)] * (a.ndim - 2)
  return jnp.pad(a, pad)[:, i:]


def _tap_masks(segment_ids: Optional[jax.Array], width: int):
  """Per tap i (tokens back), [B, T, 1] bool: x[t - i] reaches y[t] (same segment, t not padding);
  None without segment ids (every tap reaches)."""
  if segment_ids is None:
    return [None] * width
  valid = segment_ids != 0
  return [(valid & (_shifted(segment_ids, i) == segment_ids) if i else valid)[..., None]
          for i in range(width)]


def _tap(ext: jax.Array, width: int, i: int) -> jax.Array:
  """x[t - i] for the T positions of the row, from ext [B, W-1+T, C] (the W-1 inputs before the
  row, then the row)."""
  return jax.lax.dynamic_slice_in_dim(ext, width - 1 - i, ext.shape[1] - (width - 1), axis=1)


def _conv_taps(ext: jax.Array, kernel: jax.Array, masks) -> jax.Array:
  """y [B, T, C] fp32 = Σ_i kernel[W-1-i] · mask_i · x[t - i], x[t - i] from ext (`_tap`)."""
  width = kernel.shape[0]
  w32 = kernel.astype(jnp.float32)
  y = None
  for i in range(width):  # i = how many tokens back; W is tiny (4), so this unrolls.
    xi = _tap(ext, width, i).astype(jnp.float32)
    if masks[i] is not None:
      # A product, not a select against 0.0: XLA shares one materialised [B, T, C] zeros buffer
      # between every layer's selects (3 GiB at 1M tokens, alive for the whole step).
      xi = xi * masks[i].astype(xi.dtype)
    y = w32[width - 1 - i] * xi if y is None else y + w32[width - 1 - i] * xi
  return y


def _zero_history(x: jax.Array, width: int) -> jax.Array:
  """ext for a row with no history: W-1 zeros before x."""
  return jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))


def _conv_silu_fwd(x, kernel, segment_ids, out_dtype):
  width = kernel.shape[0]
  y = _conv_taps(_zero_history(x, width), kernel, _tap_masks(segment_ids, width))
  return jax.nn.silu(y).astype(out_dtype), (x, kernel, segment_ids)


def _conv_silu_bwd(out_dtype, residuals, dout):
  """dy = dout · silu'(y), silu'(y) = s (1 + y (1 − s)), s = sigmoid(y), with y recomputed;
  dx[t] = Σ_i kernel[W-1-i] · (mask_i · dy)[t + i];  dkernel[W-1-i] = Σ_{b,t} mask_i · dy · x[t − i]."""
  del out_dtype
  x, kernel, segment_ids = residuals
  width = kernel.shape[0]
  masks = _tap_masks(segment_ids, width)
  ext = _zero_history(x, width)
  y = _conv_taps(ext, kernel, masks)
  s = jax.nn.sigmoid(y)
  dy = dout.astype(jnp.float32) * s * (1.0 + y * (1.0 - s))
  w32 = kernel.astype(jnp.float32)
  dx, dkernel = None, []
  for i in range(width):
    dyi = dy if masks[i] is None else dy * masks[i].astype(dy.dtype)
    term = w32[width - 1 - i] * _ahead(dyi, i)
    dx = term if dx is None else dx + term
    dkernel.append(jnp.sum(dyi * _tap(ext, width, i).astype(jnp.float32), axis=(0, 1)))
  dkernel = jnp.stack(dkernel[::-1])          # tap i weighs kernel[W-1-i]
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_silu(x, kernel, segment_ids, out_dtype):
  return _conv_silu_fwd(x, kernel, segment_ids, out_dtype)[0]


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def _pallas_config(direction: str, shape) -> ConvConfig:
  """The kernels' tiles for a device's x of `shape` [B, T, C]: one warp owns 256 channels (8 a
  thread: 16-byte loads) of chunk_t tokens, the longest chunk (128, 64, 32) that still gives
  ≥ 1536 programs in the backward and ≥ 3072 in the forward (its steps are shorter). Measured on
  the H200 (RESULTS.md, run 28, call E), ms at [4 × 8192, C] against the tiled kernels before
  them: C = 1536 backward 0.171 (chunk 128) against 0.400, forward 0.090 (chunk 64) against
  0.131; C = 768 backward 0.096 (64) against 0.199, forward 0.052 (32) against 0.058."""
  b, t, c = shape
  base = ConvConfig(interpret=jax.default_backend() == "cpu")
  wanted = 3072 if direction == "fwd" else 1536
  chunk = base.chunk_t
  while chunk > 32 and b * -(-c // base.block_c) * -(-t // chunk) < wanted:
    chunk //= 2
  return dataclasses.replace(base, chunk_t=chunk)


def _conv_silu_pallas_fwd(x, kernel, segment_ids, out_dtype):
  """`_conv_silu_fwd`'s output from the Pallas kernel (pallas_kernels/short_conv), which reads x
  where it lies (no padded copy), interpreted on CPU; each device runs it on its own rows under a
  mesh that shards the batch (`sharding.map_over_batch_shards`)."""
  out = sharding.map_over_batch_shards(
      lambda kernel, x, segment_ids: conv_silu_fwd(x, kernel, segment_ids, out_dtype,
                                                   _pallas_config("fwd", x.shape)),
      x, segment_ids, shared=(kernel,))
  return out, (x, kernel, segment_ids)


def _conv_silu_pallas_bwd(out_dtype, residuals, dout):
  """`_conv_silu_bwd`'s math as one Pallas kernel (pallas_kernels/short_conv), interpreted on CPU.

  Under a mesh that shards the batch, each device runs the kernel on its own rows
  (`sharding.map_over_batch_shards`; XLA would otherwise gather the batch onto every device) and
  the kernel's gradient is the sum of the devices' partial sums."""
  del out_dtype
  x, kernel, segment_ids = residuals

  def local(kernel, x, segment_ids, dout):
    dx, dkernel = conv_silu_bwd(x, kernel, segment_ids, dout, _pallas_config("bwd", x.shape))
    return dx, dkernel.astype(jnp.float32)[None]      # [1, W, C]: this device's partial sum

  dx, dkernel_parts = sharding.map_over_batch_shards(local, x, segment_ids, dout, shared=(kernel,))
  return dx, jnp.sum(dkernel_parts, axis=0).astype(kernel.dtype), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_silu_pallas(x, kernel, segment_ids, out_dtype):
  return _conv_silu_pallas_fwd(x, kernel, segment_ids, out_dtype)[0]


_conv_silu_pallas.defvjp(_conv_silu_pallas_fwd, _conv_silu_pallas_bwd)
IMPLEMENTATIONS = {"xla": _conv_silu, "pallas": _conv_silu_pallas}


def conv_silu(x: jax.Array, kernel: jax.Array, segment_ids: Optional[jax.Array],
              out_dtype, kernel_choice: str = "xla") -> jax.Array:
  """silu(causal_conv1d(x, kernel, segment_ids)) in `out_dtype`, for training (no state).

  kernel_choice: 'xla' (XLA's forward and `_conv_silu_bwd`), 'pallas' (the same math as Pallas
  kernels, forward and backward: `pallas_kernels.short_conv`) or 'auto'
  (`k3jax.ops.kernel_choice.pallas_or_xla`: 'pallas' on a GPU); ImplConfig.kda_conv_kernel.

  x [B, T, C]; kernel [W, C]; segment_ids [B, T] int or None. The same values as the two-step
  computation (fp32 math), with a hand-written VJP that keeps only x (in its dtype), the kernel
  and the segment ids: autodiff kept fp32 copies of every shifted input and of the pre-activation,
  about five fp32 [B, T, C] arrays per convolution (15 GiB per KDA layer's three convolutions on
  a 1M-token row).
  """
  if x.ndim != 3 or kernel.ndim != 2 or kernel.shape[1] != x.shape[-1]:
    raise ValueError(f"conv_silu: x must be [B, T, C] and kernel [W, C], got {x.shape} and "
                     f"{kernel.shape}")
  if segment_ids is not None and segment_ids.shape != x.shape[:2]:
    raise ValueError(f"conv_silu: segment_ids must be [B, T] = {x.shape[:2]}, got "
                     f"{segment_ids.shape}")
  choice = pallas_or_xla(kernel_choice, "ImplConfig.kda_conv_kernel")
  out_dtype = jnp.dtype(out_dtype)
  impl = lambda x, kernel, seg: IMPLEMENTATIONS[choice](x, kernel, seg, out_dtype)
  # Under a mesh with a context axis each slice convolves its tokens after the W-1 before them.
  return context.conv_over_slices(impl, x, kernel, segment_ids)


class ShortConv(nn.Module):
  """Depthwise causal conv (no bias) + SiLU with a decode cache.

  Attributes:
    width: kernel size W (>= 1).
    channel_axis: logical axis name of the channel dim of the kernel (kernel axes ('conv', this)).
    dtype: output dtype. param_dtype: kernel dtype.
    kernel_choice: `conv_silu`'s, 'xla', 'pallas' or 'auto'.
  Call: x [B, T, C], segment_ids [B, T] int or None, decode -> [B, T, C] in `dtype`.
  """
  width: int = 4
  channel_axis: str = "heads"
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernel_choice: str = "xla"

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
      return conv_silu(x, kernel, segment_ids, self.dtype, self.kernel_choice)

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
