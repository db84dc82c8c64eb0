"""The backward of the KDA layer's short convolution + SiLU as one Pallas kernel (Triton lowering).

Forward (`k3jax.layers.conv.conv_silu`): y[t, c] = Σ_j w[W-1-j, c] · m_j[t] · x[t-j, c],
out = silu(y), m_j[t] = 1 when t is a token (segment id ≠ 0) and x[t-j] lies in its segment.
Backward, with dy[t] = dout[t] · silu'(y[t]) and silu'(y) = σ(y)(1 + y(1 − σ(y))):

  dx[t]        = Σ_i w[W-1-i] · m_i[t+i] · dy[t+i]
  dw[W-1-i]    = Σ_{b,t} m_i[t] · dy[t] · x[t-i]

One program owns a [block_t, block_c] tile of one row: it reads x at the 2W-1 shifts t-W+1 ..
t+W-1, the segment ids at the same shifts and dout at t .. t+W-1 (neighbouring tiles' rows come
from the cache), recomputes y and dy at the W shifts that dx needs, writes its dx tile and its
tile's partial sums of dw ([W, block_c] fp32, summed over tiles by the caller). Each array is read
from memory about once and dx written once; XLA's fusions of the same math wrote and re-read an
fp32 dy and its masked copies (RESULTS.md run 16: 5-6x the bytes).

Inputs arrive padded by `conv_silu_bwd`: T to whole tiles plus W-1 zero rows on both sides of x and
of the segment ids (0 = padding, so the masks drop them) and W-1 after dout; C to whole tiles; the
kernel's W rows to a power of two (Triton's blocks are powers of two), the extra rows zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """Tile sizes (powers of two) and the Triton launch; the interpreter ignores the launch.

  Attributes:
    block_t: tokens per program. block_c: channels per program.
    launch: (num_warps, num_stages). interpret: run in the Pallas interpreter (CPU tests).
  """
  block_t: int = 32
  block_c: int = 128
  launch: tuple = (4, 1)
  interpret: bool = False

  def __post_init__(self):
    for name in ("block_t", "block_c"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"ConvConfig.{name} must be a power of two, got {value}")


def _sigmoid(y):
  return 1.0 / (1.0 + jnp.exp(-y))


def _bwd_kernel(x_ref, seg_ref, dout_ref, w_ref, dx_ref, dw_ref, *, width: int, block_t: int):
  """x_ref [T + 2h, bc], seg_ref [T + 2h], dout_ref [T + h, bc], w_ref [Wp, bc] (h = W - 1);
  dx_ref [bt, bc]; dw_ref [Wp, bc] fp32 (this tile's partial sums)."""
  halo = width - 1
  t0 = pl.program_id(1) * block_t
  w = [w_ref[k, :].astype(jnp.float32)[None, :] for k in range(width)]
  x_at = {d: x_ref[pl.ds(t0 + halo + d, block_t), :].astype(jnp.float32)
          for d in range(-halo, halo + 1)}
  seg_at = {d: seg_ref[pl.ds(t0 + halo + d, block_t)] for d in range(-halo, halo + 1)}

  def mask(j, s):
    """[bt, 1] bool: x[t+s-j] reaches y[t+s]."""
    here = seg_at[s]
    m = here != 0
    if j:
      m = m & (seg_at[s - j] == here)
    return m[:, None]

  def dy_at(s):
    y = w[width - 1] * jnp.where(mask(0, s), x_at[s], 0.0)
    for j in range(1, width):
      y = y + w[width - 1 - j] * jnp.where(mask(j, s), x_at[s - j], 0.0)
    sig = _sigmoid(y)
    dout = dout_ref[pl.ds(t0 + s, block_t), :].astype(jnp.float32)
    return dout * sig * (1.0 + y * (1.0 - sig))

  dy0 = dy_at(0)
  dx = w[width - 1] * jnp.where(mask(0, 0), dy0, 0.0)
  for i in range(1, width):
    dx = dx + w[width - 1 - i] * jnp.where(mask(i, i), dy_at(i), 0.0)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  for i in range(width):  # tap i weighs w[W-1-i]
    dw_ref[width - 1 - i, :] = jnp.sum(jnp.where(mask(i, 0), dy0 * x_at[-i], 0.0), axis=0)
  for k in range(width, dw_ref.shape[0]):
    dw_ref[k, :] = jnp.zeros((dw_ref.shape[1],), jnp.float32)


def conv_silu_bwd(x: jax.Array, kernel: jax.Array, segment_ids, dout: jax.Array,
                  config: ConvConfig = ConvConfig()) -> tuple[jax.Array, jax.Array]:
  """(dx, dkernel) of out = silu(causal depthwise conv(x, kernel)) (module docstring).

  x [B, T, C]; kernel [W, C] (kernel[W-1] weighs the current token); segment_ids [B, T] int
  (0 = padding) or None (one document a row); dout [B, T, C]. Returns dx [B, T, C] in x.dtype and
  dkernel [W, C] in kernel.dtype; the math in fp32.
  """
  b, t, c = x.shape
  width = kernel.shape[0]
  if kernel.shape != (width, c) or dout.shape != x.shape:
    raise ValueError(f"conv_silu_bwd: x {x.shape}, kernel {kernel.shape} and dout {dout.shape} "
                     "do not fit ([B, T, C], [W, C], [B, T, C])")
  if segment_ids is None:
    segment_ids = jnp.ones((b, t), jnp.int32)
  if segment_ids.shape != (b, t):
    raise ValueError(f"conv_silu_bwd: segment_ids must be [B, T] = {(b, t)}, got "
                     f"{segment_ids.shape}")
  bt = min(config.block_t, pl.next_power_of_2(t))
  bc = min(config.block_c, pl.next_power_of_2(c))
  tp, cp, halo = pl.cdiv(t, bt) * bt, pl.cdiv(c, bc) * bc, width - 1
  wp = pl.next_power_of_2(width)
  x_pad = jnp.pad(x, ((0, 0), (halo, tp - t + halo), (0, cp - c)))
  seg_pad = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (halo, tp - t + halo)))
  dout_pad = jnp.pad(dout, ((0, 0), (0, tp - t + halo), (0, cp - c)))
  w_pad = jnp.pad(kernel, ((0, wp - width), (0, cp - c)))
  params = {} if config.interpret else dict(compiler_params=pl_triton.CompilerParams(
      num_warps=config.launch[0], num_stages=config.launch[1]))
  dx, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, width=width, block_t=bt),
      grid=(b, tp // bt, cp // bc),
      in_specs=[
          pl.BlockSpec((None, tp + 2 * halo, bc), lambda bi, ti, ci: (bi, 0, ci)),
          pl.BlockSpec((None, tp + 2 * halo), lambda bi, ti, ci: (bi, 0)),
          pl.BlockSpec((None, tp + halo, bc), lambda bi, ti, ci: (bi, 0, ci)),
          pl.BlockSpec((wp, bc), lambda bi, ti, ci: (0, ci)),
      ],
      out_specs=[
          pl.BlockSpec((None, bt, bc), lambda bi, ti, ci: (bi, ti, ci)),
          pl.BlockSpec((None, None, wp, bc), lambda bi, ti, ci: (bi, ti, 0, ci)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, tp, cp), x.dtype),
                 jax.ShapeDtypeStruct((b, tp // bt, wp, cp), jnp.float32)],
      interpret=config.interpret,
      name="short_conv_silu_bwd",
      **params,
  )(x_pad, seg_pad, dout_pad, w_pad)
  dkernel = jnp.sum(dw, axis=(0, 1))[:width, :c]
  return dx[:, :t, :c], dkernel.astype(kernel.dtype)
