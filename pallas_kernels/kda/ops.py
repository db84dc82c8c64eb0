"""`chunk_kda`: chunked Kimi Delta Attention on Pallas kernels, differentiable through a Pallas VJP.

What the forward saves for the backward (`_core_fwd`): the kernel inputs, the in-chunk gate cumsum
G, the per-chunk C×C matrices X (key-key decayed products), P (query-key; in the input dtype) and
M = (I + L)^{-1}, the WY keys W, the state-update keys kg = k e^{b-G}, the output-side queries
qg = s q e^G, the pseudo-values Vn = U − W S and the state at the start of every chunk (the last
five in the input dtype, like fla). Nothing of the forward is recomputed. Saving the per-chunk
states costs T/C·H·K·V elements but spares the backward a second sequential scan, which is the
stage with the least parallelism. Without a gradient (`_forward` with residuals=False) none of
this is written beyond what the forward itself reads back.

q/k L2 norm (`use_qk_l2norm`): inside gate_fwd (and intra_fwd's tiles, see the `gate` module), not
an XLA pass before the kernels; a training forward's gate_fwd also writes the normalised q, k (the
backward's kernels read them) and the norms, with which gate_bwd forms the norm's gradient.

Packing: `cu_seqlens` aligns each sequence to the chunk grid (its own initial / final state);
`segment_ids` keeps the tokens where they are and resets the state inside chunks (document masks in
the kernels, see the `common` module).

Gate policy (the diagonal 16×16 sub-tiles are the only place where a gate bound matters, see the
`intra_chunk` module):
- fused bounded gate (`A_log` given, `-5 <= lower_bound < 0`): factored dense tiles (fast path).
- fused bounded gate with `lower_bound < -5`, or fused softplus gate (`A_log` given, `lower_bound`
  None, unbounded below): exact pairwise diagonal tiles, statically.
- pre-activated `g` (`A_log` None): checked at run time with one min-reduction over g; if every
  g >= -5 the fast path runs, otherwise the exact path (`lax.cond`, both compiled). Either way the
  result is finite for any finite g <= 0.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels.kda.backward import dense_bwd, intra_bwd, scan_bwd
from pallas_kernels.kda.config import BC, KernelConfig, default_tuning
from pallas_kernels.kda.gate import gate_fwd
from pallas_kernels.kda.intra_chunk import intra_fwd, wy_fwd
from pallas_kernels.kda.output import out_fwd
from pallas_kernels.kda.scan import scan_fwd, scan_out_fwd

# A factored diagonal tile multiplies e^{G_i - r} by e^{r - G_j}, r the tile's first row: the second
# factor reaches e^{15·|g|max}. With |g| <= 5 that is e^75, inside fp32/bf16 range (max ≈ e^88.7).
SAFE_GATE_BOUND = 5.0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, q, k, v, g, beta, h0, a_log, dt_bias, seq, first, last, dseg):
  return _forward(cfg, False, q, k, v, g, beta, h0, a_log, dt_bias, seq, first, last, dseg)


def _core_fwd(cfg, q, k, v, g, beta, h0, a_log, dt_bias, seq, first, last, dseg):
  return _forward(cfg, True, q, k, v, g, beta, h0, a_log, dt_bias, seq, first, last, dseg)


# The kernel sequences are jitted with the static config: a model calls them once per KDA layer
# with the same shapes, and a jit is traced and lowered to Triton once for all of those calls
# (small.gin's training step traced 252 kernels, each KDA layer's again; see RESULTS.md).
@functools.partial(jax.jit, static_argnums=(0, 1))
def _forward(cfg, residuals, q, k, v, g, beta, h0, a_log, dt_bias, seq, first, last, dseg):
  """Returns (o, ht), and with `residuals` also what the backward reads. Without (no gradient
  taken), intra_fwd does not write X and writes M in the dots' dtype, the scan forms the outputs
  itself instead of storing Vn and the per-chunk states for out_fwd (RESULTS.md, run 6: 0.41 vs
  0.65 ms for scan + out_fwd at (8, 4096, 16, 128))."""
  norm = cfg.qk_l2norm
  outs = gate_fwd(cfg, q, k, g, beta, a_log, dt_bias, dseg=dseg, normalized=residuals and norm)
  G, qg, kb, kg = outs[:4]
  rq, rk = outs[4:6] if norm else (None, None)
  if residuals:
    X, P, M = intra_fwd(cfg, q, k, G, beta, dseg=dseg, rq=rq, rk=rk)
  else:
    P, M = intra_fwd(cfg, q, k, G, beta, dseg=dseg, residuals=False, rq=rq, rk=rk)
  W, U = wy_fwd(cfg, kb, v, beta, M)
  if not residuals:
    return scan_out_fwd(cfg, kg, G, W, U, qg, P, h0, seq, first, last, dseg=dseg,
                        out_dtype=v.dtype)
  vn, hs, ht = scan_fwd(cfg, kg, G, W, U, h0, seq, first, last, dseg=dseg)
  o = out_fwd(cfg, qg, hs, P, vn, v.dtype)
  # The backward's kernels read the normalised q, k; the norm's own gradient (in gate_bwd) the
  # raw ones and the reciprocal norms.
  qn, kn = outs[6:8] if norm else (q, k)
  norm_res = (q, k, rq, rk) if norm else None
  res = (qn, kn, norm_res, v, g, beta, a_log, dt_bias, G, X, P, M, W, kg, qg, vn, hs, seq, first,
         last, dseg)
  return (o, ht), res


@functools.partial(jax.jit, static_argnums=(0,))
def _core_bwd(cfg, res, cts):
  (qn, kn, norm_res, v, g, beta, a_log, dt_bias, G, X, P, M, W, kg, qg, vn, hs, seq, first, last,
   dseg) = res
  cfg = dataclasses.replace(cfg, qk_l2norm=False)  # the backward's kernels read qn, kn
  do, dht = cts
  dhs, dvn, dh0 = scan_bwd(cfg, qg, kg, G, W, P, do, dht.astype(jnp.float32), seq, first, last,
                           dseg=dseg)
  dP, dX, dqp, dkp, dGp, dv, dbeta = dense_bwd(cfg, qn, kn, v, beta, G, vn, M, X, hs, dhs, dvn,
                                               do, dseg=dseg)
  outs = intra_bwd(cfg, qn, kn, g, G, dP, dX, dqp, dkp, dGp, a_log, dt_bias, norm=norm_res)
  dq, dk, dg = outs[:3]
  if cfg.gate == "none":
    da, ddt = None, None
  else:
    da = jnp.sum(outs[3], axis=(0, 1)).astype(a_log.dtype)
    ddt = jnp.sum(outs[4], axis=(0, 1)).astype(dt_bias.dtype)  # per-chunk sums from gate_bwd
  return (dq, dk, dv, dg, dbeta.astype(beta.dtype), dh0, da, ddt, None, None, None, None)


_core.defvjp(_core_fwd, _core_bwd)


def _segment_inputs(segment_ids, g_pad, q, k, v, g, beta, mask_qkv=True):
  """Masks padding tokens to the identity and numbers the documents of each row.

  Returns q, k, v, g, beta with padding zeroed (g set to `g_pad`, a zero log decay; q, k, v left as
  they are without mask_qkv, when the caller's are zero there already) and the running
  document number [B, T] int32 (+1 at each token whose id differs from the previous non-padding
  token's; the first document, and padding before it, is 0). The within-chunk numbering is taken
  from it after padding to the chunk grid.
  """
  B, T = segment_ids.shape
  seg = segment_ids.astype(jnp.int32)
  real = seg > 0
  pos = jnp.arange(T, dtype=jnp.int32)
  last_real = lax.cummax(jnp.where(real, pos[None, :], -1), axis=1)
  prev_real = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), last_real[:, :-1]], axis=1)
  prev_id = jnp.take_along_axis(seg, jnp.maximum(prev_real, 0), axis=1)
  starts = real & (prev_real >= 0) & (seg != prev_id)
  doc = jnp.cumsum(starts.astype(jnp.int32), axis=1)
  tok = real[:, :, None, None]
  # Products with the mask, not selects against zeros: XLA shared one materialised zeros buffer
  # [B, T, H, K] between every layer's selects (3 GiB at 1M tokens, alive for the whole step).
  if mask_qkv:
    q, k, v = (x * tok.astype(x.dtype) for x in (q, k, v))
  g = jnp.where(tok, g, jnp.asarray(g_pad, g.dtype))   # g_pad may be -inf: a select
  beta = beta * real[:, :, None].astype(beta.dtype)
  return q, k, v, g, beta, doc


def _align(x, src, valid, pad_value):
  """Gathers packed tokens x [1, T, ...] into the chunk-aligned layout [1, T', ...]."""
  out = jnp.take(x[0], src, axis=0)
  mask = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
  return jnp.where(mask, out, jnp.asarray(pad_value, x.dtype))[None]


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm=False, cu_seqlens=None, segment_ids=None, chunk_size=64,
              interpret=None, A_log=None, dt_bias=None, lower_bound=None, tuning=None,
              qkv_zero_at_padding=False):
  """Chunked KDA (Kimi Delta Attention) on Pallas kernels.

  Args:
    q, k: [B, T, H, K] queries / keys (bf16 or fp32).
    v: [B, T, H, V] values.
    g: [B, T, H, K] log decay (<= 0); with `A_log` given, the raw gate input instead.
    beta: [B, T, H] delta-rule strength (post-sigmoid).
    scale: query scale, default K**-0.5.
    initial_state: [N, H, K, V] fp32 (N = B, or the number of sequences with `cu_seqlens`).
    output_final_state: also return the state after the last token of each sequence.
    use_qk_l2norm: L2-normalise q and k over K first (fp32, eps 1e-6 inside the square root;
      inside the kernels, see the module docstring).
    cu_seqlens: [N + 1] int32 offsets of packed sequences (B must be 1).
    segment_ids: [B, T] int, 0 = padding, 1, 2, ... documents: the state resets when the id
      differs from that of the previous non-padding token; `initial_state` applies to the first
      document of each row and the final state is the one at the end of each row. Padding tokens
      leave the state unchanged and output zeros. May be traced.
    chunk_size: C, a multiple of 16 (16, 32, 64, ...; a power of two on GPU).
    interpret: run the Pallas interpreter; None = interpret on CPU, compile elsewhere.
    A_log: [H] fp32; fuses the gate into the kernel (see `lower_bound`).
    dt_bias: [H*K] or [H, K] fp32 gate bias (zeros if None); only with `A_log`.
    lower_bound: with `A_log`, g = lower_bound·sigmoid(exp(A_log)·(g + dt_bias)) (-5 recommended);
      None selects the unbounded g = -exp(A_log)·softplus(g + dt_bias).
    tuning: `config.Tuning` launch parameters of the compiled kernels (None =
      `config.default_tuning`).
    qkv_zero_at_padding: q, k and v are already zero at padding tokens: only g and beta are
      masked (`k3jax.ops.kda.chunk_kda` says more).

  Returns:
    (o [B, T, H, V] in v.dtype, final state [N, H, K, V] fp32 or None).
  """
  if q.ndim != 4 or k.shape != q.shape or g.shape != q.shape:
    raise ValueError(f"q, k, g must share one [B, T, H, K] shape; got {q.shape}, {k.shape}, "
                     f"{g.shape}")
  B, T, H, K = q.shape
  if v.ndim != 4 or v.shape[:3] != (B, T, H):
    raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V]; got {v.shape}")
  if beta.shape != (B, T, H):
    raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got {beta.shape}")
  V = v.shape[-1]
  C = int(chunk_size)
  if C < BC or C % BC:
    raise ValueError(f"chunk_size must be a positive multiple of {BC}; got {chunk_size}")
  if interpret is None:
    interpret = jax.default_backend() == "cpu"
  if not interpret:
    for name, d in (("K", K), ("V", V), ("chunk_size", C)):
      if d < 16 or d & (d - 1):
        raise ValueError(f"{name} must be a power of two >= 16 for the compiled GPU kernels; "
                         f"got {d}")
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids)
    if cu_seqlens is not None:
      raise ValueError("pass at most one of cu_seqlens and segment_ids")
    if segment_ids.shape != (B, T):
      raise ValueError(f"segment_ids must be [B, T] = {(B, T)}; got {segment_ids.shape}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise ValueError(f"segment_ids must have an integer dtype; got {segment_ids.dtype}")
  if A_log is None:
    if dt_bias is not None or lower_bound is not None:
      raise ValueError("dt_bias and lower_bound apply to the fused gate only: pass A_log too")
    gate = "none"
  else:
    if A_log.shape != (H,):
      raise ValueError(f"A_log must be [H] = [{H}]; got {A_log.shape}")
    dt_bias = (jnp.zeros((H, K), jnp.float32) if dt_bias is None
               else jnp.reshape(dt_bias, (H, K)))
    if lower_bound is not None and not lower_bound < 0:
      raise ValueError(f"lower_bound must be negative; got {lower_bound}")
    gate = "softplus" if lower_bound is None else "bounded"
  if T == 0:
    raise ValueError("T must be positive")

  if cu_seqlens is not None:
    if B != 1:
      raise ValueError(f"cu_seqlens requires B == 1; got B = {B}")
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seq = cu.shape[0] - 1
  else:
    n_seq = B
  if initial_state is not None and initial_state.shape != (n_seq, H, K, V):
    raise ValueError(f"initial_state must be [N, H, K, V] = {(n_seq, H, K, V)}; got "
                     f"{initial_state.shape}")

  if scale is None:
    scale = K ** -0.5
  # Padding tokens must be the identity on the state: k = v = beta = 0 and a log decay of exactly 0
  # (raw gate input -inf for the fused gates, whose activation maps it to 0).
  g_pad = 0.0 if gate == "none" else -jnp.inf

  dseg = None
  if segment_ids is not None:
    q, k, v, g, beta, dseg = _segment_inputs(segment_ids, g_pad, q, k, v, g, beta,
                                             mask_qkv=not qkv_zero_at_padding)
  if cu_seqlens is None:
    tp = -(-T // C) * C
    pad = tp - T
    if pad:
      pad4 = ((0, 0), (0, pad), (0, 0), (0, 0))
      q, k, v = jnp.pad(q, pad4), jnp.pad(k, pad4), jnp.pad(v, pad4)
      g = jnp.pad(g, pad4, constant_values=g_pad)
      beta = jnp.pad(beta, pad4[:3])
      if dseg is not None:  # trailing padding continues the row's last document
        dseg = jnp.pad(dseg, ((0, 0), (0, pad)), mode="edge")
    nt = tp // C
    cidx = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, nt))
    first = jnp.broadcast_to((cidx == 0).astype(jnp.int32), (B, nt))
    last = jnp.broadcast_to((cidx == nt - 1).astype(jnp.int32), (B, nt))
  else:
    lens = cu[1:] - cu[:-1]
    plens = -(-lens // C) * C
    aend = jnp.cumsum(plens)
    astart = aend - plens
    tp = -(-(T + n_seq * (C - 1)) // C) * C
    nt = tp // C
    astart_x = jnp.concatenate([astart, aend[-1:]])
    lens_x = jnp.concatenate([lens, jnp.zeros((1,), jnp.int32)])
    cu_x = jnp.concatenate([cu[:-1], cu[-1:]])
    pos = jnp.arange(tp, dtype=jnp.int32)
    n_of = jnp.searchsorted(aend, pos, side="right").astype(jnp.int32)
    off = pos - astart_x[n_of]
    valid = off < lens_x[n_of]
    src = jnp.clip(cu_x[n_of] + off, 0, T - 1)
    q, k, v = (_align(x, src, valid, 0.0) for x in (q, k, v))
    g = _align(g, src, valid, g_pad)
    beta = _align(beta, src, valid, 0.0)
    c0 = jnp.arange(nt, dtype=jnp.int32) * C
    n_c = jnp.searchsorted(aend, c0, side="right").astype(jnp.int32)
    in_seq = n_c < n_seq
    seq = n_c[None]
    first = (in_seq & (c0 == astart_x[n_c]))[None].astype(jnp.int32)
    last = (in_seq & (c0 + C == jnp.concatenate([aend, aend[-1:]])[n_c]))[None].astype(jnp.int32)

  h0 = (jnp.zeros((n_seq, H, K, V), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))
  h0 = jnp.concatenate([h0, jnp.zeros((1, H, K, V), jnp.float32)])  # dummy row for padding chunks

  low_precision = q.dtype != jnp.float32 or v.dtype != jnp.float32
  make_cfg = functools.partial(
      KernelConfig, chunk=C, scale=float(scale),
      mm_dtype=jnp.bfloat16 if low_precision else jnp.float32, gate=gate,
      lower_bound=float(lower_bound) if lower_bound is not None else 0.0,
      interpret=bool(interpret), state_dtype=jnp.bfloat16 if low_precision else jnp.float32,
      segmented=dseg is not None, qk_l2norm=bool(use_qk_l2norm),
      tuning=default_tuning(B * H, K, V) if tuning is None else tuning)
  if dseg is not None:
    # Documents numbered within each chunk relative to the token before it, so that 0 is the
    # document the incoming state belongs to (a chunk that starts with a reset has no 0).
    before = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), dseg[:, C - 1:-1:C]], axis=1)
    dseg = (dseg.reshape(B, -1, C) - before[:, :, None]).reshape(B, -1)
  args = (q, k, v, g, beta, h0, A_log, dt_bias, seq, first, last, dseg)
  if gate == "bounded":
    o, ht = _core(make_cfg(exact_diag=-lower_bound > SAFE_GATE_BOUND), *args)
  elif gate == "softplus":
    o, ht = _core(make_cfg(exact_diag=True), *args)
  else:
    bounded = jnp.min(g) >= -SAFE_GATE_BOUND
    o, ht = lax.cond(bounded, functools.partial(_core, make_cfg(exact_diag=False)),
                     functools.partial(_core, make_cfg(exact_diag=True)), *args)

  if cu_seqlens is None:
    o = o[:, :T]
  else:
    t = jnp.arange(T, dtype=jnp.int32)
    n_t = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    o = jnp.take(o[0], astart_x[n_t] + t - cu_x[n_t], axis=0)[None]
  return o, (ht[:n_seq] if output_final_state else None)
