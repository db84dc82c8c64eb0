"""Helpers shared by the Pallas kernel folders."""
from __future__ import annotations

import jax


def result_like(x: jax.Array, shape, dtype) -> jax.ShapeDtypeStruct:
  """A kernel result of `shape` and `dtype` varying over x's manual mesh axes: inside `shard_map`
  (as the expert-parallel MoE calls the kernels) pallas_call must be told, and a custom VJP's
  cotangent must vary as its input does."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


def column_chunk(width: int, cap: int) -> int:
  """The largest power of two that divides `width` and is at most `cap`: the column chunk of the
  kernels that loop over a width that is not a power of two (Triton wants power-of-two arrays)."""
  return min(cap, width & -width)
