"""The variants of KDA (`ModelConfig.kda_variant`, docs/architecture.md §1.9), in plain JAX.

Gated DeltaNet (`chunk_gdn`) is KDA with one decay per head: its gate [.., H] is broadcast over K
and runs through `chunk_kda`, Pallas kernels included. Gated linear attention (`recurrent_gla`,
`chunk_gla`) drops the delta rule: step 2 of KDA's recurrence (`k3jax.ops.kda`) becomes
S ← S + k_t v_tᵀ and there is no β. It shares KDA's packing and gate (`k3jax.ops.kda_inputs`) and
intra-chunk decays (`k3jax.ops.kda_chunk_xla`; its chunked form is KDA's without the WY solve) and
has no Pallas kernel.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from k3jax.ops.kda import (_check_chunk_options, _check_gate, _chunked_over_slices,
                           _recurrent_kda_impl, chunk_kda, recurrent_kda)
from k3jax.ops.kda_chunk_xla import _chunk_kda_xla
from k3jax.ops.kda_inputs import _prepare, kda_gate
from k3jax.parallel import context


def gdn_gate(x: jax.Array, A_log: Optional[jax.Array], dt_bias: Optional[jax.Array] = None,
             lower_bound: Optional[float] = -5.0) -> jax.Array:
  """Per-head log decay of Gated DeltaNet: `kda_gate` with one channel per head.

  Args:
    x: [..., H] gate pre-activation, any float dtype.
    A_log: [H] per-head log rate, or None.
    dt_bias: [H], or None (zero).
    lower_bound: in [-5, 0), or None for the unbounded form.

  Returns:
    g: [..., H] float32.
  """
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have shape [..., H], got shape {x.shape}")
  return kda_gate(x[..., None], A_log, dt_bias, lower_bound=lower_bound)[..., 0]


def _gdn_decay(q: jax.Array, g: jax.Array, dt_bias: Optional[jax.Array], where: str):
  """(g [B, T, H] broadcast to [B, T, H, K], dt_bias [H] repeated to [H*K] or None)."""
  q, g = jnp.asarray(q), jnp.asarray(g)
  if q.ndim != 4:
    raise ValueError(f"{where}: q must have shape [B,T,H,K], got shape {q.shape}")
  if g.shape != q.shape[:3]:
    raise ValueError(f"{where}: g must have shape [B,T,H] = {q.shape[:3]} (one decay per head), "
                     f"got {g.shape}")
  num_heads, head_dim = q.shape[2:]
  if dt_bias is not None:
    dt_bias = jnp.asarray(dt_bias)
    if dt_bias.shape != (num_heads,):
      raise ValueError(f"{where}: dt_bias must have shape [H] = ({num_heads},), got "
                       f"{dt_bias.shape}")
    # Constant over K: kda_gate on the broadcast input is then gdn_gate broadcast, channel by
    # channel, and autodiff sums the K copies' gradients back into the head's.
    dt_bias = jnp.repeat(dt_bias, head_dim)
  return jnp.broadcast_to(g[..., None], g.shape + (head_dim,)), dt_bias


def recurrent_gdn(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                  **options):
  """Token-by-token Gated DeltaNet: `recurrent_kda` with the per-head log decay g [B, T, H]
  broadcast over K. Every other argument and the result are `recurrent_kda`'s."""
  g, _ = _gdn_decay(q, g, None, "recurrent_gdn")
  return recurrent_kda(q, k, v, g, beta, **options)


def chunk_gdn(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
              A_log: Optional[jax.Array] = None, dt_bias: Optional[jax.Array] = None,
              lower_bound: Optional[float] = None, **options):
  """Chunked Gated DeltaNet: `chunk_kda` with one log decay per head, broadcast over K.

  The state update is KDA's with diag(exp g_t) = exp(g_t)·I, so the KDA op computes it exactly,
  on either backend (the Pallas kernels included, context parallelism too).

  Args:
    q, k, v, beta: as `chunk_kda`.
    g: [B, T, H] log decay (≤ 0), or with A_log the gate's raw input, whose decay is then
      `gdn_gate(g, A_log, dt_bias, lower_bound)` (fused into the kernels as KDA's gate is: the
      per-channel gate of an input and a bias constant over K).
    A_log: [H] fp32, or None.
    dt_bias: [H] fp32 gate bias, or None (zero); only with A_log.
    lower_bound: as `chunk_kda`'s; only with A_log.
    **options: the other keyword arguments of `chunk_kda`.

  Returns:
    (o [B, T, H, V], final state or None), as `chunk_kda`.
  """
  g, dt_bias = _gdn_decay(q, g, dt_bias, "chunk_gdn")
  return chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                   **options)


def recurrent_gla(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, *,
                  scale: Optional[float] = None, initial_state: Optional[jax.Array] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[jax.Array] = None,
                  segment_ids: Optional[jax.Array] = None):
  """Token-by-token gated linear attention with `lax.scan`, all math in float32: the ground truth
  for `chunk_gla`.

  Per head and token: S ← diag(exp g_t)·S + k_t v_tᵀ, o_t = Sᵀ(scale·q_t): KDA's recurrence
  without the delta rule (no β, no correction of what the state predicts for k_t). Arguments,
  packing and results are `recurrent_kda`'s, less beta.
  """
  (q, k, v, g, _, initial_state, segment_ids), (B, T, H, K, V, num_seqs) = _prepare(
      q, k, v, g, None, scale, initial_state, cu_seqlens, segment_ids)
  scale = K ** -0.5 if scale is None else float(scale)
  return _recurrent_kda_impl(q, k, v, g, None, scale, initial_state, output_final_state,
                             cu_seqlens, segment_ids, False)


def chunk_gla(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, *,
              scale: Optional[float] = None, initial_state: Optional[jax.Array] = None,
              output_final_state: bool = False, use_qk_l2norm: bool = False,
              cu_seqlens: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
              chunk_size: int = 64, backend: str = "auto", A_log: Optional[jax.Array] = None,
              dt_bias: Optional[jax.Array] = None, lower_bound: Optional[float] = None,
              qkv_zero_at_padding: bool = False):
  """Chunked gated linear attention (per-channel decay, no delta rule) in plain JAX, fp32.

  Per chunk, with S_0 the state entering it and G the in-document cumulative log decay:
  O = (s Q ⊙ e^G) S_0 + P V and S_C = diag(e^{G_C}) S_0 + (K ⊙ e^{G_C − G})ᵀ V, where P is KDA's
  decayed query-key score matrix (`_intra_chunk_scores`: every decay a one-signed sum, exact for
  any g ≤ 0). Differentiable by autodiff.

  Args: those of `chunk_kda`, less beta (the fused gate A_log, dt_bias, lower_bound is KDA's
  per-channel gate). backend: 'xla' or 'auto' run this code; 'pallas' raises ValueError, since
  the KDA kernels always apply the delta rule and GLA has no kernel of its own.

  Returns:
    (o [B, T, H, V] in v.dtype, final state float32 or None), as `chunk_kda`.
  """
  _check_chunk_options("chunk_gla", backend, chunk_size, A_log, dt_bias, lower_bound)
  if backend == "pallas":
    raise ValueError("chunk_gla: backend='pallas' is not available for gated linear attention: "
                     "the Pallas KDA kernels always apply the delta rule, and GLA has no kernel "
                     "of its own; use backend='xla' or 'auto' (ImplConfig.kda_backend)")
  if context.context_slices() > 1:
    # The state after a slice is affine in the state entering it (S_out = diag(e^G)·S_in + S_ext),
    # so KDA's state passing applies unchanged.
    return _chunked_over_slices(
        "chunk_gla", lambda q, k, v, g, beta, **kw: chunk_gla(q, k, v, g, **kw),  # beta: None
        q, k, v, g, None, segment_ids=segment_ids, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, A_log=A_log,
        dt_bias=dt_bias, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
        backend=backend, lower_bound=lower_bound, qkv_zero_at_padding=qkv_zero_at_padding)
  (q, k, v, g, _, initial_state, segment_ids), (B, T, H, K, V, num_seqs) = _prepare(
      q, k, v, g, None, scale, initial_state, cu_seqlens, segment_ids)
  _check_gate(g, A_log, dt_bias, lower_bound)
  scale = K ** -0.5 if scale is None else float(scale)
  if A_log is not None:
    g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
  return _chunk_kda_xla(q, k, v, g, None, scale, initial_state, output_final_state,
                        use_qk_l2norm, cu_seqlens, segment_ids, chunk_size,
                        bool(qkv_zero_at_padding), False)
