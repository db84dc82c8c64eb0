"""Helpers shared by the Pallas kernel folders."""
from __future__ import annotations

import functools

import jax


def result_like(x: jax.Array, shape, dtype) -> jax.ShapeDtypeStruct:
  """A kernel result of `shape` and `dtype` varying over x's manual mesh axes: inside `shard_map`
  (as the expert-parallel MoE calls the kernels) pallas_call must be told, and a custom VJP's
  cotangent must vary as its input does."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).manual_axis_type)


def kernel_entry_point(*static_argnames: str):
  """Decorator for a kernel's entry point: `jax.jit` with these static arguments, so that JAX
  traces the kernel and lowers it once per shape and setting, not at every call site (a step
  calls it once per layer; XLA inlines the call)."""
  return functools.partial(jax.jit, static_argnames=static_argnames)


def column_chunk(width: int, cap: int) -> int:
  """The largest power of two that divides `width` and is at most `cap`: the column chunk of the
  kernels that loop over a width that is not a power of two (Triton wants power-of-two arrays)."""
  return min(cap, width & -width)


def check_powers_of_two(config, *names: str) -> None:
  """Raises ValueError, naming the config's class and field, unless each named field of a kernel's
  tile config is a positive power of two (Triton's blocks must be)."""
  for name in names:
    value = getattr(config, name)
    if not isinstance(value, int) or value < 1 or value & (value - 1):
      raise ValueError(f"{type(config).__name__}.{name} must be a power of two, got {value!r}")
