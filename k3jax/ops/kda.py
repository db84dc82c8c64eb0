"""Kimi Delta Attention (KDA): gate, step-by-step reference and chunked (WY) algorithm in plain JAX.

Per head, for each token t (docs/architecture.md §1), with state S [K, V] in fp32:

  1. S ← diag(exp(g_t)) · S
  2. S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ
  3. o_t = Sᵀ (scale · q_t)

Layouts follow fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] fp32.

Packing. `cu_seqlens` ([N+1] offsets, B == 1) and `segment_ids` ([B, T], 0 = padding) both reset the
state at document boundaries; both go through one mechanism: every token gets a *run label* (the
document it belongs to, forward-filled over padding), and the state carried along a row is tagged with
the label of its document. A token whose label differs from the carried one starts from its document's
initial state instead (zeros, or `initial_state[n]` for sequence n with `cu_seqlens`). Padding tokens
act as the identity (no decay, no write) and output zeros. Segment ids are read as runs: the state
resets whenever the id differs from that of the previous non-padding token.

Variants (`ModelConfig.kda_variant`, docs/architecture.md §1.9). Gated DeltaNet (`chunk_gdn`) is
KDA with one decay per head: its gate [.., H] is broadcast over K and runs through `chunk_kda`,
Pallas kernels included. Gated linear attention (`recurrent_gla`, `chunk_gla`) drops the delta
rule: step 2 becomes S ← S + k_t v_tᵀ and there is no β. It shares this module's packing, gate
and intra-chunk decays (its chunked form is KDA's without the WY solve) and has no Pallas kernel.

Gates. `g` is the log decay (≤ 0). The chunked path never forms exp(G_i)·exp(−G_j) over a chunk: it uses
the masked pairwise exp(G_i − G_j) on same-document causal pairs only, with G_i − G_j summed directly
from the g between the two tokens, so every exponent is ≤ 0, nothing cancels, and any gate (the bounded
one of `kda_gate`, the unbounded softplus form, raw values far below −5) is exact. Memory is O(T·C·K) per
head for those decays (and C³·K flops per chunk for the sums); this is the reference, not the fast path
(the Pallas kernel in `pallas_kernels.kda` is).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.parallel import context, sharding

_HIGHEST = jax.lax.Precision.HIGHEST
_BACKENDS = ("auto", "xla", "pallas")


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


# --------------------------------------------------------------------------------------------------
# Recurrent reference.
# --------------------------------------------------------------------------------------------------


def recurrent_kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                  scale: Optional[float] = None, initial_state: Optional[jax.Array] = None,
                  output_final_state: bool = False, cu_seqlens: Optional[jax.Array] = None,
                  segment_ids: Optional[jax.Array] = None):
  """Token-by-token KDA with `lax.scan`, all math in float32: the ground truth for `chunk_kda`.

  Args:
    q, k: [B, T, H, K] (used as given: normalise them beforehand if wanted).
    v: [B, T, H, V].
    g: [B, T, H, K] log decay.
    beta: [B, T, H].
    scale: query scale, default K^-1/2.
    initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens), any float dtype, used in float32.
    output_final_state: whether to return the final state.
    cu_seqlens: [N+1] int offsets of packed sequences (B must be 1); may be traced.
    segment_ids: [B, T] int, 0 = padding.

  Returns:
    (o [B, T, H, V] in v.dtype, final state float32 [B, H, K, V] ([N, H, K, V] with cu_seqlens) or
    None).
  """
  _require_beta(beta, "recurrent_kda")
  (q, k, v, g, beta, initial_state, segment_ids), (B, T, H, K, V, num_seqs) = _prepare(
      q, k, v, g, beta, scale, initial_state, cu_seqlens, segment_ids)
  scale = K ** -0.5 if scale is None else float(scale)
  return _recurrent_kda_impl(q, k, v, g, beta, scale, initial_state, output_final_state,
                             cu_seqlens, segment_ids, True)


def _require_beta(beta, where: str) -> None:
  if beta is None:
    raise ValueError(f"{where}: beta is required (the delta rule's write strength, [B, T, H]); "
                     "gated linear attention without it is recurrent_gla / chunk_gla")


def _recurrent_kda_impl(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        segment_ids, delta_rule):
  """`recurrent_kda` (delta_rule True) or `recurrent_gla` (False, beta None) after validation;
  scale is a Python float."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  num_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
  f32 = jnp.float32
  labels, real, init_label = _run_labels(B, T, cu_seqlens, segment_ids)
  packed = cu_seqlens is not None
  h0 = None if initial_state is None else initial_state.astype(f32)

  def step(carry, xs):
    state, label, finals = carry
    q_t, k_t, v_t, g_t, b_t, label_t, real_t = xs
    if packed and h0 is not None:
      fresh = h0[jnp.maximum(label_t - 1, 0)]  # B == 1
      fresh = jnp.where((label_t > 0)[:, None, None, None], fresh, 0.0)
    else:
      fresh = jnp.zeros_like(state)
    new_doc = (label_t != label)[:, None, None, None]
    s = jnp.where(new_doc, fresh, state)
    s = jnp.exp(g_t)[..., None] * s
    if delta_rule:
      pred = jnp.einsum("bhk,bhkv->bhv", k_t, s, precision=_HIGHEST)
      s = s + b_t[..., None, None] * k_t[..., None] * (v_t - pred)[..., None, :]
    else:
      s = s + k_t[..., None] * v_t[..., None, :]
    o_t = jnp.einsum("bhk,bhkv->bhv", q_t * scale, s, precision=_HIGHEST)
    keep = real_t[:, None, None, None]
    s = jnp.where(keep, s, state)
    o_t = jnp.where(real_t[:, None, None], o_t, 0.0)
    label = jnp.where(real_t, label_t, label)
    if packed:
      hit = (jnp.arange(num_seqs) == label_t[0] - 1) & real_t[0]
      finals = jnp.where(hit[:, None, None, None], s[0][None], finals)
    return (s, label, finals), o_t

  if packed:
    state0 = jnp.zeros((B, H, K, V), f32)
    finals0 = jnp.zeros((num_seqs, H, K, V), f32) if h0 is None else h0
  else:
    state0 = jnp.zeros((B, H, K, V), f32) if h0 is None else h0
    finals0 = jnp.zeros((), f32)
  label0 = jnp.full((B,), init_label, jnp.int32)
  to_time_major = lambda x: jnp.moveaxis(jnp.asarray(x).astype(f32), 1, 0)
  xs = (to_time_major(q), to_time_major(k), to_time_major(v), to_time_major(g),
        to_time_major(beta) if delta_rule else None, jnp.moveaxis(labels, 1, 0),
        jnp.moveaxis(real, 1, 0))
  (state, _, finals), o = jax.lax.scan(step, (state0, label0, finals0), xs)
  o = jnp.moveaxis(o, 0, 1).astype(v.dtype)
  if not output_final_state:
    return o, None
  return o, (finals if packed else state)


_recurrent_kda_impl = jax.jit(_recurrent_kda_impl, static_argnums=(5, 7, 10))

# --------------------------------------------------------------------------------------------------
# Chunked (WY) algorithm.
# --------------------------------------------------------------------------------------------------


def _load_pallas_chunk_kda():
  try:
    from pallas_kernels.kda import chunk_kda as pallas_chunk_kda  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("backend='pallas' needs `pallas_kernels.kda.chunk_kda`, which could not be "
                      f"imported ({e}); use backend='xla' or 'auto'") from e
  return pallas_chunk_kda


def _chunked_over_slices(name: str, op: Callable, q, k, v, g, beta, *, segment_ids,
                         initial_state, output_final_state: bool, cu_seqlens, A_log, dt_bias,
                         **options):
  """`op` (chunk_kda, or chunk_gla taking a `beta` it ignores) on a row split over the mesh's
  context axis: each slice runs `op` on its tokens with `options`, and the slices pass their
  states (`k3jax.parallel.context.kda_over_slices`). Returns (o, None). Raises ValueError for
  the options it cannot take: their states belong to one device's whole row."""
  if initial_state is not None or output_final_state or cu_seqlens is not None:
    raise ValueError(f"{name} under context parallelism (a mesh with a context axis) takes "
                     "neither initial_state, output_final_state nor cu_seqlens: those are for "
                     "decoding and packed single rows; use segment_ids")

  def one_slice(a_log, dt_b, q, k, v, g, beta, h0, seg):
    return op(q, k, v, g, beta, initial_state=h0, output_final_state=True, segment_ids=seg,
              A_log=a_log, dt_bias=dt_b, **options)
  return context.kda_over_slices(one_slice, q, k, v, g, beta, segment_ids,
                                 shared=(A_log, dt_bias)), None


def chunk_kda(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
              scale: Optional[float] = None, initial_state: Optional[jax.Array] = None,
              output_final_state: bool = False, use_qk_l2norm: bool = False,
              cu_seqlens: Optional[jax.Array] = None, segment_ids: Optional[jax.Array] = None,
              chunk_size: int = 64, backend: str = "auto", A_log: Optional[jax.Array] = None,
              dt_bias: Optional[jax.Array] = None, lower_bound: Optional[float] = None,
              qkv_zero_at_padding: bool = False):
  """Chunked KDA (WY representation), differentiable by JAX autodiff on the XLA backend.

  Args:
    q, k: [B, T, H, K], any float dtype.
    v: [B, T, H, V].
    g: [B, T, H, K] log decay, ≤ 0, as `kda_gate` makes it (bounded or not: the XLA path is exact
      for unbounded gates too). g > 0 would make the state grow without bound; a concrete g with a
      positive entry raises ValueError. Under jit g is a tracer and is not checked (a check would
      need a host round trip per call): a caller passing its own traced g must keep it ≤ 0.
    beta: [B, T, H].
    scale: query scale, default K^-1/2.
    initial_state: [B, H, K, V] ([N, H, K, V] with cu_seqlens), used in float32. With segment_ids it
      applies to the first document of each row; with cu_seqlens, entry n to sequence n.
    output_final_state: whether to return the final state.
    use_qk_l2norm: L2-normalise q and k over K (fp32, eps 1e-6) first.
    cu_seqlens: [N+1] int offsets of packed sequences, B must be 1; may be traced (N is static).
      Tokens at or beyond cu_seqlens[-1] are padding.
    segment_ids: [B, T] int, 0 = padding; the state resets when the id changes.
    chunk_size: C, a positive multiple of 16. Any T works (padded internally).
    backend: "xla" (this code), "pallas" (`pallas_kernels.kda.chunk_kda`) or "auto" (pallas on GPU
      when that package imports, else xla).
    A_log: [H] fp32, or None. Given, the gate is fused: g is the gate's raw input x (any float
      dtype) and the log decay is `kda_gate(x, A_log, dt_bias, lower_bound)`, computed inside the
      Pallas kernels (one static kernel variant for a bounded gate, and no [B, T, H, K] fp32 decay
      written, read back or saved for the backward) or, on the XLA backend, by `kda_gate` first.
      None: g is the log decay itself, and the Pallas path checks at run time whether it is
      bounded (both kernel variants compiled).
    dt_bias: [H*K] gate bias, or None (zero); only with A_log.
    lower_bound: in [-5, 0) for the bounded gate, None for the unbounded one; only with A_log.
    qkv_zero_at_padding: the caller's q, k and v are already zero at padding tokens (segment id
      0; the KDA layer's short convolutions make them so): padding is then made the identity by
      its gate and beta alone, without masking q, k and v again (on the GPU, one pass over three
      [B, T, H, K] arrays forward and their gradients backward). The gradients reaching q, k and
      v at padding tokens are then the kernels' (not zeroed), which a caller that produced zeros
      there discards. False masks them. Only meaningful with segment_ids or cu_seqlens.

  Returns:
    o: [B, T, H, V] in v.dtype (zeros at padding tokens).
    final_state: float32 [B, H, K, V] — the state at the end of each row (its last document) — or,
      with cu_seqlens, [N, H, K, V], the state at each sequence's last token (the initial state, or
      zeros, for an empty sequence); None unless output_final_state.
  """
  _require_beta(beta, "chunk_kda")
  _check_chunk_options("chunk_kda", backend, chunk_size, A_log, dt_bias, lower_bound)
  if context.context_slices() > 1:
    # The row is split over the mesh's context axis: each slice runs this op on its tokens and
    # the slices pass their states (k3jax.parallel.context).
    return _chunked_over_slices(
        "chunk_kda", chunk_kda, q, k, v, g, beta, segment_ids=segment_ids,
        initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, scale=scale,
        use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size, backend=backend,
        lower_bound=lower_bound, qkv_zero_at_padding=qkv_zero_at_padding)
  (q, k, v, g, beta, initial_state, segment_ids), (B, T, H, K, V, num_seqs) = _prepare(
      q, k, v, g, beta, scale, initial_state, cu_seqlens, segment_ids)
  fused = A_log is not None
  _check_gate(g, A_log, dt_bias, lower_bound)

  if backend == "pallas" or (backend == "auto" and jax.default_backend() == "gpu"):
    try:
      pallas_chunk_kda = _load_pallas_chunk_kda()
    except ImportError:
      if backend == "pallas":
        raise
      pallas_chunk_kda = None
    if pallas_chunk_kda is not None:
      a32 = dt32 = None
      if fused:
        a32 = jnp.asarray(A_log, jnp.float32)
        dt32 = None if dt_bias is None else jnp.asarray(dt_bias, jnp.float32)

      def run(a32, dt32, q, k, v, g, beta, initial_state, segment_ids, cu_seqlens=None):
        gate = dict(A_log=a32, lower_bound=lower_bound, dt_bias=dt32) if fused else {}
        return pallas_chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state,
                                use_qk_l2norm=use_qk_l2norm, cu_seqlens=cu_seqlens,
                                segment_ids=segment_ids, chunk_size=chunk_size,
                                qkv_zero_at_padding=qkv_zero_at_padding, **gate)
      if cu_seqlens is not None:  # one packed row: nothing to split over devices
        return run(a32, dt32, q, k, v, g, beta, initial_state, segment_ids, cu_seqlens)
      # The kernel is opaque to XLA's partitioner: under a mesh, each device runs its own rows
      # (the gate's parameters shared, their gradients summed over devices).
      return sharding.map_over_batch_shards(run, q, k, v, g, beta, initial_state, segment_ids,
                                            shared=(a32, dt32))

  scale = K ** -0.5 if scale is None else float(scale)
  if fused:
    g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
  return _chunk_kda_xla(q, k, v, g, beta, scale, initial_state, output_final_state,
                        use_qk_l2norm, cu_seqlens, segment_ids, chunk_size,
                        bool(qkv_zero_at_padding))


def _check_chunk_options(where, backend, chunk_size, A_log, dt_bias, lower_bound) -> None:
  """The checks of the chunked ops' options that need no array."""
  if backend not in _BACKENDS:
    raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0 \
      or chunk_size % 16:
    raise ValueError(f"chunk_size must be a positive multiple of 16, got {chunk_size!r}")
  if A_log is None and (dt_bias is not None or lower_bound is not None):
    raise ValueError(f"{where}: dt_bias and lower_bound belong to the fused gate: pass A_log too "
                     "(or pass the log decay kda_gate(...) as g, without them)")


def _check_gate(g, A_log, dt_bias, lower_bound) -> None:
  """The fused gate's parameters (A_log given), or a concrete log decay g that never grows."""
  if A_log is not None:
    # kda_gate's checks of A_log, dt_bias and lower_bound, for both backends, without tracing it.
    jax.eval_shape(functools.partial(kda_gate, lower_bound=lower_bound), g, A_log, dt_bias)
  elif not isinstance(g, jax.core.Tracer):
    # numpy, not jnp: a concrete g closed over by a jit would otherwise give a traced maximum.
    g_max = float(np.max(np.asarray(g))) if g.size else 0.0
    if g_max > 0:
      raise ValueError(f"g must be a log decay <= 0 (kda_gate's output); its largest entry is "
                       f"{g_max}, a growth of the state")


def _chunk_kda_xla(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                   cu_seqlens, segment_ids, chunk_size, qkv_zero_at_padding=False,
                   delta_rule=True):
  """`chunk_kda` on the XLA backend, after validation; scale is a Python float.

  delta_rule False is `chunk_gla` (beta None): no WY solve, the pseudo-values are the values
  themselves (Δ = V in docs/architecture.md §1.4's notation), and only the query-key scores are
  formed.
  """
  B, T, H, K = q.shape
  V = v.shape[-1]
  num_seqs = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
  f32 = jnp.float32
  out_dtype = v.dtype
  C = chunk_size
  num_chunks = max(1, math.ceil(T / C))
  T_pad = num_chunks * C
  packed = cu_seqlens is not None
  h0 = None if initial_state is None else initial_state.astype(f32)

  labels, real, init_label = _run_labels(B, T, cu_seqlens, segment_ids)
  if use_qk_l2norm:
    q, k = l2_normalize(q), l2_normalize(k)
  q = q.astype(f32) * scale
  k, v, g = k.astype(f32), v.astype(f32), g.astype(f32)
  # Padding tokens are the identity: no decay, no write, no read.
  m = real[..., None, None]
  g = jnp.where(m, g, 0.0)
  if not qkv_zero_at_padding:
    q, k = jnp.where(m, q, 0.0), jnp.where(m, k, 0.0)
  if delta_rule:
    beta = jnp.where(real[..., None], beta.astype(f32), 0.0)
  else:
    # Without β, a padding token's write k vᵀ is silenced by its key alone: zero it whatever the
    # caller promised (qkv_zero_at_padding), so that padding stays the identity.
    k = jnp.where(m, k, 0.0)

  pad = T_pad - T
  if pad:
    labels = jnp.concatenate([labels, jnp.broadcast_to(labels[:, -1:], (B, pad))], axis=1)
    zeros_like_pad = lambda x: None if x is None else jnp.pad(
        x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, g, beta = (zeros_like_pad(x) for x in (q, k, v, g, beta))

  # [B, T, H, X] -> [B, H, NC, C, X]
  def to_chunks(x):
    x = x.reshape((B, num_chunks, C) + x.shape[2:])
    return jnp.moveaxis(x, 3, 1)

  qc, kc, vc, gc = to_chunks(q), to_chunks(k), to_chunks(v), to_chunks(g)
  if delta_rule:
    bc = jnp.moveaxis(beta.reshape(B, num_chunks, C, H), 3, 1)        # [B, H, NC, C]
  lab = labels.reshape(B, num_chunks, C)                                # [B, NC, C]
  # Label of the state carried into each chunk: that of the previous chunk's last token.
  lab_in = jnp.concatenate([jnp.full((B, 1), init_label, jnp.int32), lab[:, :-1, -1]], axis=1)

  same_doc = lab[..., :, None] == lab[..., None, :]                     # [B, NC, C, C]
  causal = jnp.tril(jnp.ones((C, C), bool))
  pair_incl = (same_doc & causal)[:, None]                              # [B, 1, NC, C, C]
  pair_strict = (same_doc & jnp.tril(jnp.ones((C, C), bool), -1))[:, None]
  # Log decay accumulated since the start of the token's document inside the chunk (or the chunk's
  # start, for the document carried in): a cumsum that restarts at documents, as a masked sum.
  gs = jnp.einsum("bxnij,bhnjk->bhnik", pair_incl.astype(f32), gc,
                  precision=_HIGHEST)                                   # [B, H, NC, C, K]
  if delta_rule:
    a_qk, a_kk = _intra_chunk_scores(qc, kc, gc, pair_incl, pair_strict)
    lower = jnp.where(pair_strict, bc[..., :, None] * a_kk, 0.0)
    # (I + L)^{-1} diag(β) applied to exp(G)·k and to v: the WY factors w and u.
    inverse = _unit_lower_inverse(lower)
    solve = lambda rhs: jnp.einsum("...ij,...jx->...ix", inverse, rhs, precision=_HIGHEST)
    w = solve(bc[..., None] * jnp.exp(gs) * kc)                         # [B, H, NC, C, K]
    u = solve(bc[..., None] * vc)                                       # [B, H, NC, C, V]
  else:
    # GLA: each token writes k vᵀ as it is; there is nothing to solve, and w is never read.
    a_qk = _intra_chunk_scores(qc, kc, gc, pair_incl, pair_strict, with_kk=False)
    w, u = None, vc
  qg = qc * jnp.exp(gs)

  # Decay from each token to the chunk's end, for the chunk's last document only (the one whose
  # state is carried on).
  g_last = gs[..., -1, :]                                               # [B, H, NC, K]
  # Σ_{j<t≤C} g_t summed directly (one sign, so accurate for any gate), for the last document only.
  to_end = jnp.einsum("jt,bhntk->bhnjk", jnp.asarray(np.triu(np.ones((C, C), np.float32), 1)), gc,
                      precision=_HIGHEST)
  last_doc = pair_incl[..., -1, :, None]                                # [B, 1, NC, C, 1]
  k_to_end = jnp.where(last_doc, jnp.exp(jnp.where(last_doc, to_end, 0.0)), 0.0) * kc
  continues = lab == lab_in[..., None]                                  # [B, NC, C]
  last_continues = continues[..., -1]                                   # [B, NC]

  gather_h0 = packed and h0 is not None

  def fresh_state(label):
    """Initial state of documents with `label` [B, ...] (only with cu_seqlens and initial_state)."""
    st = h0[jnp.maximum(label - 1, 0)]
    return jnp.where((label > 0)[..., None, None, None], st, 0.0)

  def chunk_step(state, xs):
    a_qk_c, w_c, u_c, qg_c, kend_c, glast_c, cont_c, lastcont_c, lab_c = xs
    cont4 = cont_c[:, None, :, None]
    q_s = jnp.einsum("bhck,bhkv->bhcv", qg_c, state, precision=_HIGHEST)
    if gather_h0:
      fresh = jnp.moveaxis(fresh_state(lab_c), 1, 2)                    # [B, H, C, K, V]
      q_f = jnp.einsum("bhck,bhckv->bhcv", qg_c, fresh, precision=_HIGHEST)
      last_fresh = fresh_state(lab_c[:, -1])
    else:
      q_f = last_fresh = 0.0
    if delta_rule:
      w_s = jnp.einsum("bhck,bhkv->bhcv", w_c, state, precision=_HIGHEST)
      w_f = (jnp.einsum("bhck,bhckv->bhcv", w_c, fresh, precision=_HIGHEST) if gather_h0
             else 0.0)
      v_new = u_c - jnp.where(cont4, w_s, w_f)
    else:
      v_new = u_c
    o_c = jnp.where(cont4, q_s, q_f) + jnp.einsum("bhij,bhjv->bhiv", a_qk_c, v_new,
                                                  precision=_HIGHEST)
    start = jnp.where(lastcont_c[:, None, None, None], state, last_fresh)
    new_state = jnp.exp(glast_c)[..., None] * start + jnp.einsum(
        "bhck,bhcv->bhkv", kend_c, v_new, precision=_HIGHEST)
    return new_state, (o_c, v_new, state)

  if gather_h0:
    # The gathered per-token initial states are [C, K, V] per chunk: recompute them in the backward
    # pass instead of storing them for every chunk.
    chunk_step = jax.checkpoint(chunk_step)

  chunk_major = lambda x, axis: None if x is None else jnp.moveaxis(x, axis, 0)
  xs = (chunk_major(a_qk, 2), chunk_major(w, 2), chunk_major(u, 2), chunk_major(qg, 2),
        chunk_major(k_to_end, 2), chunk_major(g_last, 2), chunk_major(continues, 1),
        chunk_major(last_continues, 1), chunk_major(lab, 1))
  if packed or h0 is None:
    state0 = jnp.zeros((B, H, K, V), f32)
  else:
    state0 = h0
  final_state, (o, v_new, states_in) = jax.lax.scan(chunk_step, state0, xs)
  # o: [NC, B, H, C, V] -> [B, T, H, V]
  o = jnp.moveaxis(o, 0, 2).reshape(B, H, T_pad, V)
  o = jnp.moveaxis(o, 1, 2)[:, :T].astype(out_dtype)
  if not output_final_state:
    return o, None
  if not packed:
    return o, final_state
  return o, _packed_final_states(cu_seqlens, num_seqs, C, T_pad, h0, kc, gc, gs, lab, lab_in,
                                 v_new, states_in)


_chunk_kda_xla = jax.jit(_chunk_kda_xla, static_argnums=(5, 7, 8, 11, 12, 13))


def _packed_final_states(cu_seqlens, num_seqs, C, T_pad, h0, kc, gc, gs, lab, lab_in, v_new,
                         states_in):
  """State at each packed sequence's last token, from the states entering each chunk.

  Sequence n ends at token e = cu[n+1] − 1 in chunk c = e // C; its state there is the decayed start
  state of the sequence in that chunk plus the writes of its tokens in c up to e. Shapes: kc, gc
  (raw log decays), gs (in-document cumsum) [1, H, NC, C, K]; lab [1, NC, C]; lab_in [1, NC];
  v_new [NC, 1, H, C, V]; states_in [NC, 1, H, K, V].
  Returns [N, H, K, V] float32.
  """
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  seq_label = jnp.arange(1, num_seqs + 1, dtype=jnp.int32)
  end = jnp.clip(cu[1:] - 1, 0, T_pad - 1)
  empty = cu[1:] <= cu[:-1]
  chunk, pos = end // C, end % C                                        # [N]
  k_n = jnp.moveaxis(kc[0][:, chunk], 1, 0)                             # [N, H, C, K]
  g_n = jnp.moveaxis(gc[0][:, chunk], 1, 0)                             # [N, H, C, K]
  vnew_n = v_new[chunk, 0]                                              # [N, H, C, V]
  g_end = jnp.moveaxis(gs[0][:, chunk, pos], 1, 0)                      # [N, H, K]
  # Decay from token j to e: Σ_{j<t≤e} g_t summed directly, for tokens j ≤ e of sequence n.
  idx = jnp.arange(C)
  between = (idx[None, :, None] < idx[None, None, :]) & (idx[None, None, :] <= pos[:, None, None])
  to_end = jnp.einsum("njt,nhtk->nhjk", between.astype(jnp.float32), g_n, precision=_HIGHEST)
  mine = ((lab[0, chunk] == seq_label[:, None]) & (idx[None, :] <= pos[:, None]))[:, None, :, None]
  k_to_end = jnp.where(mine, jnp.exp(jnp.where(mine, to_end, 0.0)), 0.0) * k_n   # [N, H, C, K]
  fresh = jnp.zeros_like(states_in[0, 0])[None] if h0 is None else h0   # [N or 1, H, K, V]
  carried = lab_in[0, chunk] == seq_label
  start = jnp.where(carried[:, None, None, None], states_in[chunk, 0], fresh)
  state = jnp.exp(g_end)[..., None] * start + jnp.einsum(
      "nhck,nhcv->nhkv", k_to_end, vnew_n, precision=_HIGHEST)
  return jnp.where(empty[:, None, None, None], jnp.broadcast_to(fresh, state.shape), state)


_SUB = 16  # sub-tile of the intra-chunk decays


def _unit_lower_inverse(lower: jax.Array) -> jax.Array:
  """(I + L)^{-1} for strictly lower-triangular L [..., C, C] (C a multiple of 16), matmuls only.

  Forward substitution on the 16×16 diagonal blocks (a 16-step loop over rows, all blocks at
  once), then block forward substitution between blocks: X_ab = −X_aa · Σ_{b≤c<a} L_ac X_cb. This is the blocked form fla
  uses; power-series shortcuts like Π(I + (−L)^{2^i}) overflow once the chunk's keys align (the
  powers of L grow combinatorially before they vanish). It also keeps XLA:CPU off its LAPACK
  triangular solve, whose gradient hung with jax 0.10.2.
  """
  C = lower.shape[-1]
  S = _SUB
  n = C // S
  blk = lambda a, b: lower[..., a * S:(a + 1) * S, b * S:(b + 1) * S]
  # All n diagonal blocks at once, one row per loop iteration: a rolled loop keeps the HLO (and the
  # compile time of its gradient) small; rows not yet computed are zero, so the full-row product
  # only sees the rows above.
  l_diag = jnp.stack([blk(a, a) for a in range(n)], axis=-3)            # [..., n, S, S]
  eye = jnp.eye(S, dtype=lower.dtype)

  def substitute_row(i, inv):
    l_row = jax.lax.dynamic_index_in_dim(l_diag, i, axis=-2, keepdims=False)     # [..., n, S]
    row = jax.lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=False) - jnp.einsum(
        "...j,...jk->...k", l_row, inv, precision=_HIGHEST)
    return jax.lax.dynamic_update_index_in_dim(inv, row, i, axis=-2)

  inv_diag = jax.lax.fori_loop(0, S, substitute_row, jnp.zeros_like(l_diag))
  diag_inv = [inv_diag[..., a, :, :] for a in range(n)]
  x = {}
  for b in range(n):
    x[(b, b)] = diag_inv[b]
    for a in range(b + 1, n):
      acc = sum(jnp.einsum("...ij,...jk->...ik", blk(a, c), x[(c, b)], precision=_HIGHEST)
                for c in range(b, a))
      x[(a, b)] = -jnp.einsum("...ij,...jk->...ik", diag_inv[a], acc, precision=_HIGHEST)
  zero = jnp.zeros(lower.shape[:-2] + (S, S), lower.dtype)
  return jnp.concatenate([jnp.concatenate([x.get((a, b), zero) for b in range(n)], axis=-1)
                          for a in range(n)], axis=-2)


def _intra_chunk_scores(qc, kc, gc, pair_incl, pair_strict, with_kk=True):
  """The chunk's decayed score matrices, exact for any gate g ≤ 0 and O(C²·K) per chunk.

  a_qk[i, j] = Σ_d q_id k_jd exp(G_id − G_jd) over same-document pairs j ≤ i, and a_kk the same
  with k for q over j < i. The log decay G_i − G_j = Σ_{j<t≤i} g_t is split at 16-token sub-tiles:
  for j in an earlier sub-tile, (sum from the query tile's start to i) + (whole tiles in between) +
  (sum from j+1 to the end of j's tile); all three are sums of one sign, so nothing cancels, each
  factor is ≤ 1, and the product is a plain matmul of q·exp(·) with k·exp(·). Pairs inside one
  sub-tile sum their 16-token stretch directly. Shapes: qc, kc, gc [B, H, NC, C, K];
  pair_incl / pair_strict [B, 1, NC, C, C] bool. Returns two [B, H, NC, C, C] float32 arrays, or
  a_qk alone with `with_kk` False (GLA, which has no key-key system to solve).
  """
  B, H, NC, C, K = qc.shape
  S = _SUB
  n = C // S
  blocks = lambda x: x.reshape(B, H, NC, n, S, K)
  qb, kb, gb = blocks(qc), blocks(kc), blocks(gc)
  ones = np.ones((S, S), np.float32)
  prefix = jnp.einsum("st,zhcatk->zhcask", jnp.asarray(np.tril(ones)), gb, precision=_HIGHEST)
  suffix = jnp.einsum("st,zhcatk->zhcask", jnp.asarray(np.triu(ones, 1)), gb, precision=_HIGHEST)
  totals = jnp.sum(gb, axis=-2)                                          # [B, H, NC, n, K]
  nb = np.arange(n)
  strictly_between = ((nb[None, None, :] > nb[None, :, None]) &
                      (nb[None, None, :] < nb[:, None, None])).astype(np.float32)  # [a, b, c]
  gap = jnp.einsum("abx,zhcxk->zhcabk", jnp.asarray(strictly_between), totals, precision=_HIGHEST)
  earlier = jnp.asarray(nb[None, :] < nb[:, None])[:, :, None, None]     # [a, b, 1, 1]
  key_exp = jnp.where(earlier, gap[..., None, :] + suffix[:, :, :, None], 0.0)  # [B,H,NC,a,b,S,K]
  key_fac = jnp.where(earlier, jnp.exp(key_exp), 0.0) * kb[:, :, :, None]
  qexp, kexp = qb * jnp.exp(prefix), kb * jnp.exp(prefix)
  off_qk = jnp.einsum("zhcask,zhcabtk->zhcasbt", qexp, key_fac, precision=_HIGHEST)
  # Inside one sub-tile: Σ_{t<u≤s} g_u for t ≤ s, summed directly.
  si = np.arange(S)
  within = ((si[None, :, None] < si[None, None, :]) &
            (si[None, None, :] <= si[:, None, None])).astype(np.float32)  # [s, t, u]
  causal = jnp.asarray(np.tril(ones, 0) > 0)[..., None]
  diag_exp = jnp.einsum("stu,zhcauk->zhcastk", jnp.asarray(within), gb, precision=_HIGHEST)
  diag_dec = jnp.where(causal, jnp.exp(jnp.where(causal, diag_exp, 0.0)), 0.0)
  diag_qk = jnp.einsum("zhcask,zhcastk,zhcatk->zhcast", qb, diag_dec, kb, precision=_HIGHEST)
  same_tile = jnp.asarray(np.eye(n, dtype=bool))[:, None, :, None]       # [a, 1, b, 1]

  def assemble(off, diag):
    full = off + jnp.where(same_tile, diag[:, :, :, :, :, None, :], 0.0)  # [B,H,NC,a,s,b,t]
    return full.reshape(B, H, NC, C, C)

  a_qk = jnp.where(pair_incl, assemble(off_qk, diag_qk), 0.0)
  if not with_kk:
    return a_qk
  off_kk = jnp.einsum("zhcask,zhcabtk->zhcasbt", kexp, key_fac, precision=_HIGHEST)
  diag_kk = jnp.einsum("zhcask,zhcastk,zhcatk->zhcast", kb, diag_dec, kb, precision=_HIGHEST)
  a_kk = jnp.where(pair_strict, assemble(off_kk, diag_kk), 0.0)
  return a_qk, a_kk


# --------------------------------------------------------------------------------------------------
# Variants (ModelConfig.kda_variant): Gated DeltaNet and gated linear attention.
# --------------------------------------------------------------------------------------------------


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
