"""Kimi Delta Attention (KDA): step-by-step reference and chunked entry in plain JAX.

Per head, for each token t (docs/architecture.md §1), with state S [K, V] in fp32:

  1. S ← diag(exp(g_t)) · S
  2. S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ
  3. o_t = Sᵀ (scale · q_t)

Layouts follow fla: q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; state [B, H, K, V] fp32.

`chunk_kda` picks the backend (the Pallas kernels of `pallas_kernels.kda` on a GPU, else the fp32
chunked algorithm of `k3jax.ops.kda_chunk_xla`) and, under a mesh with a context axis, runs over the
row's slices. The gate, the q/k normalisation, the input checks and packing (`cu_seqlens`,
`segment_ids`: run labels) are in `k3jax.ops.kda_inputs`; the variants Gated DeltaNet and gated
linear attention in `k3jax.ops.kda_variants`.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda_chunk_xla import _chunk_kda_xla
from k3jax.ops.kda_inputs import _prepare, _run_labels, kda_gate
from k3jax.parallel import context, sharding

_HIGHEST = jax.lax.Precision.HIGHEST
_BACKENDS = ("auto", "xla", "pallas")


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
# Chunked entry: backend choice, context slicing and the options' checks.
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
