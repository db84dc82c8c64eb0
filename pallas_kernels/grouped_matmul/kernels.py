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


def _kernel(start_ref, size_ref, lhs_ref, dout_ref, *rest, block_rows: int, precision,
            accumulate: bool):
  """start_ref, size_ref [1] int32 (this group's first row and row count); lhs_ref [M, bk];
  dout_ref [M, bn]; then out_ref [bk, bn], or with accumulate scale_ref [1] fp32, acc_ref [bk, bn]
  fp32 and out_ref (acc_ref's buffer: out = acc + scale · sum)."""
  out_ref = rest[-1]
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
  if accumulate:
    scale_ref, acc_ref = rest[0], rest[1]
    out_ref[...] = acc_ref[...] + scale_ref[0] * acc
  else:
    out_ref[...] = acc.astype(out_ref.dtype)


def _check(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, fn: str) -> None:
  if lhs.ndim != 2 or dout.ndim != 2 or lhs.shape[0] != dout.shape[0]:
    raise ValueError(f"{fn}: lhs must be [M, K] and dout [M, N], got {lhs.shape} and "
                     f"{dout.shape}")
  if group_sizes.ndim != 1:
    raise ValueError(f"{fn}: group_sizes must be [G], got {group_sizes.shape}")
  if lhs.dtype != dout.dtype:
    raise ValueError(f"{fn}: lhs and dout must share a dtype, got {lhs.dtype} and {dout.dtype}")


def _call(lhs, dout, group_sizes, config, out_dtype, n, column_offset=0, scale=None, acc=None):
  """The pallas_call over columns [column_offset, column_offset + n) of dout: [G, K, n] sums in
  out_dtype, or acc + scale · sums written into acc's buffer when acc is given."""
  m, k = lhs.shape
  g = group_sizes.shape[0]
  bk = min(config.block_k, k & -k)          # k & -k: the largest power of two dividing k
  bn = min(config.block_n, n & -n, column_offset & -column_offset or n)
  br = min(config.block_rows, pl.next_power_of_2(m))
  if m < br:   # one row tile must fit in the array (the kernel clamps its start to M - br)
    lhs = jnp.pad(lhs, ((0, br - m), (0, 0)))
    dout = jnp.pad(dout, ((0, br - m), (0, 0)))
  sizes = group_sizes.astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes
  # fp32 operands: fp32 products (Triton's default for fp32 dots is TF32).
  precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
  one = pl.BlockSpec((1,), lambda i, j, e: (e,))
  first_block = column_offset // bn
  in_specs = [one, one,
              pl.BlockSpec((lhs.shape[0], bk), lambda i, j, e: (0, i)),
              pl.BlockSpec((dout.shape[0], bn), lambda i, j, e: (0, j + first_block))]
  tile = pl.BlockSpec((None, bk, bn), lambda i, j, e: (e, i, j))
  args = [starts, sizes, lhs, dout]
  extra = {}
  if acc is not None:
    in_specs += [pl.BlockSpec((1,), lambda i, j, e: (0,)), tile]
    args += [jnp.reshape(scale, (1,)).astype(jnp.float32), acc]
    extra = dict(input_output_aliases={len(args) - 1: 0})
  return pl.pallas_call(
      functools.partial(_kernel, block_rows=br, precision=precision, accumulate=acc is not None),
      grid=(k // bk, n // bn, g),
      in_specs=in_specs,
      out_specs=tile,
      out_shape=result_like(lhs, (g, k, n), out_dtype),
      name="grouped_weight_grad" if acc is None else "grouped_weight_grad_acc",
      **extra, **_launch(config),
  )(*args)


def grouped_weight_grad(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, out_dtype=None,
                        config: GroupedGradConfig = GroupedGradConfig()) -> jax.Array:
  """out[g] = lhs[rows of g]ᵀ · dout[rows of g]: [G, K, N] in out_dtype (default lhs.dtype).

  lhs [M, K] and dout [M, N] (rows sorted by group, equal float dtypes); group_sizes [G] int, with
  Σ group_sizes <= M (rows past the sum belong to no group). The products run in the operands'
  dtype (fp32 operands: fp32 products) and accumulate in fp32. A row tile may start mid-group.
  """
  _check(lhs, dout, group_sizes, "grouped_weight_grad")
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  return _call(lhs, dout, group_sizes, config, out_dtype, dout.shape[1])


def grouped_weight_grad_accumulate(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array,
                                   accumulators: tuple, scale: jax.Array,
                                   config: GroupedGradConfig = GroupedGradConfig()) -> tuple:
  """accumulators[i] + scale · (`grouped_weight_grad`'s sums over accumulator i's columns of dout),
  each written into its accumulator's buffer (a donated accumulator is updated in place).

  A training step's gradient accumulation over micro-batches then reads and writes each fp32
  accumulator once inside the kernel, instead of the kernel writing the gradient and a separate
  add reading it back with the accumulator. lhs [M, K], dout [M, N] and group_sizes [G] as for
  `grouped_weight_grad`; accumulators: fp32 arrays [G, K, n_i] with Σ n_i = N, accumulator i
  taking dout's columns [Σ_{j<i} n_j, Σ_{j<=i} n_j) (a weight used as the concatenation of
  several parameters along N, such as the experts' gate|up); scale: fp32 scalar. The sums are
  accumulated in fp32 and not rounded before the scaled add. Returns the updated accumulators.
  """
  fn = "grouped_weight_grad_accumulate"
  _check(lhs, dout, group_sizes, fn)
  g, k = group_sizes.shape[0], lhs.shape[1]
  widths = [a.shape[-1] for a in accumulators]
  for a in accumulators:
    if a.ndim != 3 or a.shape[:2] != (g, k) or a.dtype != jnp.float32:
      raise ValueError(f"{fn}: each accumulator must be float32 [G={g}, K={k}, n], got "
                       f"{a.dtype}{list(a.shape)}")
  if sum(widths) != dout.shape[1]:
    raise ValueError(f"{fn}: the accumulators' widths {widths} must sum to dout's "
                     f"{dout.shape[1]} columns")
  if jnp.shape(scale) not in ((), (1,)):
    raise ValueError(f"{fn}: scale must be a scalar, got shape {jnp.shape(scale)}")
  out, offset = [], 0
  for a, n in zip(accumulators, widths):
    out.append(_call(lhs, dout, group_sizes, config, jnp.dtype(jnp.float32), n, offset, scale, a))
    offset += n
  return tuple(out)
