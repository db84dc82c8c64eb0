"""The chunked (WY) KDA algorithm on the XLA backend, in plain JAX and fp32, differentiable by
autodiff: `chunk_kda`'s path off the GPU (or with backend='xla') and `chunk_gla`'s always
(`delta_rule` False), called after their checks.

Gates. `g` is the log decay (≤ 0). The chunked path never forms exp(G_i)·exp(−G_j) over a chunk: it uses
the masked pairwise exp(G_i − G_j) on same-document causal pairs only, with G_i − G_j summed directly
from the g between the two tokens, so every exponent is ≤ 0, nothing cancels, and any gate (the bounded
one of `kda_gate`, the unbounded softplus form, raw values far below −5) is exact. Memory is O(T·C·K) per
head for those decays (and C³·K flops per chunk for the sums); this is the reference, not the fast path
(the Pallas kernel in `pallas_kernels.kda` is).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.ops.kda_inputs import _run_labels, l2_normalize

_HIGHEST = jax.lax.Precision.HIGHEST


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
