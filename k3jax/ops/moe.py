"""Routed-expert compute on one device: dispatch by expert, grouped SiTU-GLU, combine.

This module also holds the SiTU-GLU activation math (`situ`, `softcap`, `situ_glu`), because ops may
not import layers; `k3jax.layers.ffn` re-exports and documents it.

Every token i has k assignments (expert_idx[i, j], expert_weight[i, j]). Assignment a = i·k + j is
the row of the flattened [N·k] arrays. The routed output is

    y_i = Σ_j expert_weight[i, j] · E_{expert_idx[i, j]}(z_i),
    E_e(z) = W_out[e] · SiTU-GLU(z W_gate[e], z W_up[e])

Two ways to compute it, both pure and with static shapes:

* dropless (capacity_factor == 0): stable-sort the assignments by expert, gather their rows of z and
  run three grouped matmuls with the per-expert group sizes (`tiled_ragged_dot`, or
  `jax.lax.ragged_dot` on TPU: `default_ragged_dot`). Nothing is dropped.
* capacity (capacity_factor > 0): each expert gets a fixed buffer of C = ceil(capacity_factor·N·k/E)
  rows ([E, C, ℓ], batched einsum). The sort is stable, so within an expert the assignments are
  ordered by token index (then by slot j) and the first C are kept: the *latest* tokens of the batch
  overflow. Dropped assignments contribute zero; the other assignments keep their weights (no
  renormalisation), as in GShard/Switch.

Assignments of invalid tokens (`valid` False, e.g. padding) are never computed and never counted:
they sort after every expert's group, their output rows are zero, and they take no capacity.

Gradients flow to z, the expert weights and expert_weight (the router); the integer routing is
non-differentiable by construction.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

RaggedDotFn = Callable[..., jax.Array]


def tiled_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                     preferred_element_type=None, *, tile: int = 128,
                     tiles_per_step: int = 64) -> jax.Array:
  """`jax.lax.ragged_dot(lhs, rhs, group_sizes)` as dense matmuls over row tiles.

  lhs [M, ℓ]: rows contiguous by group (group e owns the next group_sizes[e] rows; rows past
  Σ group_sizes give zeros); rhs [E, ℓ, f]; group_sizes [E] int. Returns [M, f] in
  preferred_element_type (default lhs.dtype).

  Why: XLA:GPU (jax 0.11) lowers ragged_dot densely, every row against every group, which for a
  MoE layer costs E× the FLOPs and memory (small.gin at 64K tokens/step asked one H200 for
  ~190 GiB). Here each group is padded to a multiple of `tile` rows, so every tile of the padded
  buffer belongs to one group; a `lax.scan` over steps of `tiles_per_step` tiles gathers those
  tiles' weights and runs one batched matmul ('tml,tlf->tmf'). The step is rematerialised, so
  neither pass keeps gathered weights beyond one step ([tiles_per_step, ℓ, f]); the weight
  gradient accumulates in the scan carry. FLOPs: the real rows plus at most E·tile padding rows
  and the unused tiles of the last used step; steps past the used tiles are skipped. Static
  shapes: tiles = ceil(M/tile) + E, rounded up to a multiple of tiles_per_step.
  """
  M, L = lhs.shape
  E, L2, F = rhs.shape
  if L2 != L or group_sizes.shape != (E,):
    raise ValueError(f"tiled_ragged_dot: lhs {lhs.shape}, rhs {rhs.shape} and group_sizes "
                     f"{group_sizes.shape} do not fit ([M, l], [E, l, f], [E])")
  out_dtype = lhs.dtype if preferred_element_type is None else preferred_element_type
  num_tiles = -(-M // tile) + E
  per_step = max(1, min(tiles_per_step, num_tiles))
  steps = -(-num_tiles // per_step)
  num_tiles = steps * per_step
  sizes = group_sizes.astype(jnp.int32)
  padded = (sizes + tile - 1) // tile * tile
  ends, padded_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
  starts, padded_starts = ends - sizes, padded_ends - padded
  row = jnp.arange(M, dtype=jnp.int32)
  group = jnp.searchsorted(ends, row, side="right")                    # E for rows past the groups
  real = group < E
  g = jnp.minimum(group, E - 1)
  dest = jnp.where(real, padded_starts[g] + row - starts[g], num_tiles * tile)  # out of range: drop
  buf = jnp.zeros((num_tiles * tile, L), lhs.dtype).at[dest].set(lhs, mode="drop")
  tile_group = jnp.searchsorted(padded_ends, jnp.arange(num_tiles, dtype=jnp.int32) * tile,
                                side="right")
  tile_group = jnp.minimum(tile_group, E - 1).reshape(steps, per_step)  # unused tiles: zero rows
  used_rows = padded_ends[-1]

  @jax.checkpoint
  def step(carry, xs):
    x, tg, first_row = xs                                              # [per_step, tile, ℓ]
    # Steps wholly past the used tiles (e.g. the empty half of a dropless expert-parallel receive
    # buffer) skip the matmul.
    y = jax.lax.cond(
        first_row < used_rows,
        lambda: jnp.einsum("tml,tlf->tmf", x, rhs[tg], preferred_element_type=out_dtype),
        # (zeros shaped from x, so that inside shard_map they carry x's varying mesh axes)
        lambda: jnp.broadcast_to(jnp.zeros_like(x[..., :1], out_dtype), (per_step, tile, F)))
    return carry, y

  first_rows = jnp.arange(steps, dtype=jnp.int32) * (per_step * tile)
  _, out = jax.lax.scan(step, None,
                        (buf.reshape(steps, per_step, tile, L), tile_group, first_rows))
  y = out.reshape(num_tiles * tile, F).at[dest].get(mode="fill", fill_value=0)
  return jnp.where(real[:, None], y, 0).astype(out_dtype)


def default_ragged_dot(kind: str = "auto") -> RaggedDotFn:
  """The grouped matmul for ModelConfig.moe_grouped_matmul: 'ragged_dot' (jax.lax.ragged_dot),
  'tiled' (`tiled_ragged_dot`), or 'auto' = 'tiled' on GPU and CPU, 'ragged_dot' on TPU.

  XLA:GPU and XLA:CPU both lower ragged_dot with memory for every row against every expert: the
  compiled training step of a 4-layer small.gin at 16K tokens asks XLA:CPU for 55.6 GiB of
  temporaries with ragged_dot and 22.5 GiB tiled, at the same speed for tiny.gin on CPU (GPU:
  experiments/benchmarks/RESULTS.md). TPU has a grouped-matmul lowering of its own (not
  measured here)."""
  if kind == "auto":
    kind = "ragged_dot" if jax.default_backend() == "tpu" else "tiled"
  if kind == "tiled":
    return tiled_ragged_dot
  if kind == "ragged_dot":
    return jax.lax.ragged_dot
  raise ValueError(f"moe_grouped_matmul = {kind!r}: expected 'auto', 'ragged_dot' or 'tiled'")


# SiTU-GLU math (re-exported by k3jax.layers.ffn, which documents it).

def situ(a: jax.Array, beta1: float = 4.0) -> jax.Array:
  """SiTU(a) = β1·tanh(a/β1)·sigmoid(a), computed in fp32; returns fp32 with a's shape."""
  a32 = a.astype(jnp.float32)
  return beta1 * jnp.tanh(a32 / beta1) * jax.nn.sigmoid(a32)


def softcap(b: jax.Array, beta2: float = 25.0) -> jax.Array:
  """softcap(b) = β2·tanh(b/β2), computed in fp32; returns fp32 with b's shape."""
  b32 = b.astype(jnp.float32)
  return beta2 * jnp.tanh(b32 / beta2)


def situ_glu(gate: jax.Array, up: jax.Array, beta1: float = 4.0, beta2: float = 25.0) -> jax.Array:
  """The SiTU-GLU hidden activation h = SiTU(gate) ⊙ softcap(up).

  Args:
    gate: [..., m] pre-activation W_gate x, any float dtype.
    up: [..., m] pre-activation W_up x, same shape as gate.
    beta1: SiTU bound (> 0).
    beta2: softcap bound (> 0).
  Returns:
    h [..., m] in the promoted dtype of (gate, up); the math runs in fp32.
  """
  if gate.shape != up.shape:
    raise ValueError(f"situ_glu: gate shape {gate.shape} and up shape {up.shape} must be equal")
  if beta1 <= 0 or beta2 <= 0:
    raise ValueError(f"situ_glu: beta1={beta1} and beta2={beta2} must both be > 0")
  out_dtype = jnp.result_type(gate.dtype, up.dtype)
  return (situ(gate, beta1) * softcap(up, beta2)).astype(out_dtype)


def _check_shapes(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid) -> None:
  if z.ndim != 2:
    raise ValueError(f"routed_experts: z must be [N, latent], got shape {z.shape}")
  n, latent = z.shape
  if expert_idx.ndim != 2 or expert_idx.shape[0] != n:
    raise ValueError(f"routed_experts: expert_idx must be [N={n}, k], got shape {expert_idx.shape}")
  if expert_weight.shape != expert_idx.shape:
    raise ValueError(f"routed_experts: expert_weight shape {expert_weight.shape} must equal "
                     f"expert_idx shape {expert_idx.shape}")
  if not jnp.issubdtype(expert_idx.dtype, jnp.integer):
    raise ValueError(f"routed_experts: expert_idx must be an integer array, got {expert_idx.dtype}")
  if w_gate.ndim != 3 or w_gate.shape[1] != latent:
    raise ValueError(f"routed_experts: w_gate must be [E, latent={latent}, m], got {w_gate.shape}")
  num_experts, _, hidden = w_gate.shape
  if w_up.shape != w_gate.shape:
    raise ValueError(f"routed_experts: w_up shape {w_up.shape} must equal w_gate shape "
                     f"{w_gate.shape}")
  if w_out.shape != (num_experts, hidden, latent):
    raise ValueError(f"routed_experts: w_out must be [E={num_experts}, m={hidden}, "
                     f"latent={latent}], got {w_out.shape}")
  if valid is not None and valid.shape != (n,):
    raise ValueError(f"routed_experts: valid must be [N={n}] bool, got shape {valid.shape}")


def grouped_situ_glu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_out: jax.Array,
                     group_sizes: jax.Array, in_group: jax.Array, *, beta1: float, beta2: float,
                     ragged_dot_fn: RaggedDotFn) -> jax.Array:
  """SiTU-GLU experts over rows sorted by expert: W_out[e]·SiTU-GLU(x W_gate[e], x W_up[e]).

  x [M, ℓ] (the matmuls run in x.dtype, accumulating in fp32); w_gate, w_up [E, ℓ, f];
  w_out [E, f, ℓ] (already in x.dtype); group_sizes [E]; in_group [M] bool, False for the rows
  past the last group. Returns fp32 [M, ℓ], zero on rows outside the groups (which ragged_dot
  leaves undefined on some backends).
  """
  gate = ragged_dot_fn(x, w_gate, group_sizes, preferred_element_type=jnp.float32)
  up = ragged_dot_fn(x, w_up, group_sizes, preferred_element_type=jnp.float32)
  h = situ_glu(gate, up, beta1, beta2).astype(x.dtype)
  y = ragged_dot_fn(h, w_out, group_sizes, preferred_element_type=jnp.float32)
  return jnp.where(in_group[:, None], y, 0.0)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """Per-expert buffer rows C = ceil(capacity_factor · num_tokens · top_k / num_experts)."""
  if capacity_factor <= 0:
    raise ValueError(f"expert_capacity: capacity_factor={capacity_factor} must be > 0")
  return int(math.ceil(capacity_factor * num_tokens * top_k / num_experts))


def routed_experts(
    z: jax.Array,
    expert_idx: jax.Array,
    expert_weight: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_out: jax.Array,
    *,
    beta1: float,
    beta2: float,
    capacity_factor: float = 0.0,
    valid: Optional[jax.Array] = None,
    ragged_dot_fn: RaggedDotFn = jax.lax.ragged_dot,
) -> tuple[jax.Array, dict]:
  """Weighted sum of each token's k SiTU-GLU experts.

  Args:
    z: [N, ℓ] token activations (the matmul inputs run in z.dtype).
    expert_idx: [N, k] int, expert ids in [0, E).
    expert_weight: [N, k] float, combine weights (usually the renormalised router scores).
    w_gate: [E, ℓ, m] gate projections.
    w_up: [E, ℓ, m] up projections.
    w_out: [E, m, ℓ] output projections. Weights are cast to z.dtype.
    beta1, beta2: SiTU-GLU bounds.
    capacity_factor: 0 for dropless; > 0 for fixed per-expert buffers of
      ceil(capacity_factor·N·k/E) rows (N is the static row count, padding included).
    valid: optional [N] bool; False rows (padding) are not routed, not computed and not counted.
    ragged_dot_fn: grouped matmul with `jax.lax.ragged_dot`'s signature (a hook for a faster GPU
      kernel); used only in dropless mode.
  Returns:
    y: [N, ℓ] in z.dtype (combine done in fp32).
    stats: {'load': [E] fp32, assignments routed to each expert (valid tokens, before any drop);
            'dropped': int32 scalar, assignments of valid tokens dropped by capacity (0 if
            dropless)}.
  """
  _check_shapes(z, expert_idx, expert_weight, w_gate, w_up, w_out, valid)
  if capacity_factor < 0:
    raise ValueError(f"routed_experts: capacity_factor={capacity_factor} must be >= 0 "
                     "(0 = dropless)")
  n, latent = z.shape
  k = expert_idx.shape[1]
  num_experts = w_gate.shape[0]
  num_assign = n * k
  dtype = z.dtype
  w_gate, w_up, w_out = (w.astype(dtype) for w in (w_gate, w_up, w_out))

  flat_expert = expert_idx.reshape(num_assign).astype(jnp.int32)
  token_of = jnp.arange(num_assign, dtype=jnp.int32) // k
  if valid is None:
    valid_assign = jnp.ones((num_assign,), bool)
  else:
    valid_assign = jnp.repeat(valid.astype(bool), k)
  # Invalid assignments get the sentinel expert id E, so they sort after every real group.
  sort_key = jnp.where(valid_assign, flat_expert, num_experts)
  order = jnp.argsort(sort_key, stable=True)
  sorted_expert = sort_key[order]
  routed = sorted_expert < num_experts
  group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[sort_key].add(1)[:num_experts]
  x_sorted = z[token_of[order]]                                         # [N·k, ℓ]

  if capacity_factor == 0:
    y_sorted = grouped_situ_glu(x_sorted, w_gate, w_up, w_out, group_sizes, routed, beta1=beta1,
                                beta2=beta2, ragged_dot_fn=ragged_dot_fn)
    dropped = jnp.zeros((), jnp.int32)
  else:
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    starts = jnp.cumsum(group_sizes) - group_sizes                      # [E]
    starts_ext = jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])
    rank = jnp.arange(num_assign, dtype=jnp.int32) - starts_ext[sorted_expert]
    kept = routed & (rank < capacity)
    # Fill the [E, C] buffers by gathering (not scattering): the backward pass is a gather too.
    slot = jnp.arange(capacity, dtype=jnp.int32)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, num_assign - 1)   # [E, C]
    filled = slot[None, :] < jnp.minimum(group_sizes, capacity)[:, None]
    buf = jnp.where(filled[..., None], x_sorted[src], 0).astype(dtype)  # [E, C, ℓ]
    gate = jnp.einsum("ecl,elm->ecm", buf, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("ecl,elm->ecm", buf, w_up, preferred_element_type=jnp.float32)
    h = situ_glu(gate, up, beta1, beta2).astype(dtype)
    y_buf = jnp.einsum("ecm,eml->ecl", h, w_out, preferred_element_type=jnp.float32)
    e_safe = jnp.minimum(sorted_expert, num_experts - 1)
    r_safe = jnp.clip(rank, 0, capacity - 1)
    y_sorted = jnp.where(kept[:, None], y_buf[e_safe, r_safe], 0.0)
    dropped = jnp.sum(routed & ~kept).astype(jnp.int32)

  inverse = jnp.zeros((num_assign,), jnp.int32).at[order].set(
      jnp.arange(num_assign, dtype=jnp.int32))
  y_assign = y_sorted[inverse].reshape(n, k, latent)
  y = jnp.einsum("nkl,nk->nl", y_assign, expert_weight.astype(jnp.float32))
  stats = {"load": group_sizes.astype(jnp.float32), "dropped": dropped}
  return y.astype(dtype), stats


QB_CUTOFFS = ("per_expert", "token")


def qb_margins(biased: jax.Array, top_k: int, cutoff: str) -> jax.Array:
  """Quantile Balancing margins M_ij = (s_ij + b_j) − bar_ij for biased scores [tokens, experts].

  cutoff='token' (the spec's wording): bar_ij = the token's (k+1)-th largest biased score for every
  expert. cutoff='per_expert': that bar for the experts the token chose, and its k-th largest for
  the others, i.e. exactly the score each expert must beat to enter the token's top-k (an outsider
  must displace the weakest chosen expert). Returns fp32 [tokens, experts].
  """
  if cutoff not in QB_CUTOFFS:
    raise ValueError(f"cutoff={cutoff!r} must be one of {QB_CUTOFFS}")
  # Masked reductions instead of slicing columns k-1 and k: XLA:CPU turns a sliced top_k into a full
  # sort (20x slower).
  top = jax.lax.top_k(biased, top_k + 1)[0]                             # [tokens, k+1] descending
  bar = jnp.min(top, axis=-1, keepdims=True)                            # (k+1)-th largest
  if cutoff == "per_expert":
    kth = jnp.min(jnp.where(jnp.arange(top_k + 1) < top_k, top, jnp.inf), axis=-1, keepdims=True)
    bar = jnp.where(biased >= kth, bar, kth)
  return biased - bar
