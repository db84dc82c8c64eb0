"""Forward stages 2 and 3 of chunked KDA: the intra-chunk C×C matrices and the WY representation
(`intra_fwd`, `wy_fwd`; fla's `fla.ops.kda.chunk_intra` and `fla.ops.kda.wy_fast`).

Per chunk, for tokens i, j of the chunk and sums over the K columns d (s the query scale, G and
kb = β k e^G from `gate.gate_fwd`):
  X_ij = Σ_d k_id k_jd e^{G_id - G_jd}      (j < i; zero elsewhere)      L = diag(β) X
  P_ij = Σ_d s q_id k_jd e^{G_id - G_jd}    (j ≤ i: diagonal included)
  M = (I + L)^{-1}                          W = M kb,  U = M (β v)
With documents (`common`), X and P only pair tokens of one document. With cfg.qk_l2norm the tiles
are sums over the raw rows, scaled at the end by r_k,i r_k,j (X) and r_q,i r_k,j (P): each tile is
bilinear in its rows.

Pairwise decays e^{G_i - G_j} are only formed as products of two factors around a reference r,
e^{G_i - r} · e^{r - G_j}, where r is G at the first row of the query sub-tile (a causal reference:
it never reads a gate after row i). Across sub-tiles (j in an earlier sub-tile) both factors are
≤ 1 for any gate. On the diagonal 16×16 tiles the key factor reaches e^{15·|g|max}; this is finite
only for bounded gates (|g| ≤ 5 ⇒ ≤ e^75; `ops.SAFE_GATE_BOUND`). With `exact_diag=True` the
diagonal tiles instead use exact pairwise differences e^{min(G_i - G_j, 0)} (16 rank-1 steps on the
vector units), valid for any g ≤ 0. The backward's pair terms (`backward.intra_bwd`) factor the
decays the same way. Small register tiles and many programs were what made the intra-chunk kernels
fast on the H200 (RESULTS.md, run 4); so was keeping the gate out of the pair kernel (intra_fwd
1.07 → 0.66 ms, run 5).

intra_fwd, grid (B, NT, H): one chunk per program, its K columns in blocks of
`Tuning.intra_fwd_bk` (a loop).
  in:  q, k [B, T, H, K] (raw with cfg.qk_l2norm); G [B, T, H, K] fp32; beta [B, T, H];
       cfg.qk_l2norm: r_q, r_k [B, T, H] fp32; cfg.segmented: dseg [B, T] int32.
  out: with `residuals` (a training forward): X [B, NT, H, C, C] fp32, P [B, NT, H, C, C]
       cfg.mm_dtype, M [B, NT, H, C, C] fp32; without: P and M [B, NT, H, C, C], cfg.mm_dtype.
wy_fwd, grid (B, NT, H):
  in:  kb [B, T, H, K] cfg.state_dtype; v [B, T, H, V]; beta [B, T, H]; M [B, NT, H, C, C].
  out: W [B, T, H, K] and U [B, T, H, V], cfg.state_dtype.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (_block, _check_seg, _f32, _hd, _iota, _mat_spec, _mm,
                                       _params, _row, _seg_spec, _sub, _tok_spec, _vec_spec)
from pallas_kernels.kda.config import BC, KernelConfig


# ----------------------------------------------------------------------------------------------
# Forward 2: X / P tiles and M = (I + L)^{-1}.
# ----------------------------------------------------------------------------------------------
def _intra_fwd_kernel(cfg: KernelConfig, residuals, q_ref, k_ref, G_ref, beta_ref, *refs):
  """X and P tiles (zero above the diagonal) and M = (I + L)^{-1} (lower block triangular). With
  `residuals` (a training forward) also X, and M in fp32 (the backward's inputs); without, M in
  cfg.mm_dtype, the dtype in which wy_fwd's dots read it.

  The pair tiles are sums over K: they accumulate over K blocks of `tuning.intra_fwd_bk` columns
  (a loop), so only [BC, bk] operands are live at a time (fla's layout; on the H200, 3.65 → 1.07 ms
  at (8, 4096, 16, 128) against the whole K width, RESULTS.md run 4; 0.66 ms with the gate in
  gate_fwd, run 5).

  With cfg.qk_l2norm, q and k are the raw ones and the tiles, sums over raw rows, are scaled at
  the end by the reciprocal norms r_q, r_k (inputs: each tile is bilinear in its rows).
  """
  rq_ref, rk_ref, refs = (refs[0], refs[1], refs[2:]) if cfg.qk_l2norm else (None, None, refs)
  dseg_ref, refs = (refs[0], refs[1:]) if cfg.segmented else (None, refs)
  X_ref, P_ref, M_ref = refs if residuals else (None,) + tuple(refs)
  ns, K = cfg.ns, q_ref.shape[-1]
  bk = _block(K, cfg.tuning.intra_fwd_bk, "tuning.intra_fwd_bk")
  tile = (BC, BC)
  ii, jj = _iota(tile, 0), _iota(tile, 1)
  zeros_tile = jnp.zeros(tile, jnp.float32)
  pairs = [(I, J) for I in range(ns) for J in range(I + 1)]

  def k_block(ik, acc):
    cols = pl.ds(ik * bk, bk)
    Gs = [G_ref[_sub(I), cols] for I in range(ns)]
    acc = dict(zip(pairs, acc))
    for I in range(ns):
      r = _row(Gs[I], 0)
      e_i = jnp.exp(Gs[I] - r)  # ≤ 1
      q_i = _f32(q_ref[_sub(I), cols]) * cfg.scale
      k_i = _f32(k_ref[_sub(I), cols])
      qa, ka = q_i * e_i, k_i * e_i
      for J in range(I + 1):
        if J < I or not cfg.exact_diag:
          kj = _f32(k_ref[_sub(J), cols]) * jnp.exp(r - Gs[J])  # ≤ 1 off the diagonal
          x, p = _hd(cfg, ka, kj.T), _hd(cfg, qa, kj.T)
        else:
          def pair_step(j, xp, G=Gs[I], kt=k_i, qt=q_i):
            x, p = xp
            e = jnp.exp(jnp.minimum(G - _row(G, j), 0.0))
            kje = _row(kt, j) * e
            x = x + jnp.where(jj == j, jnp.sum(kt * kje, axis=1, keepdims=True), 0.0)
            p = p + jnp.where(jj == j, jnp.sum(qt * kje, axis=1, keepdims=True), 0.0)
            return x, p

          x, p = lax.fori_loop(0, BC, pair_step, (zeros_tile, zeros_tile))
        ax, ap = acc[(I, J)]
        acc[(I, J)] = (ax + x, ap + p)
    return tuple(acc[ij] for ij in pairs)

  acc = lax.fori_loop(0, K // bk, k_block, tuple((zeros_tile, zeros_tile) for _ in pairs))
  acc = dict(zip(pairs, acc))
  ds = [dseg_ref[_sub(I)] if cfg.segmented else None for I in range(ns)]
  if cfg.qk_l2norm:
    rqs = [rq_ref[_sub(I)] for I in range(ns)]
    rks = [rk_ref[_sub(I)] for I in range(ns)]
  ls = {}
  for I in range(ns):
    beta = _f32(beta_ref[_sub(I)])[:, None]
    for J in range(ns):
      if J > I:
        for ref in (X_ref, P_ref, M_ref):
          if ref is not None:
            ref[_sub(I), _sub(J)] = zeros_tile.astype(ref.dtype)
        continue
      x, p = acc[(I, J)]
      if cfg.qk_l2norm:
        x = x * (rks[I][:, None] * rks[J][None, :])
        p = p * (rqs[I][:, None] * rks[J][None, :])
      if cfg.segmented:
        same = ds[I][:, None] == ds[J][None, :]
        x = jnp.where(same, x, 0.0)
        p = jnp.where(same, p, 0.0)
      if J == I:
        x = jnp.where(ii > jj, x, 0.0)
        p = jnp.where(ii >= jj, p, 0.0)
      ls[(I, J)] = beta * x
      if residuals:
        X_ref[_sub(I), _sub(J)] = x
      P_ref[_sub(I), _sub(J)] = p.astype(P_ref.dtype)

  # (I + L_II)^{-1} of the NS diagonal blocks by forward substitution, one row at a time, the NS
  # independent chains in one loop (latency-bound steps overlap).
  def subst_step(i, invs):
    out = []
    for I, inv in enumerate(invs):
      li = _row(ls[(I, I)], i)  # [1, BC]
      new = jnp.sum(li.T * inv, axis=0, keepdims=True)  # l_i @ inv (rows < i are final)
      out.append(jnp.where(ii == i, inv - new, inv))
    return tuple(out)

  eye = jnp.where(ii == jj, 1.0, 0.0)
  invs = lax.fori_loop(1, BC, subst_step, (eye,) * ns)
  # M = (I + L)^{-1} by block forward substitution over the sub-tiles:
  # M_II = (I + L_II)^{-1},  M_IJ = -M_II Σ_{J≤m<I} L_Im M_mJ  (J < I): 16 small dots at NS = 4,
  # on tiles already in registers (so wy_fwd need not re-read X and the inverses).
  ms = {(I, I): invs[I] for I in range(ns)}
  for I in range(1, ns):
    for J in range(I):
      lm = _hd(cfg, ls[(I, J)], ms[(J, J)])  # Σ_{J≤m<I} L_Im M_mJ
      for m in range(J + 1, I):
        lm = lm + _hd(cfg, ls[(I, m)], ms[(m, J)])
      ms[(I, J)] = -_hd(cfg, invs[I], lm)
  for I in range(ns):
    for J in range(I + 1):
      M_ref[_sub(I), _sub(J)] = ms[(I, J)].astype(M_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Forward 3: the WY keys and values W = M kb, U = M (β v) (M from intra_fwd).
# ----------------------------------------------------------------------------------------------
def _wy_fwd_kernel(cfg: KernelConfig, kb_ref, v_ref, beta_ref, M_ref, W_ref, U_ref):
  beta = _f32(beta_ref[...])[:, None]
  m = M_ref[...]
  W_ref[...] = _mm(cfg, m, kb_ref[...]).astype(W_ref.dtype)
  U_ref[...] = _mm(cfg, m, beta * _f32(v_ref[...])).astype(U_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
def intra_fwd(cfg, q, k, G, beta, dseg=None, residuals=True, rq=None, rk=None):
  """Returns X [B,NT,H,C,C] fp32 (only with `residuals`), P [B,NT,H,C,C] in cfg.mm_dtype (its
  users read it as a dot operand of that dtype) and M = (I + L)^{-1} [B,NT,H,C,C] (fp32 with
  `residuals`, for the backward; else cfg.mm_dtype). With cfg.qk_l2norm, q and k are the raw ones
  and rq, rk [B,T,H] fp32 their reciprocal L2 norms (from gate_fwd)."""
  _check_seg(cfg, dseg)
  if cfg.qk_l2norm != (rq is not None and rk is not None):
    raise ValueError("rq and rk must be given exactly when cfg.qk_l2norm; "
                     f"qk_l2norm={cfg.qk_l2norm}, rq={'given' if rq is not None else None}, "
                     f"rk={'given' if rk is not None else None}")
  B, T, H, K = q.shape
  C = cfg.chunk
  nt = T // C
  in_specs = [_tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, K), _vec_spec(C)]
  args = [q, k, G, beta]
  if cfg.qk_l2norm:
    in_specs += [_vec_spec(C)] * 2
    args += [rq, rk]
  if cfg.segmented:
    in_specs.append(_seg_spec(C))
    args.append(dseg)
  mat = lambda dtype: jax.ShapeDtypeStruct((B, nt, H, C, C), dtype)
  if residuals:
    out_shape = [mat(jnp.float32), mat(cfg.mm_dtype), mat(jnp.float32)]
  else:
    out_shape = [mat(cfg.mm_dtype), mat(cfg.mm_dtype)]
  return pl.pallas_call(
      functools.partial(_intra_fwd_kernel, cfg, residuals),
      grid=(B, nt, H),
      in_specs=in_specs,
      out_specs=[_mat_spec(C)] * len(out_shape),
      out_shape=out_shape,
      interpret=cfg.interpret, name="kda_intra_fwd",
      **_params(cfg, cfg.tuning.intra_fwd_launch),
  )(*args)


def wy_fwd(cfg, kb, v, beta, M):
  """Returns W [B,T,H,K] and U [B,T,H,V] (cfg.state_dtype)."""
  B, T, H, K = kb.shape
  V = v.shape[-1]
  C = cfg.chunk
  nt = T // C
  return pl.pallas_call(
      functools.partial(_wy_fwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=[_tok_spec(C, K), _tok_spec(C, V), _vec_spec(C), _mat_spec(C)],
      out_specs=[_tok_spec(C, K), _tok_spec(C, V)],
      out_shape=[jax.ShapeDtypeStruct((B, T, H, K), cfg.state_dtype),
                 jax.ShapeDtypeStruct((B, T, H, V), cfg.state_dtype)],
      interpret=cfg.interpret, name="kda_wy_fwd", **_params(cfg, cfg.tuning.wy_fwd_launch),
  )(kb, v, beta, M)
