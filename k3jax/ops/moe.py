"""Routed-expert compute on one device: dispatch by expert, grouped SiTU-GLU, combine.

Every token i has k assignments (expert_idx[i, j], expert_weight[i, j]). Assignment a = i·k + j is
the row of the flattened [N·k] arrays. The routed output is

    y_i = Σ_j expert_weight[i, j] · E_{expert_idx[i, j]}(z_i),
    E_e(z) = W_out[e] · SiTU-GLU(z W_gate[e], z W_up[e])

Two ways to compute it, both pure and with static shapes:

* dropless (capacity_factor == 0): stable-sort the assignments by expert, gather their rows of z and
  run three grouped matmuls with the per-expert group sizes (`k3jax.ops.grouped_matmul`: tokamax's
  Mosaic GPU kernels on the GPU, tiled matmuls on CPU, `jax.lax.ragged_dot` on TPU). Nothing is
  dropped.
* capacity (capacity_factor > 0): each expert gets a fixed buffer of C = ceil(capacity_factor·N·k/E)
  rows ([E, C, ℓ], batched einsum). The sort is stable, so within an expert the assignments are
  ordered by token index (then by slot j) and the first C are kept: the *latest* tokens of the batch
  overflow. Dropped assignments contribute zero; the other assignments keep their weights (no
  renormalisation), as in GShard/Switch.

Assignments of invalid tokens (`valid` False, e.g. padding) are never computed and never counted:
they sort after every expert's group, their output rows are zero, and they take no capacity.

Gradients flow to z, the expert weights and expert_weight (the router); the integer routing is
non-differentiable by construction. Every row movement (dispatch, capacity buffers) is a
`gather_rows` and the unsort with the weighted sum one `weighted_combine`; their VJPs are gathers
with the inverse index map, and the group sizes and inverse permutation come from comparisons and
a second sort: neither pass has a scatter. (Those row movements live in `k3jax.ops.moe_rows`.)
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from k3jax.ops.grouped_matmul import RaggedDotFn, takes_zero_outside
from k3jax.ops.moe_rows import (gather_rows, sort_with_inverse, sorted_group_sizes,
                                weighted_combine, zero_rows)
from k3jax.ops.situ_glu import situ_glu
from pallas_kernels import situ_glu as situ_glu_kernels

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
                     group_sizes: jax.Array, in_group: jax.Array, *, beta1: Optional[float],
                     beta2: Optional[float], ragged_dot_fn: RaggedDotFn, activation: str = "xla") -> jax.Array:
  """SiTU-GLU experts over rows sorted by expert: W_out[e]·SiTU-GLU(x W_gate[e], x W_up[e]).

  x [M, ℓ] (the matmuls run in x.dtype, accumulating in fp32; gate and up are rounded to x.dtype
  before the fp32 activation math, as in `situ_glu_ffn`); w_gate, w_up [E, ℓ, f];
  w_out [E, f, ℓ] (already in x.dtype); group_sizes [E]; in_group [M] bool, False for the rows
  past the last group. Returns [M, ℓ] in x.dtype (accumulated in fp32 inside the matmul), zero on
  rows outside the groups (which ragged_dot leaves undefined on some backends). The gradient of x
  on those rows is zero too, except with activation 'pallas' on a grouped matmul that takes
  `zero_outside` (tokamax's): then it is undefined, and the callers (`routed_experts`, the
  expert-parallel body) read it only through `gather_rows`' selects.
  activation: 'xla' (`situ_glu`, XLA's fusions) or 'pallas' (`pallas_kernels.situ_glu.
    situ_glu_fused`: one kernel forward and one backward; interpreted on CPU): the same math.
  """
  # gate and up leave the matmul in x.dtype (fp32 accumulation inside), as in the dense SiTU-GLU:
  # situ_glu's backward then keeps two bf16 [M, f] arrays, not fp32 ones. They are one grouped
  # matmul against [E, ℓ, 2f]: one kernel (and one backward pair) instead of two, twice as wide.
  f = w_gate.shape[-1]
  # The Pallas activation gives h = 0 and d gate_up = 0 on the rows past the groups whatever
  # gate_up and dh hold there, so the grouped matmuls that can leave those rows unwritten skip
  # their selects: over gate_up [M, 2f] (3.6 ms of medium.gin's step on an H200, RESULTS.md run
  # 24 (e)) and dh [M, f]. The other rows they leave: dx's, which the dispatch's backward reads
  # through selects only (`gather_rows`); y's, zeroed below.
  skip_zeroing = activation == "pallas" and takes_zero_outside(ragged_dot_fn)
  unzeroed = {"zero_outside": False} if skip_zeroing else {}
  gate_up = ragged_dot_fn(x, jnp.concatenate([w_gate, w_up], axis=-1), group_sizes,
                          preferred_element_type=x.dtype, **unzeroed)
  if activation == "pallas":
    interpret = jax.default_backend() == "cpu"
    if interpret and jax.typeof(gate_up).manual_axis_type.varying:
      # JAX's Pallas interpreter slices with unvarying indices, which shard_map's varying-axes
      # check refuses; the compiled kernel (GPU) has no such slices.
      raise ValueError("ImplConfig.moe_situ_glu = 'pallas' on CPU runs the Pallas interpreter, "
                       "which cannot run inside the expert-parallel shard_map (a mesh with "
                       "'expert' > 1); use 'auto' or 'xla' on CPU")
    config = situ_glu_kernels.SituGluConfig(interpret=interpret)
    h = situ_glu_kernels.situ_glu_fused(gate_up, beta1, beta2, x.dtype, config,
                                        num_rows=jnp.sum(group_sizes))
  elif activation == "xla":
    h = situ_glu(gate_up[:, :f], gate_up[:, f:], beta1, beta2).astype(x.dtype)
  else:
    raise ValueError(f"grouped_situ_glu: activation={activation!r}: expected 'xla' or 'pallas'")
  # The expert outputs leave the matmul in x.dtype too: the combine sums them in fp32, but an fp32
  # [M, ℓ] output doubled the kernel's writes and what the backward keeps (the expert-parallel path
  # always sent them in x.dtype).
  y = ragged_dot_fn(h, w_out, group_sizes, preferred_element_type=x.dtype, **unzeroed)
  return zero_rows(y, in_group)


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
    beta1: Optional[float],
    beta2: Optional[float],
    capacity_factor: float = 0.0,
    valid: Optional[jax.Array] = None,
    ragged_dot_fn: RaggedDotFn = jax.lax.ragged_dot,
    activation: str = "xla",
) -> tuple[jax.Array, dict]:
  """Weighted sum of each token's k SiTU-GLU experts.

  Args:
    z: [N, ℓ] token activations (the matmul inputs run in z.dtype).
    expert_idx: [N, k] int, expert ids in [0, E).
    expert_weight: [N, k] float, combine weights (usually the renormalised router scores).
    w_gate: [E, ℓ, m] gate projections.
    w_up: [E, ℓ, m] up projections.
    w_out: [E, m, ℓ] output projections. Weights are cast to z.dtype.
    beta1, beta2: SiTU-GLU bounds (both None: SwiGLU).
    capacity_factor: 0 for dropless; > 0 for fixed per-expert buffers of
      ceil(capacity_factor·N·k/E) rows (N is the static row count, padding included).
    valid: optional [N] bool; False rows (padding) are not routed, not computed and not counted.
    ragged_dot_fn: grouped matmul with `jax.lax.ragged_dot`'s signature (a hook for a faster GPU
      kernel); used only in dropless mode.
    activation: the dropless experts' SiTU-GLU, 'xla' or 'pallas' (`grouped_situ_glu`).
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
  order, inverse = sort_with_inverse(sort_key)
  sorted_expert = sort_key[order]
  routed = sorted_expert < num_experts
  group_sizes = sorted_group_sizes(sorted_expert, num_experts)
  # Every permutation below is a `gather_rows` whose backward is a gather (with the inverse map):
  # autodiff's transpose of a gather is a scatter-add, slow on the GPU.
  # Row a of the sorted assignments reads token token_of[order[a]]; token i's k rows are
  # inverse[i·k:(i+1)·k] (invalid assignments are zero rows that nothing reads back).
  token_rows = inverse.reshape(n, k)
  token_rows_ok = valid_assign.reshape(n, k)
  x_sorted = gather_rows(z, token_of[order], routed, token_rows, token_rows_ok)   # [N·k, ℓ]

  if capacity_factor == 0:
    y_sorted = grouped_situ_glu(x_sorted, w_gate, w_up, w_out, group_sizes, routed, beta1=beta1,
                                beta2=beta2, ragged_dot_fn=ragged_dot_fn, activation=activation)
    dropped = jnp.zeros((), jnp.int32)
  else:
    capacity = expert_capacity(n, k, num_experts, capacity_factor)
    starts = jnp.cumsum(group_sizes) - group_sizes                      # [E]
    starts_ext = jnp.concatenate([starts, jnp.zeros((1,), jnp.int32)])
    rank = jnp.arange(num_assign, dtype=jnp.int32) - starts_ext[sorted_expert]
    kept = routed & (rank < capacity)
    # Buffer row e·C + c holds sorted assignment starts[e] + c when that slot is filled; kept
    # assignment a sits in buffer row e_a·C + rank_a. Both directions are gathers.
    slot = jnp.arange(capacity, dtype=jnp.int32)
    src = jnp.clip(starts[:, None] + slot[None, :], 0, num_assign - 1).reshape(-1)   # [E·C]
    filled = (slot[None, :] < jnp.minimum(group_sizes, capacity)[:, None]).reshape(-1)
    e_safe = jnp.minimum(sorted_expert, num_experts - 1)
    buf_row = (e_safe * capacity + jnp.clip(rank, 0, capacity - 1))[:, None]     # [N·k, 1]
    buf = gather_rows(x_sorted, src, filled, buf_row, kept[:, None])
    buf = buf.reshape(num_experts, capacity, latent)                    # [E, C, ℓ]
    gate = jnp.einsum("ecl,elm->ecm", buf, w_gate, preferred_element_type=jnp.float32)
    up = jnp.einsum("ecl,elm->ecm", buf, w_up, preferred_element_type=jnp.float32)
    h = situ_glu(gate, up, beta1, beta2).astype(dtype)
    y_buf = jnp.einsum("ecm,eml->ecl", h, w_out, preferred_element_type=jnp.float32)
    y_sorted = gather_rows(y_buf.reshape(num_experts * capacity, latent), buf_row[:, 0], kept,
                           src[:, None], filled[:, None])
    dropped = jnp.sum(routed & ~kept).astype(jnp.int32)

  # Token i's k outputs sit in rows inverse[i·k:(i+1)·k]; row r belongs to assignment order[r].
  y = weighted_combine(y_sorted, token_rows, token_rows_ok, expert_weight, order, routed, dtype)
  stats = {"load": group_sizes.astype(jnp.float32), "dropped": dropped}
  return y, stats


QB_CUTOFFS = ("per_expert", "token")


def qb_bars(biased: jax.Array, top_k: int, cutoff: str) -> jax.Array:
  """Quantile Balancing bars of biased scores [tokens, experts]: the biased score bar_ij that expert
  j must beat to be in token i's top-k.

  cutoff='token' (K3's definition): bar_ij = the token's (k+1)-th largest biased score for every
  expert; returned as [tokens, 1]. cutoff='per_expert': that bar for the experts the token chose,
  and its k-th largest for the others, i.e. exactly the score each expert must beat to enter the
  token's top-k (an outsider must displace the weakest chosen expert); [tokens, experts]. fp32.
  """
  if cutoff not in QB_CUTOFFS:
    raise ValueError(f"cutoff={cutoff!r} must be one of {QB_CUTOFFS}")
  biased = biased.astype(jnp.float32)
  # Masked reductions instead of slicing columns k-1 and k: XLA:CPU turns a sliced top_k into a full
  # sort (20x slower).
  top = jax.lax.top_k(biased, top_k + 1)[0]                             # [tokens, k+1] descending
  bar = jnp.min(top, axis=-1, keepdims=True)                            # (k+1)-th largest
  if cutoff == "per_expert":
    kth = jnp.min(jnp.where(jnp.arange(top_k + 1) < top_k, top, jnp.inf), axis=-1, keepdims=True)
    bar = jnp.where(biased >= kth, bar, kth)
  return bar


def qb_margins(biased: jax.Array, top_k: int, cutoff: str) -> jax.Array:
  """Quantile Balancing margins M_ij = (s_ij + b_j) − bar_ij (`qb_bars`) for biased scores
  [tokens, experts]: expert j is in token i's top-k exactly when M_ij > 0. Returns fp32
  [tokens, experts]."""
  biased = biased.astype(jnp.float32)
  return biased - qb_bars(biased, top_k, cutoff)
