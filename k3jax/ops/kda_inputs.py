"""What the KDA ops do to their inputs before any recurrence: the gate (`kda_gate`), the q/k
normalisation (`l2_normalize`), the checks of shapes and dtypes, and the run labels of packing.

Shared by the reference and the chunked entry (`k3jax.ops.kda`), the chunked XLA algorithm
(`k3jax.ops.kda_chunk_xla`) and the variants (`k3jax.ops.kda_variants`), so it imports none of them.

Packing. `cu_seqlens` ([N+1] offsets, B == 1) and `segment_ids` ([B, T], 0 = padding) both reset the
state at document boundaries; both go through one mechanism: every token gets a *run label* (the
document it belongs to, forward-filled over padding), and the state carried along a row is tagged with
the label of its document. A token whose label differs from the carried one starts from its document's
initial state instead (zeros, or `initial_state[n]` for sequence n with `cu_seqlens`). Padding tokens
act as the identity (no decay, no write) and output zeros. Segment ids are read as runs: the state
resets whenever the id differs from that of the previous non-padding token.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


# --------------------------------------------------------------------------------------------------
# Gate and normalisation.
# --------------------------------------------------------------------------------------------------


def kda_gate(x: jax.Array, A_log: Optional[jax.Array], dt_bias: Optional[jax.Array] = None,
             lower_bound: Optional[float] = -5.0) -> jax.Array:
  """Per-channel log decay of KDA.

  Bounded (default): g = lower_bound · sigmoid(exp(A_log) · (x + dt_bias)), so g ∈ (lower_bound, 0).
  Unbounded (`lower_bound=None`, the original form): g = −exp(A_log) · softplus(x + dt_bias).

  Args:
    x: [..., H, K] gate pre-activation, any float dtype.
    A_log: [H] per-head log rate, or None (then exp(A_log) = 1).
    dt_bias: [H*K] per head and channel, or None (zero).
    lower_bound: in [-5, 0), or None for the unbounded form.

  Returns:
    g: [..., H, K] float32.
  """
  if lower_bound is not None:
    if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float)):
      raise ValueError(f"lower_bound must be a float in [-5, 0) or None, got {lower_bound!r}")
    if not -5.0 <= float(lower_bound) < 0.0:
      raise ValueError(f"lower_bound must lie in [-5, 0) (or be None for the unbounded gate), "
                       f"got {lower_bound}")
  x = jnp.asarray(x)
  if x.ndim < 2:
    raise ValueError(f"x must have shape [..., H, K], got shape {x.shape}")
  _check_float("x", x)
  num_heads, head_dim = x.shape[-2:]
  x = x.astype(jnp.float32)
  if dt_bias is not None:
    dt_bias = jnp.asarray(dt_bias)
    _check_float("dt_bias", dt_bias)
    if dt_bias.shape != (num_heads * head_dim,):
      raise ValueError(f"dt_bias must have shape [H*K] = ({num_heads * head_dim},), "
                       f"got {dt_bias.shape}")
    x = x + dt_bias.astype(jnp.float32).reshape(num_heads, head_dim)
  if A_log is None:
    rate = jnp.ones((num_heads, 1), jnp.float32)
  else:
    A_log = jnp.asarray(A_log)
    _check_float("A_log", A_log)
    if A_log.shape != (num_heads,):
      raise ValueError(f"A_log must have shape [H] = ({num_heads},), got {A_log.shape}")
    rate = jnp.exp(A_log.astype(jnp.float32))[:, None]
  if lower_bound is None:
    return -rate * jax.nn.softplus(x)
  return float(lower_bound) * jax.nn.sigmoid(rate * x)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(Σ x² + eps) over the last axis, computed and returned in float32."""
  x = jnp.asarray(x).astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


# --------------------------------------------------------------------------------------------------
# Validation and packing helpers.
# --------------------------------------------------------------------------------------------------


def _check_float(name: str, x: jax.Array) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, segment_ids):
  """Checks shapes/dtypes; returns (B, T, H, K, V, N or None)."""
  for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
    if x is not None or name != "beta":   # beta None: GLA, which has none
      _check_float(name, x)
  if q.ndim != 4:
    raise ValueError(f"q must have shape [B,T,H,K], got shape {q.shape}")
  B, T, H, K = q.shape
  if k.shape != q.shape:
    raise ValueError(f"k must have shape [B,T,H,K] = {q.shape}, got {k.shape}")
  if g.shape != q.shape:
    raise ValueError(f"g must have shape [B,T,H,K] = {q.shape}, got {g.shape}")
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"v must have shape [B,T,H,V] = ({B}, {T}, {H}, V), got {v.shape}")
  V = v.shape[3]
  if beta is not None and beta.shape != (B, T, H):
    raise ValueError(f"beta must have shape [B,T,H] = {(B, T, H)} (rank 3), got {beta.shape}")
  if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                            or not scale > 0):
    raise ValueError(f"scale must be a positive float or None, got {scale!r}")
  if cu_seqlens is not None and segment_ids is not None:
    raise ValueError("pass at most one of cu_seqlens and segment_ids")
  num_seqs = None
  if cu_seqlens is not None:
    cu_seqlens = jnp.asarray(cu_seqlens) if _is_concrete(cu_seqlens) else cu_seqlens
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens must have shape [N+1] with N >= 1, got {cu_seqlens.shape}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise ValueError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if B != 1:
      raise ValueError(f"cu_seqlens requires batch size B == 1 (packed sequences), got B = {B}")
    num_seqs = cu_seqlens.shape[0] - 1
    if _is_concrete(cu_seqlens):
      cu = np.asarray(cu_seqlens)
      if cu[0] < 0 or np.any(np.diff(cu) < 0) or cu[-1] > T:
        raise ValueError(f"cu_seqlens must be non-decreasing offsets in [0, T={T}], got {cu.tolist()}")
  if segment_ids is not None:
    if segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must have shape [B,T] = {(B, T)}, got {segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")
  if initial_state is not None:
    _check_float("initial_state", initial_state)
    lead, what = (num_seqs, "N") if num_seqs is not None else (B, "B")
    if initial_state.shape != (lead, H, K, V):
      raise ValueError(f"initial_state must have shape [{what},H,K,V] = {(lead, H, K, V)}, "
                       f"got {initial_state.shape}")
  return B, T, H, K, V, num_seqs


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, segment_ids):
  """The inputs as jax arrays, validated: ((q, k, v, g, beta, initial_state, segment_ids),
  (B, T, H, K, V, num_seqs))."""
  q, k, v, g = (jnp.asarray(x) for x in (q, k, v, g))
  beta = None if beta is None else jnp.asarray(beta)
  if initial_state is not None:
    initial_state = jnp.asarray(initial_state)
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
  dims = _validate(q, k, v, g, beta, scale, initial_state, cu_seqlens, segment_ids)
  return (q, k, v, g, beta, initial_state, segment_ids), dims


def _run_labels(B: int, T: int, cu_seqlens, segment_ids):
  """Per-token document labels (forward-filled over padding), real-token mask and the initial label.

  Returns:
    labels: [B, T] int32. With cu_seqlens, label n+1 is sequence n (0 before the first sequence);
      otherwise 1, 2, ... number the runs of equal segment id within each row, starting at 1.
    real: [B, T] bool, False at padding.
    init_label: int, the label the carried state has before the first token (the label that
      `initial_state` belongs to in segment-id / unpacked mode; 0 with cu_seqlens, which matches no
      sequence, so each sequence starts from its own initial state).
  """
  pos = jnp.arange(T, dtype=jnp.int32)
  if cu_seqlens is not None:
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    num_seqs = cu.shape[0] - 1
    seg = jnp.searchsorted(cu, pos, side="right").astype(jnp.int32)
    seg = jnp.where(seg > num_seqs, 0, seg)[None, :]
    real = seg > 0
    last_real = jax.lax.cummax(jnp.where(real, pos[None, :], -1), axis=1)
    labels = jnp.where(last_real >= 0,
                       jnp.take_along_axis(seg, jnp.maximum(last_real, 0), axis=1), 0)
    return labels, real, 0
  if segment_ids is None:
    return jnp.ones((B, T), jnp.int32), jnp.ones((B, T), bool), 1
  seg = jnp.asarray(segment_ids).astype(jnp.int32)
  real = seg > 0
  # The id of the last real token strictly before t; before any real token, the row's first id, so
  # that the first document continues the initial state.
  last_real = jax.lax.cummax(jnp.where(real, pos[None, :], -1), axis=1)
  prev_real = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), last_real[:, :-1]], axis=1)
  first_id = jnp.take_along_axis(seg, jnp.argmax(real, axis=1)[:, None], axis=1)
  prev_id = jnp.where(prev_real >= 0, jnp.take_along_axis(seg, jnp.maximum(prev_real, 0), axis=1),
                      first_id)
  starts = real & (seg != prev_id)
  labels = 1 + jnp.cumsum(starts.astype(jnp.int32), axis=1)
  return labels, real, 1
