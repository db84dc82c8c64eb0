"""The backward of chunked KDA: three entry points, four kernels, in call order (fla's
`fla.ops.kda.chunk_bwd.chunk_kda_bwd`: `chunk_gated_delta_rule_bwd_dhu`,
`chunk_kda_bwd_wy_dqkg_fused`, `chunk_kda_bwd_intra`, then `kda_gate_bwd`). Nothing of the forward
is recomputed: the kernels read what it saved (`ops._core_fwd`). They read q, k themselves and take
the normalised ones (dense_bwd and intra_bwd refuse cfg.qk_l2norm); the norm's gradient is taken in
the gate's kernel (intra_bwd's `norm`). Sums over d are over the K columns; ⊙ is per column.

1. scan_bwd, grid (B, H, V / bv), bv = `Tuning.bv_bwd`: a reverse scan over the chunks, with dS the
   gradient of the chunk's end state (the sequence's dht where the chunk ends one):
     dVn = Pᵀ do + kg dS,   then   dS ← e^b ⊙ dS + qgᵀ do − Wᵀ dVn
   (the start state's gradient: the next chunk's dS, and dh0 where the chunk starts a sequence).
   in:  qg, kg, W [B, T, H, K] cfg.state_dtype; G [B, T, H, K] fp32; P [B, NT, H, C, C]
        cfg.mm_dtype; do [B, T, H, V]; dht [N + 1, H, K, V] fp32; seq, first, last [B, NT] int32;
        cfg.segmented: dseg [B, T] int32 (whole arrays).
   out: dS at every chunk's end [B, NT, H, K, V] fp32; dVn [B, T, H, V] fp32; dh0 [N + 1, H, K, V]
        fp32 (written in place of dht).
2. dense_bwd, grid (B, NT, H), loops over V and K blocks (`Tuning.dense_bwd_bv` / `dense_bwd_bk`):
   dP = do Vnᵀ (causal); through U = M (β v) and W = M kb (dW = −dVn Sᵀ) to dv, dβ and
   dM = dVn (β v)ᵀ + dW kbᵀ; the state terms do Sᵀ (of qg) and Vn dSᵀ (of kg) and the gradient of
   e^b; dL = −Mᵀ dM Mᵀ (strictly lower, within documents), dX = β dL.
   in:  q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]; G [B, T, H, K] fp32; Vn [B, T, H, V]
        cfg.state_dtype; M, X [B, NT, H, C, C] fp32; the chunks' start states [B, NT, H, K, V]
        cfg.state_dtype; dS [B, NT, H, K, V] fp32; dVn [B, T, H, V] fp32; do [B, T, H, V];
        cfg.segmented: dseg [B, T] int32.
   out: dP, dX [B, NT, H, C, C] fp32; the partial dq, dk, dG [B, T, H, K] fp32; dv [B, T, H, V] in
        v's dtype; dβ [B, T, H] fp32.
3. intra_bwd's pair kernel, grid (B, NT, H, K / bk · NS), bk = `Tuning.intra_bwd_bk`: one 16-row
   sub-tile and K block per program; the pair terms of P and X, with dP, dX causal and within
   documents and the decays factored as in `intra_chunk`:
     dq_i += s Σ_j dP_ij k_j e^{G_i - G_j}
     dk_i += Σ_j dX_ij k_j e^{G_i - G_j} + Σ_l (s dP_li q_l + dX_li k_l) e^{G_l - G_i}
     dG_i += s q_i ⊙ Σ_j dP_ij k_j e^{G_i - G_j} + k_i ⊙ Σ_j dX_ij k_j e^{G_i - G_j}
             − k_i ⊙ Σ_l (s dP_li q_l + dX_li k_l) e^{G_l - G_i}
   in:  q, k [B, T, H, K]; G [B, T, H, K] fp32; dP, dX [B, NT, H, C, C] fp32; dense_bwd's partial
        dq, dk, dG [B, T, H, K] fp32.
   out: dq [B, T, H, K] in q's dtype, dk in k's dtype; dG [B, T, H, K] fp32.
4. intra_bwd's gate kernel (`_gate_bwd_kernel`), grid (B, NT, H): dg = the reverse cumsum of dG
   within the chunk, then through the fused gate to its input, with A_log's per-token terms and the
   chunk's sums of dg (dt_bias); with the q/k norm, dx = r (dxn − xn <xn, dxn>) for x = q, k.
   in:  g [B, T, H, K]; dG [B, T, H, K] fp32; `norm`: the raw q, k [B, T, H, K], the pair kernel's
        dq, dk, r_q, r_k [B, T, H] fp32; fused gate: A_log [H], dt_bias [H, K] fp32.
   out: dg [B, T, H, K] in g's dtype; fused gate: A_log's terms [B, T, H] fp32, dt_bias's per-chunk
        sums [B, NT, H, K] fp32; `norm`: dq, dk [B, T, H, K] in the raw q's / k's dtypes.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (_block, _bv, _check_seg, _col, _doc_masks, _f32,
                                       _gate_refs, _gate_specs, _hd, _iota, _mat_spec, _mm,
                                       _params, _row, _seg_spec, _state_spec, _sub, _tok_spec,
                                       _vec_spec)
from pallas_kernels.kda.config import BC, KernelConfig


def _hd3(cfg, a, b):
  """fp32-operand dot at about fp32 accuracy: three TF32 products (hi·hi + hi·lo + lo·hi) when
  compiled for bf16 inputs. Used by the backward's diagonal pair tiles, whose key factor reaches
  e^{15|g|} and whose gate gradients cancel in sums over tokens (plain TF32 on every pair tile
  made the summed dt_bias / A_log gradients 4-10x worse than fla's in run 2; on the off-diagonal
  tiles alone it changes nothing measurable, run 4)."""
  if cfg.mm_dtype == jnp.float32 or cfg.interpret:
    return _hd(cfg, a, b)
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                 precision=lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
                 preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Backward 1: reverse scan for dS (gradient of each chunk's end state) and dVn.
# ----------------------------------------------------------------------------------------------
def _scan_bwd_kernel(cfg: KernelConfig, nt, bv, qg_ref, kg_ref, G_ref, W_ref, P_ref, do_ref,
                     dht_ref, seq_ref, first_ref, last_ref, *refs):
  if cfg.segmented:
    dseg_ref, refs = refs[0], refs[1:]
  dhs_ref, dvn_ref, dh0_ref = refs
  b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, K = cfg.chunk, qg_ref.shape[-1]
  vs = pl.ds(iv * bv, bv)

  def body(i, ds):
    c = nt - 1 - i
    t0 = c * C
    rows = pl.ds(t0, C)
    seq = seq_ref[b, c]
    ds = lax.cond(last_ref[b, c] != 0, lambda: dht_ref[seq, h, :, vs].astype(jnp.float32),
                  lambda: ds)
    dhs_ref[b, c, h, :, vs] = ds.astype(dhs_ref.dtype)
    decay = jnp.exp(G_ref[b, t0 + C - 1, h, :])[:, None]
    if cfg.segmented:  # a reset inside the chunk: the start state does not reach its end
      decay = jnp.where(dseg_ref[b, t0 + C - 1] == 0, decay, 0.0)
    do = _f32(do_ref[b, rows, h, vs])
    dvn = _mm(cfg, P_ref[b, c, h, :, :].T, do) + _mm(cfg, kg_ref[b, rows, h, :], ds)
    dvn_ref[b, rows, h, vs] = dvn
    ds = (decay * ds + _mm(cfg, qg_ref[b, rows, h, :].T, do)
          - _mm(cfg, W_ref[b, rows, h, :].T, dvn))

    @pl.when(first_ref[b, c] != 0)
    def _():
      dh0_ref[seq, h, :, vs] = ds

    return ds

  lax.fori_loop(0, nt, body, jnp.zeros((K, bv), jnp.float32))


# ----------------------------------------------------------------------------------------------
# Backward 2: dense per-chunk gradients (WY representation, inter-chunk terms, dP, dX).
# ----------------------------------------------------------------------------------------------
def _dense_bwd_kernel(cfg: KernelConfig, q_ref, k_ref, v_ref, beta_ref, G_ref, vn_ref, M_ref,
                      X_ref, hs_ref, dhs_ref, dvn_ref, do_ref, *refs):
  # Two loops, so that no whole K×V or C×K fp32 tile is live. First the V-side terms (dP, dv, the
  # U part of dM and dβ), one V block of `tuning.dense_bwd_bv` columns at a time. Then the K-side
  # terms, one K block of `tuning.dense_bwd_bk` columns at a time: the state terms of the block
  # (sums over V, an inner loop over V blocks that reads each state tile once), then its
  # elementwise gradients and its share of dM and dβ.
  if cfg.segmented:
    dseg_ref, refs = refs[0], refs[1:]
  dP_ref, dX_ref, dq_ref, dk_ref, dG_ref, dv_ref, dbeta_ref = refs
  C, K, V = cfg.chunk, q_ref.shape[-1], v_ref.shape[-1]
  bv = _block(V, cfg.tuning.dense_bwd_bv, "tuning.dense_bwd_bv")
  bk = _block(K, cfg.tuning.dense_bwd_bk, "tuning.dense_bwd_bk")
  ii, jj = _iota((C, C), 0), _iota((C, C), 1)
  causal = ii >= jj
  strict = ii > jj
  if cfg.segmented:
    d = dseg_ref[...]
    same = d[:, None] == d[None, :]
    causal = causal & same
    strict = strict & same
    first_doc, last_doc, no_reset = _doc_masks(d)
  beta = _f32(beta_ref[...])[:, None]
  m = M_ref[...]

  def v_block(iv, acc):  # WY value terms: U = M (β v); and dP
    dp, dm, dbeta = acc
    vs = pl.ds(iv * bv, bv)
    dvn = dvn_ref[:, vs]
    v = _f32(v_ref[:, vs])
    dp = dp + _mm(cfg, _f32(do_ref[:, vs]), vn_ref[:, vs].T)
    dm = dm + _mm(cfg, dvn, (beta * v).T)
    dvb = _mm(cfg, m.T, dvn)
    dv_ref[:, vs] = (beta * dvb).astype(dv_ref.dtype)
    return dp, dm, dbeta + jnp.sum(dvb * v, axis=1)

  zc = jnp.zeros((C, C), jnp.float32)
  dp, dm, dbeta = lax.fori_loop(0, V // bv, v_block, (zc, zc, jnp.zeros((C,), jnp.float32)))
  dP_ref[...] = jnp.where(causal, dp, 0.0)
  last_row = _iota((C, bk), 0) == C - 1

  def k_block(ik, acc):
    dm, dbeta = acc
    ks = pl.ds(ik * bk, bk)

    def state_terms(iv, acc):  # the start state S (hs) and the gradient dS of the end state
      dw, dqg, dkg, state_db = acc
      vs = pl.ds(iv * bv, bv)
      s = hs_ref[ks, vs]
      ds = dhs_ref[ks, vs]
      return (dw - _mm(cfg, dvn_ref[:, vs], s.T),
              dqg + _mm(cfg, _f32(do_ref[:, vs]), s.T),  # gradient of q e^G (scaled q)
              dkg + _mm(cfg, vn_ref[:, vs], ds.T),       # gradient of k e^{b-G}
              state_db + jnp.sum(_f32(s) * ds, axis=1)[None, :])

    zk = jnp.zeros((C, bk), jnp.float32)
    dw, dqg, dkg, state_db = lax.fori_loop(0, V // bv, state_terms,
                                           (zk, zk, zk, jnp.zeros((1, bk), jnp.float32)))
    G = G_ref[:, ks]
    gb = G_ref[pl.ds(C - 1, 1), ks]
    decay = jnp.exp(gb)
    if cfg.segmented:
      dqg = jnp.where(first_doc, dqg, 0.0)
      dkg = jnp.where(last_doc, dkg, 0.0)
      decay = jnp.where(no_reset, decay, 0.0)
    eg = jnp.exp(G)
    q = _f32(q_ref[:, ks]) * cfg.scale
    dq_ref[:, ks] = cfg.scale * dqg * eg
    dG = dqg * q * eg
    k = _f32(k_ref[:, ks])
    egb = jnp.exp(gb - G)
    kgv = k * egb
    dk = dkg * egb
    dG = dG - dkg * kgv
    db = decay * state_db + jnp.sum(dkg * kgv, axis=0, keepdims=True)
    # WY key terms: W = M (β k e^G).
    kt = k * eg
    kb = beta * kt
    if cfg.segmented:
      kb = jnp.where(first_doc, kb, 0.0)
    dm = dm + _mm(cfg, dw, kb.T)
    dkb = _mm(cfg, m.T, dw)
    if cfg.segmented:
      dkb = jnp.where(first_doc, dkb, 0.0)
    dkt = beta * dkb
    dk_ref[:, ks] = dk + dkt * eg
    dG = dG + dkt * kt
    dG_ref[:, ks] = jnp.where(last_row, dG + db, dG)
    return dm, dbeta + jnp.sum(dkb * kt, axis=1)

  dm, dbeta = lax.fori_loop(0, K // bk, k_block, (dm, dbeta))
  dm = jnp.where(ii >= jj, dm, 0.0)
  # M = (I + L)^{-1}  ⇒  dL = -Mᵀ dM Mᵀ (strictly lower part, within documents).
  dl = -_hd(cfg, _hd(cfg, m.T, dm), m.T)
  dl = jnp.where(strict, dl, 0.0)
  dbeta_ref[...] = dbeta + jnp.sum(dl * X_ref[...], axis=1)
  dX_ref[...] = beta * dl


# ----------------------------------------------------------------------------------------------
# Backward 3: intra-chunk pair terms from dP, dX, one 16-row sub-tile and K block per program.
# Backward 4: reverse cumsum of dG within the chunk and the gate's backward.
# ----------------------------------------------------------------------------------------------
def _intra_bwd_kernel(cfg: KernelConfig, q_ref, k_ref, G_ref, dP_ref, dX_ref, dqp_ref, dkp_ref,
                      dGp_ref, dq_ref, dk_ref, dG_ref):
  # One program per chunk, head, K block (`tuning.intra_bwd_bk` columns; every term is per column)
  # and 16-row sub-tile T (fla's grid: 16 independent programs per chunk and head at K = 128).
  # T's query-side terms (pairs (T, J), J <= T) and key-side terms (pairs (I, T), I >= T)
  # accumulate in three [16, bk] tiles. The chunk's q, k, G (all sub-tiles, this K block) and its
  # dP, dX are the program's blocks; the reverse cumsum over the chunk is the next kernel's.
  ns = cfg.ns
  T = pl.program_id(3) % ns
  tile = (BC, BC)
  ii, jj = _iota(tile, 0), _iota(tile, 1)
  rows = _sub(T)
  load_q = lambda I: _f32(q_ref[_sub(I), :]) * cfg.scale
  load_k = lambda I: _f32(k_ref[_sub(I), :])
  load_G = lambda I: G_ref[_sub(I), :]
  load_r = lambda I: G_ref[pl.ds(I * BC, 1), :]  # the reference r_I (first row of tile I)
  G_T, k_T, q_T, r_T = load_G(T), load_k(T), load_q(T), load_r(T)
  z = jnp.zeros_like(G_T)
  dp_d = jnp.where(ii >= jj, dP_ref[rows, rows], 0.0)  # the diagonal tile, causal
  dx_d = jnp.where(ii > jj, dX_ref[rows, rows], 0.0)

  # Query side off the diagonal, J < T: both decay factors <= 1, one TF32 dot (fla's choice).
  def query_pair(J, acc):
    left_q, left_k = acc
    kb = load_k(J) * jnp.exp(r_T - load_G(J))
    return (left_q + _hd(cfg, dP_ref[rows, _sub(J)], kb),
            left_k + _hd(cfg, dX_ref[rows, _sub(J)], kb))

  left_q, left_k = lax.fori_loop(0, T, query_pair, (z, z))
  e_t = jnp.exp(G_T - r_T)
  # Key side off the diagonal, I > T.
  def key_pair(I, right):
    r_I = load_r(I)
    e_i = jnp.exp(load_G(I) - r_I)
    t = (_hd(cfg, dP_ref[_sub(I), rows].T, load_q(I) * e_i)
         + _hd(cfg, dX_ref[_sub(I), rows].T, load_k(I) * e_i))
    return right + jnp.exp(r_I - G_T) * t

  right = lax.fori_loop(T + 1, ns, key_pair, z)
  if cfg.exact_diag:  # exact pairwise decays on the diagonal tile (any gate)
    def pair_step(j, acc):
      left_q, left_k, right = acc
      e = jnp.exp(jnp.minimum(G_T - _row(G_T, j), 0.0))
      kje = _row(k_T, j) * e
      dpj, dxj = _col(dp_d, j), _col(dx_d, j)
      rrow = jnp.sum((dpj * q_T + dxj * k_T) * e, axis=0, keepdims=True)
      return (left_q + dpj * kje, left_k + dxj * kje,
              jnp.where(_iota(right.shape, 0) == j, right + rrow, right))

    dlq, dlk, right = lax.fori_loop(0, BC, pair_step, (z, z, right))
    left_q, left_k = e_t * left_q + dlq, e_t * left_k + dlk
  else:  # factored diagonal tile: the key factor reaches e^{15|g|}, so three TF32 passes
    kb = k_T * jnp.exp(r_T - G_T)
    left_q = e_t * (left_q + _hd3(cfg, dp_d, kb))
    left_k = e_t * (left_k + _hd3(cfg, dx_d, kb))
    right = right + jnp.exp(r_T - G_T) * (_hd3(cfg, dp_d.T, q_T * e_t)
                                          + _hd3(cfg, dx_d.T, k_T * e_t))
  dq_ref[...] = (dqp_ref[...] + cfg.scale * left_q).astype(dq_ref.dtype)
  dk_ref[...] = (dkp_ref[...] + left_k + right).astype(dk_ref.dtype)
  dG_ref[...] = dGp_ref[...] + q_T * left_q + k_T * (left_k - right)


def _gate_bwd_kernel(cfg: KernelConfig, normed, g_ref, dG_ref, *refs):
  """dg = reverse cumsum of dG within the chunk (G is the inclusive cumsum of the log gate), then
  through the fused gate to its input (written in the input's dtype), with the per-token A_log
  gradient terms and the chunk's column sums of dg in fp32 (dt_bias's gradient: its sum over
  tokens is taken here, so no fp32 dg is written and read back for it).

  With `normed` (q/k L2 norm in the forward) it also takes dq, dk through the norm: for
  xn = x r, r = (Σ x² + eps)^{-1/2}, dx = r (dxn − xn <xn, dxn>), from the raw x and r of the
  forward; the chunk's whole rows are this program's, and this spares an XLA pass that read
  x and dxn and wrote dx again (RESULTS.md run 8)."""
  ng = 0 if cfg.gate == "none" else 2
  nn = 6 if normed else 0
  norm_refs, gate_refs, out_refs = refs[:nn], refs[nn:nn + ng], refs[nn + ng:]
  if normed:
    q_ref, k_ref, dqn_ref, dkn_ref, rq_ref, rk_ref = norm_refs
    dq_ref, dk_ref = out_refs[-2:]
    out_refs = out_refs[:-2]
    for x_ref, r_ref, dxn_ref, dx_ref in ((q_ref, rq_ref, dqn_ref, dq_ref),
                                          (k_ref, rk_ref, dkn_ref, dk_ref)):
      r = r_ref[...][:, None]
      xn, dxn = _f32(x_ref[...]) * r, _f32(dxn_ref[...])
      dx = r * (dxn - xn * jnp.sum(xn * dxn, axis=1, keepdims=True))
      dx_ref[...] = dx.astype(dx_ref.dtype)
  dG = dG_ref[...]
  dg = jnp.sum(dG, axis=0, keepdims=True) - lax.cumsum(dG, axis=0) + dG
  if cfg.gate == "none":
    out_refs[0][...] = dg.astype(out_refs[0].dtype)
    return
  dg_ref, da_ref, ddt_ref = out_refs
  a_log, dt = _gate_refs(cfg, gate_refs, pl.program_id(2), slice(None))
  ea = jnp.exp(a_log)
  u = _f32(g_ref[...]) + dt
  if cfg.gate == "bounded":
    z = ea * u
    sg = jax.nn.sigmoid(z)
    dz = dg * (cfg.lower_bound * sg * (1.0 - sg))
    dx = dz * ea
    # z = -inf on padding (g = 0 there): its gradient factor is 0, keep 0·inf out.
    da_ref[...] = jnp.sum(jnp.where(dz != 0.0, dz * z, 0.0), axis=1)
  else:
    gval = -ea * jax.nn.softplus(u)
    dx = dg * (-ea) * jax.nn.sigmoid(u)
    da_ref[...] = jnp.sum(jnp.where(dg != 0.0, dg * gval, 0.0), axis=1)
  dg_ref[...] = dx.astype(dg_ref.dtype)
  ddt_ref[...] = jnp.sum(dx, axis=0)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
def _require_normalized(cfg, name):
  if cfg.qk_l2norm:
    raise ValueError(f"{name} reads q and k themselves and takes them normalised: cfg.qk_l2norm "
                     "must be False (gate_fwd writes them for a backward)")


def scan_bwd(cfg, qg, kg, G, W, P, do, dht, seq, first, last, dseg=None):
  """Returns dS per chunk end [B,NT,H,K,V] fp32, dVn [B,T,H,V] fp32, dh0 like dht."""
  _check_seg(cfg, dseg)
  B, T, H, K = qg.shape
  V = do.shape[-1]
  C = cfg.chunk
  nt = T // C
  bv = _bv(V, cfg.tuning.bv_bwd)
  args = [qg, kg, G, W, P, do, dht, seq, first, last] + ([dseg] if cfg.segmented else [])
  return pl.pallas_call(
      functools.partial(_scan_bwd_kernel, cfg, nt, bv),
      grid=(B, H, V // bv),
      out_shape=[jax.ShapeDtypeStruct((B, nt, H, K, V), jnp.float32),
                 jax.ShapeDtypeStruct((B, T, H, V), jnp.float32),
                 jax.ShapeDtypeStruct(dht.shape, jnp.float32)],
      input_output_aliases={6: 2},
      interpret=cfg.interpret, name="kda_scan_bwd", **_params(cfg, cfg.tuning.scan_bwd_launch),
  )(*args)


def dense_bwd(cfg, q, k, v, beta, G, vn, M, X, hs, dhs, dvn, do, dseg=None):
  """Returns dP, dX [B,NT,H,C,C]; partial dq, dk, dG [B,T,H,K] fp32; dv [B,T,H,V]; dbeta [B,T,H]."""
  _require_normalized(cfg, "dense_bwd")
  _check_seg(cfg, dseg)
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = cfg.chunk
  nt = T // C
  f32 = jnp.float32
  mat = jax.ShapeDtypeStruct((B, nt, H, C, C), f32)
  tokk = jax.ShapeDtypeStruct((B, T, H, K), f32)
  in_specs = [_tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, V), _vec_spec(C), _tok_spec(C, K),
              _tok_spec(C, V), _mat_spec(C), _mat_spec(C), _state_spec(K, V), _state_spec(K, V),
              _tok_spec(C, V), _tok_spec(C, V)]
  args = [q, k, v, beta, G, vn, M, X, hs, dhs, dvn, do]
  if cfg.segmented:
    in_specs.append(_seg_spec(C))
    args.append(dseg)
  return pl.pallas_call(
      functools.partial(_dense_bwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=in_specs,
      out_specs=[_mat_spec(C), _mat_spec(C), _tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, K),
                 _tok_spec(C, V), _vec_spec(C)],
      out_shape=[mat, mat, tokk, tokk, tokk, jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                 jax.ShapeDtypeStruct((B, T, H), f32)],
      interpret=cfg.interpret, name="kda_dense_bwd", **_params(cfg, cfg.tuning.dense_bwd_launch),
  )(*args)


def intra_bwd(cfg, q, k, g, G, dP, dX, dq, dk, dG, a_log=None, dt_bias=None, norm=None):
  """Pair terms (`_intra_bwd_kernel`) then the gate's backward (`_gate_bwd_kernel`).

  Returns dq, dk [B,T,H,K] (input dtype), dg [B,T,H,K] in g.dtype (w.r.t. the gate input) and,
  for a fused gate, the per-token A_log gradient terms [B,T,H] fp32 and the per-chunk sums of dg
  over its tokens [B,NT,H,K] fp32 (dt_bias's gradient summed over B and NT). dP and dX come
  masked (causal, within documents) from `dense_bwd`. q, k are the normalised ones when the
  forward normalised them; then `norm` = (q_raw, k_raw, r_q, r_k) (r [B,T,H] fp32, gate_fwd's)
  and the returned dq, dk are w.r.t. the raw q, k (the norm's gradient is taken in gate_bwd)."""
  _require_normalized(cfg, "intra_bwd")
  B, T, H, K = q.shape
  C, ns = cfg.chunk, cfg.ns
  nt = T // C
  bk = _block(K, cfg.tuning.intra_bwd_bk, "tuning.intra_bwd_bk")
  f32 = jnp.float32
  chunk = pl.BlockSpec((None, C, None, bk), lambda b, c, h, p: (b, c, h, p // ns))
  tile = pl.BlockSpec((None, BC, None, bk), lambda b, c, h, p: (b, c * ns + p % ns, h, p // ns))
  mat = pl.BlockSpec((None, None, None, C, C), lambda b, c, h, p: (b, c, h, 0, 0))
  dq, dk, dG = pl.pallas_call(
      functools.partial(_intra_bwd_kernel, cfg),
      grid=(B, nt, H, (K // bk) * ns),
      in_specs=[chunk] * 3 + [mat] * 2 + [tile] * 3, out_specs=[tile] * 3,
      out_shape=[jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
                 jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
                 jax.ShapeDtypeStruct((B, T, H, K), f32)],
      interpret=cfg.interpret, name="kda_intra_bwd", **_params(cfg, cfg.tuning.intra_bwd_launch),
  )(q, k, G, dP, dX, dq, dk, dG)
  in_specs = [_tok_spec(C, K)] * 2
  args = [g, dG]
  out_specs = [_tok_spec(C, K)]
  out_shape = [jax.ShapeDtypeStruct((B, T, H, K), g.dtype)]
  if norm is not None:
    q_raw, k_raw, rq, rk = norm
    in_specs += [_tok_spec(C, K)] * 4 + [_vec_spec(C)] * 2
    args += [q_raw, k_raw, dq, dk, rq, rk]
  if cfg.gate != "none":
    in_specs += _gate_specs(H, K)
    args += [a_log.astype(f32), dt_bias.astype(f32)]
    out_specs += [_vec_spec(C), pl.BlockSpec((None, None, None, K), lambda b, c, h: (b, c, h, 0))]
    out_shape += [jax.ShapeDtypeStruct((B, T, H), f32), jax.ShapeDtypeStruct((B, nt, H, K), f32)]
  if norm is not None:
    out_specs += [_tok_spec(C, K)] * 2
    out_shape += [jax.ShapeDtypeStruct((B, T, H, K), q_raw.dtype),
                  jax.ShapeDtypeStruct((B, T, H, K), k_raw.dtype)]
  outs = pl.pallas_call(
      functools.partial(_gate_bwd_kernel, cfg, norm is not None),
      grid=(B, nt, H),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=cfg.interpret, name="kda_gate_bwd", **_params(cfg, cfg.tuning.gate_bwd_launch),
  )(*args)
  if norm is not None:
    dq, dk, outs = outs[-2], outs[-1], outs[:-2]
  return (dq, dk) + tuple(outs)
