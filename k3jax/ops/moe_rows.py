"""Row movements of the MoE: permutations and dispatch gathers whose VJPs are gathers, the weighted
combine of each token's expert outputs, row zeroing, and the sort that builds the maps.

Autodiff's transpose of a gather `x[src]` is a scatter-add, slow on the GPU: the MoE's backward spent
~150 ms of a 402 ms small.gin step on one H200 in two of them. Every function here that
moves rows takes the inverse map as well and gathers in both passes. The maps come from two stable
sorts (`sort_with_inverse`) and comparisons (`sorted_group_sizes`), never from a scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@jax.custom_vjp
def zero_rows(x: jax.Array, keep: jax.Array) -> jax.Array:
  """x [M, ...] with the rows where keep [M] (bool) is False set to zero; the same in the backward.

  As `jnp.where(keep[:, None], x, 0)`, but the backward keeps only `keep`: autodiff of the where
  (a jitted function) kept its fp32 [M, ℓ] output and an [M, ℓ] bool mask for the backward, on top
  of the combine's own copy of the expert outputs (`experiments/benchmarks/saved_residuals.py`).
  """
  return jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def _zero_rows_fwd(x, keep):
  return zero_rows(x, keep), keep


def _zero_rows_bwd(keep, dy):
  return zero_rows(dy, keep), None


zero_rows.defvjp(_zero_rows_fwd, _zero_rows_bwd)


def _common_varying(*arrays: jax.Array) -> list[jax.Array]:
  """`arrays` made varying over the same manual mesh axes (the union of theirs).

  Inside `shard_map` a custom VJP must return each cotangent varying over exactly its input's
  axes; the weights enter the expert-parallel body varying over 'expert' only, their gradient
  would vary over 'data' too. Cast up front, the cast's transpose sums the gradient over 'data'.
  Outside shard_map nothing varies and this returns the arrays unchanged.
  """
  axes = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
  out = []
  for a in arrays:
    missing = tuple(sorted(axes - jax.typeof(a).manual_axis_type.varying))
    out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return out


def gather_rows(x: jax.Array, src: jax.Array, src_ok: jax.Array, back: jax.Array,
                back_ok: jax.Array) -> jax.Array:
  """out[r] = x[src[r]] where src_ok[r], else 0; its VJP is a gather too (no scatter-add).

  x [n, ...] any float dtype; src [m] int32 in [0, n); src_ok [m] bool; back [n, f] int32 in
  [0, m) and back_ok [n, f] bool: the rows of `out` that read row i of x (back_ok False for the
  unused slots). (src, src_ok) and (back, back_ok) must describe the same relation: r is listed
  in back[src[r]] exactly when src_ok[r]. Then dx[i] = Σ_f dout[back[i, f]] over back_ok, summed
  in fp32 (f = k for the dispatch of a token to its k experts, 1 for a permutation). Returns
  [m, ...] in x.dtype. What autodiff would make of `x[src]`, a scatter-add, costs the MoE's
  backward ~150 ms of a 402 ms small.gin step on one H200.
  """
  # (Inside shard_map, x and the maps made varying over the same mesh axes: `_common_varying`.)
  return _gather_rows(*_common_varying(x, src, src_ok, back, back_ok))


@jax.custom_vjp
def _gather_rows(x, src, src_ok, back, back_ok):
  return _masked_take(x, src, src_ok)


def _masked_take(x: jax.Array, index: jax.Array, ok: jax.Array) -> jax.Array:
  rows = jnp.take(x, index, axis=0, mode="clip")
  return jnp.where(ok.reshape(ok.shape + (1,) * (x.ndim - 1)), rows, jnp.zeros((), x.dtype))


def _gather_rows_fwd(x, src, src_ok, back, back_ok):
  return _masked_take(x, src, src_ok), (src, src_ok, back, back_ok)


def _gather_rows_bwd(residuals, dout):
  src, src_ok, back, back_ok = residuals
  n, fan = back.shape
  picked = _masked_take(dout, back.reshape(n * fan), back_ok.reshape(n * fan))
  dx = jnp.sum(picked.reshape((n, fan) + dout.shape[1:]).astype(jnp.float32), axis=1)
  return dx.astype(dout.dtype), None, None, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def permute_rows(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
  """x[order] for a permutation `order` [n] with its inverse [n]; the VJP gathers with `inverse`."""
  ones = jnp.ones(order.shape, bool)
  return gather_rows(x, order, ones, inverse[:, None], ones[:, None])


def sorted_group_sizes(sorted_keys: jax.Array, num_groups: int) -> jax.Array:
  """[num_groups] int32: how many of the ascending `sorted_keys` [m] equal 0, 1, … num_groups-1
  (keys >= num_groups are not counted). Comparisons and a sum, not the scatter-add of bincount."""
  bounds = jnp.searchsorted(sorted_keys, jnp.arange(num_groups + 1, dtype=sorted_keys.dtype),
                            side="left", method="compare_all").astype(jnp.int32)
  return bounds[1:] - bounds[:-1]


def sort_with_inverse(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(order, inverse) of a stable ascending sort of `keys` [m]: keys[order] is sorted and
  inverse[order[r]] = r. The inverse is a second sort, not the scatter `.at[order].set(arange)`."""
  order = jnp.argsort(keys, stable=True).astype(jnp.int32)
  return order, jnp.argsort(order).astype(jnp.int32)


def weighted_combine(y_rows: jax.Array, rows: jax.Array, ok: jax.Array, weight: jax.Array,
                     src: jax.Array, src_ok: jax.Array, out_dtype) -> jax.Array:
  """y[i] = Σ_j weight[i, j] · y_rows[rows[i, j]] over the j where ok[i, j], summed in fp32.

  The combine of each token's k expert outputs, straight from the rows the experts wrote (the
  unsort is the gather by `rows`). Args:
    y_rows: [m, ℓ] expert outputs in any float dtype (rows not listed in `rows` are never read
      into the result, so they may hold anything, NaN included).
    rows: [n, k] int32 in [0, m): the row of token i's j-th assignment.
    ok: [n, k] bool: False leaves that assignment out (its row is not read into the sum).
    weight: [n, k] float combine weights.
    src: [m] int32: the flat assignment i·k + j that row r belongs to, and src_ok [m] bool (False
      for rows no assignment owns): the inverse map of (rows, ok), used by the backward.
    out_dtype: dtype of the result.
  Returns y [n, ℓ] in out_dtype.

  Gradients: d y_rows[r] = weight_a · dy[a // k] for a = src[r] (zero where not src_ok), a gather;
  d weight[i, j] = <dy[i], y_rows[rows[i, j]]> (zero where not ok). The backward keeps y_rows in
  its own dtype: autodiff of a gather and an fp32 einsum kept the gathered fp32 [n, k, ℓ] copy
  (12 KB a token per layer at ℓ = 768, k = 4; `experiments/benchmarks/saved_residuals.py`), and
  its forward wrote that copy out before reducing it.
  """
  n, k = rows.shape
  if ok.shape != (n, k) or weight.shape != (n, k):
    raise ValueError(f"weighted_combine: rows {rows.shape}, ok {ok.shape} and weight "
                     f"{weight.shape} must all be [n, k]")
  if y_rows.ndim != 2 or src.shape != (y_rows.shape[0],) or src_ok.shape != src.shape:
    raise ValueError(f"weighted_combine: y_rows {y_rows.shape} must be [m, l] with src "
                     f"{src.shape} and src_ok {src_ok.shape} both [m]")
  return _weighted_combine(*_common_varying(y_rows, rows, ok, weight, src, src_ok),
                           jnp.dtype(out_dtype))


def _combine(y_rows, rows, ok, weight):
  picked = jnp.take(y_rows, rows, axis=0, mode="clip").astype(jnp.float32)   # [n, k, ℓ]
  terms = jnp.where(ok[..., None], weight.astype(jnp.float32)[..., None] * picked, 0.0)
  return jnp.sum(terms, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _weighted_combine(y_rows, rows, ok, weight, src, src_ok, out_dtype):
  return _combine(y_rows, rows, ok, weight).astype(out_dtype)


def _weighted_combine_fwd(y_rows, rows, ok, weight, src, src_ok, out_dtype):
  return (_weighted_combine(y_rows, rows, ok, weight, src, src_ok, out_dtype),
          (y_rows, rows, ok, weight, src, src_ok))


def _weighted_combine_bwd(out_dtype, residuals, dy):
  y_rows, rows, ok, weight, src, src_ok = residuals
  n, k = rows.shape
  dy32 = dy.astype(jnp.float32)
  picked = jnp.take(y_rows, rows, axis=0, mode="clip").astype(jnp.float32)   # [n, k, ℓ]
  d_weight = jnp.where(ok, jnp.einsum("nkl,nl->nk", picked, dy32), 0.0).astype(weight.dtype)
  w_of_row = jnp.take(weight.reshape(n * k), src, mode="clip").astype(jnp.float32)   # [m]
  dy_of_row = jnp.take(dy32, src // k, axis=0, mode="clip")                  # [m, ℓ]
  d_rows = jnp.where(src_ok[:, None], w_of_row[:, None] * dy_of_row, 0.0).astype(y_rows.dtype)
  return d_rows, None, None, d_weight, None, None


_weighted_combine.defvjp(_weighted_combine_fwd, _weighted_combine_bwd)
