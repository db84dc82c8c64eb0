"""RMSNorm's backward as one Pallas kernel (Triton lowering).

Forward (`k3jax.layers.common.rms_norm`), per row of x [N, d]: r = (mean_d x² + eps)^-½,
y = x · r · w. Backward, from the residuals x and r and the output's cotangent dy, in fp32:

  u = dy · w,   dx = r·u − x · r³ · mean_d(x·u),   dw = Σ_rows dy · x · r

Why a kernel: XLA runs dw's sum over the rows as a column reduction of its own next to dx's row
fusion (medium.gin's step, RESULTS.md run 23: 4.9 ms for its 16 ffn_norms' column sums alone,
about 0.3 ms each where reading their inputs once takes about 0.05). Here one program owns a tile of rows
across the whole width: pass 1 reads its x and dy tiles for the per-row mean_d(x·u), pass 2 reads
them again (from L2, just read) to write dx and its tile's partial sums of dw ([d] fp32 per
program; the caller adds the programs'). Each array is read from HBM once.

d (768, 1536) is not a power of two, which Triton wants for every array inside a kernel: each
[N, d] array is one (block_rows, d) block and the kernel loops over its width in chunks of Dc
columns (the largest power of two dividing d, capped at block_d), as the depth-mix kernels do.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two, column_chunk, result_like


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
  """Tiles and the Triton launch; the interpreter (CPU tests) ignores the launch.

  Attributes:
    block_rows: rows per program (power of two; capped at N rounded up to a power of two).
    block_d: cap on the column chunk Dc (power of two; Dc also divides d).
    num_warps, num_stages: the Triton launch. interpret: run in the Pallas interpreter.
  """
  block_rows: int = 16
  block_d: int = 128
  num_warps: int = 4
  num_stages: int = 1
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_rows", "block_d")


def _bwd_kernel(x_ref, r_ref, dy_ref, w_ref, dx_ref, dw_ref, *, d: int, dc: int):
  """x_ref, dy_ref [R, d]; r_ref [R] fp32; w_ref [d]; dx_ref [R, d]; dw_ref [d] fp32 (this
  program's partial sums)."""
  chunks = d // dc
  r = r_ref[...][:, None]

  def load(c):
    cols = pl.ds(c * dc, dc)
    x = x_ref[:, cols].astype(jnp.float32)
    dy = dy_ref[:, cols].astype(jnp.float32)
    return cols, x, dy, dy * w_ref[cols].astype(jnp.float32)[None, :]

  def row_sums(c, acc):
    _, x, _, u = load(c)
    return acc + jnp.sum(x * u, axis=1)

  xu = jax.lax.fori_loop(0, chunks, row_sums, jnp.zeros((x_ref.shape[0],), jnp.float32))
  coef = (r * r * r) * (xu / d)[:, None]

  def write(c, carry):
    cols, x, dy, u = load(c)
    dx_ref[:, cols] = (r * u - x * coef).astype(dx_ref.dtype)
    dw_ref[cols] = jnp.sum(dy * x * r, axis=0)
    return carry

  jax.lax.fori_loop(0, chunks, write, 0)


def rms_norm_bwd(x: jax.Array, weight: jax.Array, r: jax.Array, dy: jax.Array,
                 config: RmsNormConfig = RmsNormConfig()) -> tuple[jax.Array, jax.Array]:
  """(dx, dw) of y = x · r · weight (module docstring).

  x [..., d] (any float dtype); weight [d]; r [..., 1] or [...] fp32 (the forward's scale); dy
  [..., d] (any float dtype). Returns dx [..., d] in x.dtype and dw [d] fp32.
  """
  d = x.shape[-1]
  if weight.shape != (d,) or dy.shape != x.shape:
    raise ValueError(f"rms_norm_bwd: x {x.shape}, weight {weight.shape} and dy {dy.shape} do not "
                     "fit ([..., d], [d], [..., d])")
  n = x.size // d if d else 0
  if r.size != n:
    raise ValueError(f"rms_norm_bwd: r must hold one scale per row ({n}), got shape {r.shape}")
  rows = min(config.block_rows, pl.next_power_of_2(max(n, 1)))
  n_pad = pl.cdiv(n, rows) * rows
  x2 = jnp.pad(x.reshape(n, d), ((0, n_pad - n), (0, 0)))
  dy2 = jnp.pad(dy.reshape(n, d), ((0, n_pad - n), (0, 0)))
  r2 = jnp.pad(r.reshape(n).astype(jnp.float32), (0, n_pad - n))
  programs = n_pad // rows
  params = {} if config.interpret else dict(compiler_params=pl_triton.CompilerParams(
      num_warps=config.num_warps, num_stages=config.num_stages))
  dx, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, d=d, dc=column_chunk(d, config.block_d)),
      grid=(programs,),
      in_specs=[pl.BlockSpec((rows, d), lambda i: (i, 0)),
                pl.BlockSpec((rows,), lambda i: (i,)),
                pl.BlockSpec((rows, d), lambda i: (i, 0)),
                pl.BlockSpec((d,), lambda i: (0,))],
      out_specs=[pl.BlockSpec((rows, d), lambda i: (i, 0)),
                 pl.BlockSpec((None, d), lambda i: (i, 0))],
      out_shape=[result_like(x, (n_pad, d), x.dtype),
                 result_like(x, (programs, d), jnp.float32)],
      interpret=config.interpret,
      name="rms_norm_bwd",
      **params,
  )(x2, r2, dy2, weight)
  return dx[:n].reshape(x.shape), jnp.sum(dw, axis=0)
