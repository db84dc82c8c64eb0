"""Position-wise computations over a long sequence in rematerialised chunks.

At 1M tokens a position-wise block (FFN, MoE experts, LM head + loss) has [T, wide] intermediates
of several GiB each, and autodiff keeps them for the backward pass. `map_position_chunks` runs such
a block over slices of the sequence axis inside a `lax.map`, each slice under `jax.checkpoint`:
the forward holds one slice's intermediates at a time and the backward keeps only the slices'
inputs, recomputing the rest slice by slice. Values equal the unchunked computation (each token is
computed by the same ops; only per-chunk sums are added in a different order).

Chunks split the sequence axis T of [B, T, ...] arrays and keep the batch axis whole, so a batch
sharded over devices stays sharded inside every chunk.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

PyTree = Any


def chunk_layout(batch: int, length: int, chunk_tokens: int) -> tuple[int, int]:
  """(number of chunks n, positions per chunk c) for [batch, length] tokens.

  c·batch <= chunk_tokens where possible (c >= 1 whatever the batch), and c = ceil(length / n) so
  that the padding of the last chunk is below n positions. chunk_tokens <= 0, or a batch that fits
  one chunk, gives (1, length).
  """
  if batch <= 0 or length <= 0:
    raise ValueError(f"chunk_layout: batch={batch} and length={length} must be positive")
  if chunk_tokens <= 0 or batch * length <= chunk_tokens:
    return 1, length
  max_positions = max(1, chunk_tokens // batch)
  n = math.ceil(length / max_positions)
  return n, math.ceil(length / n)


def map_position_chunks(fn: Callable[..., tuple[PyTree, PyTree]], arrays: Sequence[jax.Array],
                        chunk_tokens: int) -> tuple[PyTree, PyTree]:
  """Runs `fn` over sequence chunks of `arrays`; returns (per-position outputs, summed outputs).

  Args:
    fn: (*chunk_arrays) -> (per_position, summed). chunk_arrays are `arrays` cut to [B, c, ...];
      per_position is a pytree of [B, c, ...] arrays; summed a pytree of arrays that are added
      over the chunks (e.g. per-expert loads, a loss sum). fn must be pure: weights it uses come
      in through its closure (a `lax.map` constant), not from flax modules called inside it.
    arrays: [B, T, ...] arrays with the same B and T. When T is not a multiple of the chunk, the
      last chunk is padded with zeros (False for bool arrays): fn must leave padded positions out
      of `summed` (pass it a validity mask among `arrays`); they are cut off `per_position`.
    chunk_tokens: the most tokens (B·c) per chunk (at least one position per chunk); <= 0 or
      B·T <= chunk_tokens calls fn once on the whole arrays, with nothing rematerialised.
  Returns:
    (per_position with [B, T, ...] leaves, summed).
  """
  if not arrays:
    raise ValueError("map_position_chunks: arrays must hold at least one [B, T, ...] array")
  batch, length = arrays[0].shape[:2]
  for a in arrays:
    if a.shape[:2] != (batch, length):
      raise ValueError(f"map_position_chunks: every array must start with [B={batch}, "
                       f"T={length}], got shape {a.shape}")
  n, c = chunk_layout(batch, length, chunk_tokens)
  if n == 1:
    return fn(*arrays)
  pad = n * c - length

  def split(a):   # [B, T, ...] -> [n, B, c, ...]
    if pad:
      a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    return jnp.moveaxis(a.reshape((batch, n, c) + a.shape[2:]), 1, 0)

  def join(a):    # [n, B, c, ...] -> [B, T, ...]
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape((batch, n * c) + a.shape[3:])[:, :length]

  body = jax.checkpoint(lambda xs: fn(*xs))
  per_position, summed = jax.lax.map(body, tuple(split(a) for a in arrays))
  return jax.tree.map(join, per_position), jax.tree.map(lambda s: jnp.sum(s, axis=0), summed)
