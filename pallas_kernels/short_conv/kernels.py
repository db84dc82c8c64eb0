"""The backward of the KDA layer's short convolution + SiLU as two Pallas kernels (Triton lowering).

Forward (`k3jax.layers.conv.conv_silu`): y[t, c] = Σ_j w[W-1-j, c] · m_j[t] · x[t-j, c],
out = silu(y), m_j[t] = 1 when t is a token (segment id ≠ 0) and x[t-j] lies in its segment.
Backward, with dy[t] = dout[t] · silu'(y[t]) and silu'(y) = σ(y)(1 + y(1 − σ(y))):

  dw[W-1-i]    = Σ_{b,t} m_i[t] · dy[t] · x[t-i]
  dx[t]        = Σ_i w[W-1-i] · m_i[t+i] · dy[t+i],   m_i[t+i] = (seg[t+i] ≠ 0) · (seg[t] = seg[t+i])

Kernel 1 (`_dy_dw_kernel`) recomputes y from x at the W shifts t, t-1, .., t-W+1, writes dy once
(fp32) and its program's partial sums of dw ([W, block_c] fp32 over `tiles_per_program` tiles;
the caller sums the programs'). Kernel 2 (`_dx_kernel`) reads dy at the W shifts t .. t+W-1 (the
neighbouring rows come from the cache) and writes dx. Each element's sigmoid is computed once.
A single kernel that recomputed dy at every shift dx needs (run 17: 2W-1 shifted x tiles and W
sigmoids per element live at once) spilled registers and ran slower than XLA's fusion.

Inputs arrive padded by `conv_silu_bwd`: W-1 zero rows before x and the segment ids (0 = padding,
so the masks drop them), T to whole programs, C to whole tiles; dy has one program's rows of zeros
after the row's end, so that dx's shifted reads stay inside the array; the kernel's W rows are
padded to a power of two (Triton's blocks are powers of two), the extra rows zero.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two, result_like


@dataclasses.dataclass(frozen=True)
class ConvConfig:
  """Tile sizes (powers of two) and the Triton launch; the interpreter ignores the launch.

  Attributes:
    block_t: tokens per tile (raised to the next power of two >= W when smaller). block_c: channels per tile.
    tiles_per_program: kernel 1's tiles of block_t tokens per program (its dw partial sums stay in
      registers across them: fewer partial sums for the caller to add).
    launch: (num_warps, num_stages) of both kernels. interpret: run in the Pallas interpreter (CPU).
  """
  block_t: int = 32
  block_c: int = 64
  tiles_per_program: int = 8
  launch: tuple = (4, 1)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_t", "block_c", "tiles_per_program")


def _sigmoid(y):
  return 1.0 / (1.0 + jnp.exp(-y))


def _dy_dw_kernel(x_ref, seg_ref, dout_ref, w_ref, dy_ref, dw_ref, *, width: int, block_t: int,
                  tiles: int, programs: int):
  """x_ref [h + Tp, bc] (h = W - 1 zero rows first), seg_ref [h + Tp + R] int32, dout_ref [Tp, bc],
  w_ref [Wp, bc]; dy_ref [R, bc] fp32 (R = tiles · block_t rows of this program); dw_ref [Wp, bc]
  fp32, this program's partial sums. The program after the last writes zeros (dy's tail)."""
  halo = width - 1
  r = pl.program_id(1)

  @pl.when(r == programs)
  def _():
    dy_ref[...] = jnp.zeros(dy_ref.shape, jnp.float32)
    dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

  @pl.when(r < programs)
  def _():
    w = [w_ref[k, :].astype(jnp.float32)[None, :] for k in range(width)]

    def tile(s, dw):
      t0 = r * tiles * block_t + s * block_t
      here = seg_ref[pl.ds(halo + t0, block_t)]
      valid = here != 0
      masks, xs = [], []
      for j in range(width):   # j = how many tokens back
        m = valid if j == 0 else valid & (seg_ref[pl.ds(halo + t0 - j, block_t)] == here)
        masks.append(m[:, None])
        xs.append(x_ref[pl.ds(halo + t0 - j, block_t), :].astype(jnp.float32))
      y = w[width - 1] * jnp.where(masks[0], xs[0], 0.0)
      for j in range(1, width):
        y = y + w[width - 1 - j] * jnp.where(masks[j], xs[j], 0.0)
      sig = _sigmoid(y)
      dout = dout_ref[pl.ds(t0, block_t), :].astype(jnp.float32)
      dy = dout * sig * (1.0 + y * (1.0 - sig))
      dy_ref[pl.ds(s * block_t, block_t), :] = dy
      return tuple(dw[j] + jnp.sum(jnp.where(masks[j], dy * xs[j], 0.0), axis=0)
                   for j in range(width))

    zero = jnp.zeros((dw_ref.shape[1],), jnp.float32)
    dw = jax.lax.fori_loop(0, tiles, tile, (zero,) * width)
    for j in range(width):   # tap j weighs w[W-1-j]
      dw_ref[width - 1 - j, :] = dw[j]
    for k in range(width, dw_ref.shape[0]):
      dw_ref[k, :] = zero


def _dx_kernel(dy_ref, seg_ref, w_ref, dx_ref, *, width: int, block_t: int):
  """dy_ref [Tp + R, bc] fp32, seg_ref [h + Tp + R] int32, w_ref [Wp, bc]; dx_ref [bt, bc]."""
  halo = width - 1
  t0 = pl.program_id(1) * block_t
  here = seg_ref[pl.ds(halo + t0, block_t)]
  dx = None
  for i in range(width):
    ahead = seg_ref[pl.ds(halo + t0 + i, block_t)]
    m = (ahead != 0) & (ahead == here)
    term = w_ref[width - 1 - i, :].astype(jnp.float32)[None, :] * jnp.where(
        m[:, None], dy_ref[pl.ds(t0 + i, block_t), :], 0.0)
    dx = term if dx is None else dx + term
  dx_ref[...] = dx.astype(dx_ref.dtype)


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
  halo = width - 1
  # dx's shifted reads of dy reach W - 1 rows past a tile: at most one tile's rows.
  bt = max(min(config.block_t, pl.next_power_of_2(t)), pl.next_power_of_2(width))
  bc = min(config.block_c, pl.next_power_of_2(c))
  tiles = min(config.tiles_per_program, pl.cdiv(t, bt))
  rows = tiles * bt                                   # kernel 1's rows per program
  programs = pl.cdiv(t, rows)
  tp, cp, wp = programs * rows, pl.cdiv(c, bc) * bc, pl.next_power_of_2(width)
  x_pad = jnp.pad(x, ((0, 0), (halo, tp - t), (0, cp - c)))
  seg_pad = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (halo, tp - t + rows)))
  dout_pad = jnp.pad(dout, ((0, 0), (0, tp - t), (0, cp - c)))
  w_pad = jnp.pad(kernel, ((0, wp - width), (0, cp - c)))
  params = {} if config.interpret else dict(compiler_params=pl_triton.CompilerParams(
      num_warps=config.launch[0], num_stages=config.launch[1]))
  row_spec = lambda n: pl.BlockSpec((None, n, bc), lambda bi, ti, ci: (bi, 0, ci))
  seg_spec = pl.BlockSpec((None, halo + tp + rows), lambda bi, ti, ci: (bi, 0))
  w_spec = pl.BlockSpec((wp, bc), lambda bi, ti, ci: (0, ci))
  dy, dw = pl.pallas_call(
      functools.partial(_dy_dw_kernel, width=width, block_t=bt, tiles=tiles, programs=programs),
      grid=(b, programs + 1, cp // bc),
      in_specs=[row_spec(halo + tp), seg_spec, row_spec(tp), w_spec],
      out_specs=[pl.BlockSpec((None, rows, bc), lambda bi, ti, ci: (bi, ti, ci)),
                 pl.BlockSpec((None, None, wp, bc), lambda bi, ti, ci: (bi, ti, 0, ci))],
      out_shape=[result_like(x, (b, tp + rows, cp), jnp.float32),
                 result_like(x, (b, programs + 1, wp, cp), jnp.float32)],
      interpret=config.interpret,
      name="short_conv_silu_dy_dw",
      **params,
  )(x_pad, seg_pad, dout_pad, w_pad)
  dx = pl.pallas_call(
      functools.partial(_dx_kernel, width=width, block_t=bt),
      grid=(b, tp // bt, cp // bc),
      in_specs=[row_spec(tp + rows), seg_spec, w_spec],
      out_specs=pl.BlockSpec((None, bt, bc), lambda bi, ti, ci: (bi, ti, ci)),
      out_shape=result_like(x, (b, tp, cp), x.dtype),
      interpret=config.interpret,
      name="short_conv_silu_dx",
      **params,
  )(dy, seg_pad, w_pad)
  dkernel = jnp.sum(dw, axis=(0, 1))[:width, :c]
  return dx[:, :t, :c], dkernel.astype(kernel.dtype)
