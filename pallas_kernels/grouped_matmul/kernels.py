"""The grouped matmul's weight gradient as a Pallas kernel (Triton).

out[g] = lhs[rows of g]ᵀ · dout[rows of g].

The routed experts' grouped matmul out = lhs @ rhs[group] has rows sorted by group; its weight
gradient contracts the ragged dimension: drhs[g] = Σ_{r in group g} lhs[r]ᵀ dout[r], [G, K, N].

Why a kernel of our own: tokamax 0.0.17's sm90 kernel for it (`ragged_contracting_dim_dot`)
returned wrong sums on an H200 with its default tiles and with most others (max errors up to
13-22 % of the largest entry against an fp32 reference, and a different result on a second call),
RESULTS.md run 18. This kernel was right at every shape and group-size draw tried there, and
2.2-2.7x faster than tokamax's one right tile at small.gin's and medium.gin's shapes.

Each program owns one [bk, bn] tile of one group's gradient and walks that group's rows in steps of
`block_rows`, loading them with a row mask (rows of other groups and past Σ sizes read as zeros), so
a tile needs no alignment of the groups to the steps and no program writes another's output. An
empty group's tile is zeros.

Grid (K / bk, N / bn, G); fp32 accumulation; operands in their own dtype (bf16 on the GPU path).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two, result_like


@dataclasses.dataclass(frozen=True)
class GroupedGradConfig:
  """Tiles (powers of two; block_k and block_n are capped at the largest power of two dividing K
  and N) and the Triton launch (num_warps, num_stages); the interpreter (CPU tests) ignores the
  launch."""
  block_k: int = 128
  block_n: int = 128
  block_rows: int = 64
  launch: tuple = (8, 3)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_k", "block_n", "block_rows")


def _launch(config: GroupedGradConfig) -> dict:
  if config.interpret:
    return dict(interpret=True)
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=config.launch[0],
                                                       num_stages=config.launch[1]))


def _kernel(start_ref, size_ref, lhs_ref, dout_ref, out_ref, *, block_rows: int, precision):
  """start_ref, size_ref [1] int32 (this group's first row and row count); lhs_ref [M, bk];
  dout_ref [M, bn]; out_ref [bk, bn]."""
  start = start_ref[0]
  end = start + size_ref[0]
  steps = lax.div(size_ref[0] + block_rows - 1, block_rows)
  offsets = lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
  num_rows = lhs_ref.shape[0]

  def step(s, acc):
    lo = start + s * block_rows
    # The tile is moved back to end inside the array where the group's last rows are the array's;
    # rows before `lo` (the previous step's) and past the group read as zeros.
    first = jnp.minimum(lo, num_rows - block_rows)
    rows = first + offsets
    mask = ((rows >= lo) & (rows < end))[:, None]
    a = pl_triton.load(lhs_ref.at[pl.ds(first, block_rows), :], mask=mask, other=0)
    b = pl_triton.load(dout_ref.at[pl.ds(first, block_rows), :], mask=mask, other=0)
    return acc + jnp.dot(a.T, b, precision=precision, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, steps, step, jnp.zeros(out_ref.shape, jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


def grouped_weight_grad(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, out_dtype=None,
                        config: GroupedGradConfig = GroupedGradConfig()) -> jax.Array:
  """out[g] = lhs[rows of g]ᵀ · dout[rows of g]: [G, K, N] in out_dtype (default lhs.dtype).

  lhs [M, K] and dout [M, N] (rows sorted by group, equal float dtypes); group_sizes [G] int, with
  Σ group_sizes <= M (rows past the sum belong to no group). The products run in the operands'
  dtype (fp32 operands: fp32 products) and accumulate in fp32. A row tile may start mid-group.
  """
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(f"grouped_weight_grad: lhs must be [M, K] and dout [M, N], got {lhs.shape} "
                     f"and {dout.shape}")
  if group_sizes.ndim != 1:
    raise ValueError(f"grouped_weight_grad: group_sizes must be [G], got {group_sizes.shape}")
  if lhs.dtype != dout.dtype:
    raise ValueError(f"grouped_weight_grad: lhs and dout must share a dtype, got {lhs.dtype} "
                     f"and {dout.dtype}")
  m, k = lhs.shape
  n = dout.shape[1]
  g = group_sizes.shape[0]
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  bk = min(config.block_k, k & -k)          # k & -k: the largest power of two dividing k
  bn = min(config.block_n, n & -n)
  br = min(config.block_rows, pl.next_power_of_2(m))
  if m < br:   # one row tile must fit in the array (the kernel clamps its start to M - br)
    lhs = jnp.pad(lhs, ((0, br - m), (0, 0)))
    dout = jnp.pad(dout, ((0, br - m), (0, 0)))
  sizes = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes
  # fp32 operands: fp32 products (Triton's default for fp32 dots is TF32).
  precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
  one = pl.BlockSpec((1,), lambda i, j, e: (e,))
  return pl.pallas_call(
      functools.partial(_kernel, block_rows=br, precision=precision),
      grid=(k // bk, n // bn, g),
      in_specs=[one, one,
                pl.BlockSpec((lhs.shape[0], bk), lambda i, j, e: (0, i)),
                pl.BlockSpec((dout.shape[0], bn), lambda i, j, e: (0, j))],
      out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, e: (e, i, j)),
      out_shape=result_like(lhs, (g, k, n), out_dtype),
      name="grouped_weight_grad",
      **_launch(config),
  )(starts, sizes, lhs, dout)
