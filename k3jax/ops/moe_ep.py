"""Expert parallelism (EP) for the routed experts, and Quantile Balancing from global histograms.

Layout. Tokens are sharded over the mesh's batch axes ('data', 'expert'); the routed-expert weights
[E, ...] are sharded over 'expert' (each of the n = |expert| devices holds E_loc = E/n consecutive
experts, expert e on device e // E_loc) and replicated over 'data'. Every 'data' row of the mesh is
an independent EP group. Inside one `jax.shard_map`, each device:

  1. flattens its N_loc·k assignments, stable-sorts them by destination device and packs them into a
     send buffer [n, C, ℓ] (plus each row's local expert id; the sentinel E_loc marks an empty
     slot);
  2. `all_to_all` over 'expert': row block s of the receive buffer is what device s sent here;
  3. stable-sorts the n·C received rows by local expert and runs the SiTU-GLU experts as three
     grouped matmuls (`ragged_dot_fn`) with the per-expert group sizes (empty slots sort last and
     are zeroed);
  4. unsorts, `all_to_all`s the results back to the senders (in z.dtype) and combines them with the
     router weights in fp32, exactly like `k3jax.ops.moe.routed_experts`.

Every row movement (packing, the sort by local expert and its undoing) is a
`k3jax.ops.moe.gather_rows`, and the return to the tokens a `weighted_combine`: their backwards are
gathers with the inverse maps, neither pass has a scatter(-add). The grouped matmul is the one of
ImplConfig.moe_grouped_matmul (tokamax's Mosaic GPU kernels by default on the GPU), as on one
device.

Buffer capacity C (rows per (source, destination) pair), all shapes static:
  * dropless, capacity_factor == 0: C = N_loc·min(k, E_loc), the most one device can ever send to
    another (a token's k experts are distinct, at most min(k, E_loc) of them live on one device).
    Exact: the result equals the single-device dropless path. Memory is n·C rows per device, up to n
    times the balanced amount.
  * capacity_factor > 0: C = ceil(capacity_factor·N_loc·k/n) (capped at the dropless C). Assignments
    beyond C for one destination are dropped (they add zero; the token's other experts keep their
    weights), the *latest* tokens of the sending shard first, since the sort is stable. The count is
    reported in stats['dropped']. With Quantile Balancing every expert gets ≈ m·k/E assignments
    per batch, so each (source, destination) pair sees ≈ N_loc·k/n and factor 1.25 leaves drops
    ≈ 0 while keeping the buffers 1.25× the balanced size. Note the capacity is per device pair,
    not per expert as in the single-device capacity path, so drops differ between the two.

The return trip carries z.dtype (bf16 in training: half the traffic of fp32); in fp32 the result
matches the single-device path to rounding.
A `ragged_all_to_all` variant (MaxText) would send only the occupied rows; the padded all_to_all is
used here because it runs on every backend, including the 8 fake CPU devices of the tests.

`routed_experts_auto` is the entry point for layers: the EP path when the current mesh (set by
`k3jax.parallel.sharding.with_mesh`) has an 'expert' axis > 1, the single-device
`routed_experts` otherwise.

Quantile Balancing from histograms (`qb_histogram`, `qb_bias_from_histogram`): each device, and
each micro-batch of an optimizer step, counts its tokens' QB deficits per expert in bins fixed by
the bias alone; the int32 [E, bins] counts add exactly over micro-batches and devices, and the
step's new bias is read from their sum (within about a bin of the exact quantile).
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from k3jax.ops.grouped_matmul import RaggedDotFn
from k3jax.ops.moe import _check_shapes, grouped_situ_glu, qb_bars, routed_experts
from k3jax.ops.moe_rows import (gather_rows, permute_rows, sort_with_inverse, sorted_group_sizes,
                                weighted_combine)
from k3jax.parallel.sharding import BATCH_AXES, TOKEN_AXES

EXPERT_AXIS = "expert"

try:  # jax >= 0.7: jax.shard_map with check_vma.
  _shard_map_impl = jax.shard_map

  def _shard_map(f, mesh, in_specs, out_specs):
    return _shard_map_impl(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=True)
except AttributeError:  # older jax: the experimental API with check_rep.
  from jax.experimental.shard_map import shard_map as _shard_map_impl  # type: ignore

  def _shard_map(f, mesh, in_specs, out_specs):
    if mesh is None:
      raise ValueError("this jax version needs an explicit mesh for expert parallelism; pass mesh=")
    return _shard_map_impl(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=True)


def _current_mesh(mesh: Optional[Mesh]):
  """The mesh to use: `mesh` if given, else the context mesh (None when there is none)."""
  if mesh is not None:
    return mesh
  abstract = jax.sharding.get_abstract_mesh()
  return None if abstract.empty else abstract


def _axis_sizes(mesh) -> dict:
  return dict(zip(mesh.axis_names, mesh.axis_sizes)) if hasattr(mesh, "axis_sizes") else \
      dict(mesh.shape)


def ep_capacity(tokens_per_device: int, top_k: int, num_experts: int, num_ep: int,
                capacity_factor: float) -> int:
  """Rows C of each (source, destination) buffer; see the module docstring."""
  local_experts = num_experts // num_ep
  dropless = tokens_per_device * min(top_k, local_experts)
  if capacity_factor == 0:
    return dropless
  if capacity_factor < 0:
    raise ValueError(f"ep_capacity: capacity_factor={capacity_factor} must be >= 0 (0 = dropless)")
  return min(dropless, int(math.ceil(capacity_factor * tokens_per_device * top_k / num_ep)))


def _local_ep(z, expert_idx, expert_weight, valid, w_gate, w_up, w_out, *, num_experts: int,
              num_ep: int, capacity: int, beta1: Optional[float], beta2: Optional[float],
              ragged_dot_fn: RaggedDotFn, activation: str, reduce_axes: tuple):
  """Per-device body of the EP shard_map (shapes are the device-local ones)."""
  n_loc, latent = z.shape
  k = expert_idx.shape[1]
  local_experts = w_gate.shape[0]
  num_assign = n_loc * k
  dtype = z.dtype

  flat_expert = expert_idx.reshape(num_assign).astype(jnp.int32)
  token_of = jnp.arange(num_assign, dtype=jnp.int32) // k
  valid_assign = jnp.repeat(valid, k)
  dest = flat_expert // local_experts
  local_id = flat_expert % local_experts
  # Invalid assignments get the sentinel destination n: they sort last and are never sent.
  dest_key = jnp.where(valid_assign, dest, num_ep)
  order, inverse = sort_with_inverse(dest_key)
  sorted_dest = dest_key[order]
  per_dest = sorted_group_sizes(sorted_dest, num_ep)
  starts = jnp.cumsum(per_dest) - per_dest
  starts_ext = jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])
  rank = jnp.arange(num_assign, dtype=jnp.int32) - starts_ext[sorted_dest]
  routed = sorted_dest < num_ep
  kept = routed & (rank < capacity)

  # Every row movement is a `gather_rows` (its backward a gather with the inverse map, no
  # scatter-add). Send row d·C + c holds sorted assignment starts[d] + c when that slot is filled;
  # kept sorted assignment p sits in send row dest_p·C + rank_p.
  slot = jnp.arange(capacity, dtype=jnp.int32)
  src = jnp.clip(starts[:, None] + slot[None, :], 0, num_assign - 1).reshape(-1)   # [n·C]
  filled = (slot[None, :] < jnp.minimum(per_dest, capacity)[:, None]).reshape(-1)
  send_row = (jnp.minimum(sorted_dest, num_ep - 1) * capacity
              + jnp.clip(rank, 0, capacity - 1))                                  # [N_loc·k]
  # Token i's k assignments, by their send rows (assignment a is sorted position inverse[a]).
  token_send_rows = send_row[inverse].reshape(n_loc, k)
  token_sent = kept[inverse].reshape(n_loc, k)
  x_send = gather_rows(z, token_of[order][src], filled, token_send_rows, token_sent)
  x_send = x_send.reshape(num_ep, capacity, latent)                               # [n, C, ℓ]
  id_send = jnp.where(filled, local_id[order][src], local_experts).reshape(num_ep, capacity)

  x_recv = jax.lax.all_to_all(x_send, EXPERT_AXIS, 0, 0)
  id_recv = jax.lax.all_to_all(id_send, EXPERT_AXIS, 0, 0)

  rows = num_ep * capacity
  recv_key = id_recv.reshape(rows)
  recv_order, recv_inverse = sort_with_inverse(recv_key)
  sorted_key = recv_key[recv_order]
  group_sizes = sorted_group_sizes(sorted_key, local_experts)
  xs = permute_rows(x_recv.reshape(rows, latent), recv_order, recv_inverse)
  w_gate, w_up, w_out = (w.astype(dtype) for w in (w_gate, w_up, w_out))
  ys = grouped_situ_glu(xs, w_gate, w_up, w_out, group_sizes, sorted_key < local_experts,
                        beta1=beta1, beta2=beta2, ragged_dot_fn=ragged_dot_fn,
                        activation=activation).astype(dtype)
  y_recv = permute_rows(ys, recv_inverse, recv_order).reshape(num_ep, capacity, latent)

  y_back = jax.lax.all_to_all(y_recv, EXPERT_AXIS, 0, 0)                      # [n, C, ℓ]
  # Straight from the returned rows to the tokens' assignments (unsort included): assignment a
  # reads return row send_row[inverse[a]] when kept; return row d·C + c goes to assignment
  # order[starts[d] + c] when filled.
  y = weighted_combine(y_back.reshape(rows, latent), token_send_rows, token_sent, expert_weight,
                       order[src], filled, dtype)

  # Per-expert counts by comparison and sum (bincount would be a scatter-add).
  load = jnp.sum((flat_expert[:, None] == jnp.arange(num_experts, dtype=jnp.int32)[None, :])
                 & valid_assign[:, None], axis=0).astype(jnp.float32)
  dropped = jnp.sum(routed & ~kept).astype(jnp.int32)
  return y, jax.lax.psum(load, reduce_axes), jax.lax.psum(dropped, reduce_axes)


def routed_experts_ep(
    z: jax.Array,
    expert_idx: jax.Array,
    expert_weight: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_out: jax.Array,
    *,
    beta1: Optional[float],
    beta2: Optional[float],
    capacity_factor: float = 0.0,
    valid: Optional[jax.Array] = None,
    mesh: Optional[Mesh] = None,
    ragged_dot_fn: RaggedDotFn = jax.lax.ragged_dot,
    activation: str = "xla",
) -> tuple[jax.Array, dict]:
  """`k3jax.ops.moe.routed_experts` with the experts sharded over the mesh's 'expert' axis.

  Args:
    z, expert_idx, expert_weight, w_gate, w_up, w_out, beta1, beta2, valid, ragged_dot_fn,
      activation: as in
      `routed_experts` (global shapes: z [N, ℓ], expert_idx/expert_weight [N, k], w_* [E, ...]).
    capacity_factor: 0 for dropless; > 0 for per-(source, destination) buffers of
      ceil(capacity_factor·(N/devices)·k/n_expert) rows (module docstring).
    mesh: a mesh with axes ('data', 'expert'); default the current mesh (`jax.set_mesh`).
  Returns:
    y [N, ℓ] in z.dtype, sharded like z; stats {'load': [E] fp32 (all devices, before drops),
    'dropped': int32 scalar (all devices)}.
  Raises:
    ValueError: no mesh, a mesh without the ('data', 'expert') axes, E not divisible by the expert
      axis, or N not divisible by the number of devices of the batch axes.
  """
  _check_shapes(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid)
  mesh = _current_mesh(mesh)
  if mesh is None:
    raise ValueError("routed_experts_ep: no mesh; pass mesh= or call inside "
                     "k3jax.parallel.sharding.with_mesh(mesh)")
  sizes = _axis_sizes(mesh)
  if any(a not in sizes for a in BATCH_AXES):
    raise ValueError(f"routed_experts_ep: mesh axes {tuple(sizes)} must include {BATCH_AXES}")
  num_ep = sizes[EXPERT_AXIS]
  # The flattened [B * T] tokens: rows over the batch axes, and each row's slices over 'context'.
  token_axes = tuple(a for a in TOKEN_AXES if a in sizes)
  devices = math.prod(sizes[a] for a in token_axes)
  n = z.shape[0]
  k = expert_idx.shape[1]
  num_experts = w_gate.shape[0]
  if num_experts % num_ep:
    raise ValueError(f"routed_experts_ep: {num_experts} experts cannot be split over the "
                     f"'expert' mesh axis of size {num_ep}; it must divide moe_num_experts")
  if n % devices:
    raise ValueError(f"routed_experts_ep: {n} tokens cannot be split over the {devices} devices "
                     f"of the token axes {token_axes}; batch·length must be a multiple of it")
  capacity = ep_capacity(n // devices, k, num_experts, num_ep, capacity_factor)
  if valid is None:
    valid = jnp.ones((n,), bool)

  body = lambda *a: _local_ep(*a, num_experts=num_experts, num_ep=num_ep, capacity=capacity,
                              beta1=beta1, beta2=beta2, ragged_dot_fn=ragged_dot_fn,
                              activation=activation, reduce_axes=token_axes)
  tok = P(token_axes)
  expert_w = P(EXPERT_AXIS)
  y, load, dropped = _shard_map(
      body, mesh, in_specs=(tok, tok, tok, tok, expert_w, expert_w, expert_w),
      out_specs=(tok, P(), P()))(z, expert_idx, expert_weight, valid.astype(bool), w_gate, w_up,
                                  w_out)
  return y, {"load": load, "dropped": dropped}


def expert_parallel_size(mesh: Optional[Mesh] = None) -> int:
  """Size of the 'expert' axis of `mesh` (default: the current mesh); 1 without a mesh."""
  mesh = _current_mesh(mesh)
  if mesh is None:
    return 1
  return int(_axis_sizes(mesh).get(EXPERT_AXIS, 1))


def routed_experts_auto(z: jax.Array, expert_idx: jax.Array, expert_weight: jax.Array,
                        w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array, *,
                        beta1: Optional[float], beta2: Optional[float], capacity_factor: float = 0.0,
                        valid: Optional[jax.Array] = None,
                        ragged_dot_fn: RaggedDotFn = jax.lax.ragged_dot,
                        activation: str = "xla") -> tuple[jax.Array, dict]:
  """`routed_experts` with the signature unchanged: EP when the current mesh has 'expert' > 1.

  Without a mesh, or with expert axis 1 (pure data parallelism, where XLA partitions the
  single-device code), this is `k3jax.ops.moe.routed_experts`. Capacity semantics differ between the
  two paths (per expert vs per device pair); dropless results are identical.
  """
  kwargs = dict(beta1=beta1, beta2=beta2, capacity_factor=capacity_factor, valid=valid,
                ragged_dot_fn=ragged_dot_fn, activation=activation)
  if expert_parallel_size() > 1:
    return routed_experts_ep(z, expert_idx, expert_weight, w_gate, w_up, w_out, **kwargs)
  return routed_experts(z, expert_idx, expert_weight, w_gate, w_up, w_out, **kwargs)


# ------------------------------------------------------------------------------------------------
# Quantile Balancing from histograms


def _check_qb_args(fn: str, scores: jax.Array, bias: jax.Array, top_k: int, bins: int,
                   mask: Optional[jax.Array]) -> jax.Array:
  """The [tokens] bool validity after checking the arguments of the histogram functions."""
  if scores.ndim != 2:
    raise ValueError(f"{fn}: scores must be [tokens, experts], got shape {scores.shape}")
  rows, n = scores.shape
  if bias.shape != (n,):
    raise ValueError(f"{fn}: bias must be [experts={n}], got shape {bias.shape}")
  if not (isinstance(top_k, numbers.Integral) and 1 <= top_k < n):
    raise ValueError(f"{fn}: top_k={top_k!r} must be an integer in [1, experts={n})")
  if not (isinstance(bins, numbers.Integral) and bins >= 2):
    raise ValueError(f"{fn}: bins={bins!r} must be an integer >= 2")
  if mask is not None and mask.shape != (rows,):
    raise ValueError(f"{fn}: mask must be [tokens={rows}] bool, got shape {mask.shape}")
  return jnp.ones((rows,), bool) if mask is None else mask.astype(bool)


def qb_histogram_range(bias: jax.Array, bins: int) -> tuple[jax.Array, jax.Array]:
  """(lo, width), fp32 scalars: the QB histogram covers [min b − 1, max b + 1] in `bins` equal bins.

  Scores are sigmoids in [0, 1] and every bar is a biased score s + b, so each deficit
  r = bar − s lies in that range. It depends on the bias alone, which stays fixed over an
  optimizer step: the histograms of the step's micro-batches and devices share their bins and add.
  """
  b = bias.astype(jnp.float32)
  lo = jnp.min(b) - 1.0
  return lo, (jnp.max(b) + 1.0 - lo) / bins


def qb_histogram(scores: jax.Array, bias: jax.Array, top_k: int,
                 mask: Optional[jax.Array] = None, *, bins: int, cutoff: str = "token",
                 axis_name=None) -> tuple[jax.Array, jax.Array]:
  """Per-expert histograms of the QB deficits r_ij = bar_ij − s_ij of the valid tokens.

  bar_ij is the biased score expert j must beat to enter token i's top-k (`qb_bars`; K3's cutoff
  c_i for cutoff='token'), so expert j is chosen exactly when r_ij < b_j. (The margins of
  `k3jax.layers.moe.quantile_balance_update` are M_ij = b_j − r_ij.) The bins are those of
  `qb_histogram_range(bias, bins)`, so the counts of any split of the tokens (micro-batches,
  devices) sum to those of all tokens at once, exactly: each token's bins depend on its own scores
  and on the bias only.

  Args:
    scores: [tokens, E] router scores (sigmoid outputs; the local shard inside `shard_map`).
    bias: [E] the bias the tokens were routed with (replicated).
    top_k: k.
    mask: optional [tokens] bool, False for padding.
    bins: histogram bins per expert (>= 2).
    cutoff: 'token' or 'per_expert' (`qb_bars`).
    axis_name: mesh axis name(s) the tokens are sharded over inside `shard_map`, whose counts are
      summed; None when `scores` holds every token (under jit with sharded inputs XLA sums them).
  Returns:
    (counts int32 [E, bins], number of valid tokens int32 []).
  """
  fn = "qb_histogram"
  valid = _check_qb_args(fn, scores, bias, top_k, bins, mask)
  n = scores.shape[1]
  s = scores.astype(jnp.float32)
  b = bias.astype(jnp.float32)
  deficit = qb_bars(s + b, top_k, cutoff) - s                                 # [tokens, E]
  lo, width = qb_histogram_range(b, bins)
  index = jnp.clip(jnp.floor((deficit - lo) / width), 0, bins - 1).astype(jnp.int32)
  flat = jnp.arange(n, dtype=jnp.int32)[None, :] * bins + index
  # Padding goes to an index past the end, which the scatter drops.
  flat = jnp.where(valid[:, None], flat, n * bins).reshape(-1)
  counts = jnp.zeros((n * bins,), jnp.int32).at[flat].add(1, mode="drop").reshape(n, bins)
  tokens = jnp.sum(valid, dtype=jnp.int32)
  if axis_name is not None:
    counts, tokens = jax.lax.psum((counts, tokens), axis_name)
  return counts, tokens


def qb_histogram_quantiles(counts: jax.Array, tokens: jax.Array, bias: jax.Array,
                           top_k: int) -> jax.Array:
  """Per expert, the value v_j below which q = m·k/E of its deficits lie (m = tokens), read from
  `qb_histogram`'s counts with the deficits taken as uniform inside each bin. Routing with bias v
  gives each expert q of these tokens (with the bars held fixed). fp32 [E].

  counts: int32 [E, bins] over `qb_histogram_range(bias, bins)`; tokens: int32 [] (0 gives lo).
  """
  num_experts, bins = counts.shape
  lo, width = qb_histogram_range(bias, bins)
  q = tokens.astype(jnp.float32) * top_k / num_experts
  upto = jnp.cumsum(counts, axis=1)                              # deficits in bins <= β, exact
  # The bin where the count from below passes q (q < m: some bin does, unless m = 0).
  beta = jnp.minimum(jnp.sum(upto.astype(jnp.float32) <= q, axis=1), bins - 1)
  in_beta = jnp.arange(bins)[None, :] == beta[:, None]
  count = jnp.sum(jnp.where(in_beta, counts, 0), axis=1).astype(jnp.float32)
  below = jnp.sum(jnp.where(in_beta, upto - counts, 0), axis=1).astype(jnp.float32)
  frac = jnp.where(count > 0, (q - below) / jnp.maximum(count, 1.0), 0.0)
  return lo + (beta.astype(jnp.float32) + frac) * width


def qb_bias_from_histogram(counts: jax.Array, tokens: jax.Array, bias: jax.Array, top_k: int,
                           rate: float = 1.0) -> jax.Array:
  """The new QB bias from the histograms of one optimizer step (`qb_histogram`, with the counts of
  all its micro-batches and devices summed): b ← (1 − rate)·b + rate·v (`qb_histogram_quantiles`),
  then b ← b − mean(b). At rate 1 this is K3's b_j ← quantile_{k/E}(r_j) − mean. Unchanged when no
  token was valid. counts int32 [E, bins], tokens int32 [], bias [E] → fp32 [E]."""
  if isinstance(rate, numbers.Real) and not 0.0 < rate <= 1.0:
    raise ValueError(f"qb_bias_from_histogram: rate={rate} must be in (0, 1]")
  b = bias.astype(jnp.float32)
  target = qb_histogram_quantiles(counts, tokens, b, top_k)
  new_bias = (1.0 - rate) * b + rate * target
  new_bias = new_bias - jnp.mean(new_bias)
  return jnp.where(tokens > 0, new_bias, b)


def quantile_balance_update_histogram(scores: jax.Array, bias: jax.Array, top_k: int,
                                      mask: Optional[jax.Array] = None, axis_name=None,
                                      bins: int = 1000, rate: float = 1.0,
                                      cutoff: str = "token") -> jax.Array:
  """`k3jax.layers.moe.quantile_balance_update` of one batch, from histograms: `qb_histogram`
  then `qb_bias_from_histogram` (arguments as there). Each expert's one-shot target is within one
  bin width, (max b − min b + 2)/bins, of the exact quantile's when the two ranks it interpolates
  share a bin. Communication under `shard_map`: one [E, bins] int32 sum, independent of the token
  count."""
  if isinstance(rate, numbers.Real) and not 0.0 < rate <= 1.0:
    raise ValueError(f"quantile_balance_update_histogram: rate={rate} must be in (0, 1]")
  counts, tokens = qb_histogram(scores, bias, top_k, mask, bins=bins, cutoff=cutoff,
                                axis_name=axis_name)
  return qb_bias_from_histogram(counts, tokens, bias, top_k, rate)
