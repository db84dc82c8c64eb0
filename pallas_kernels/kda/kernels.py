"""Pallas (Triton lowering) kernels of chunked Kimi Delta Attention, forward and backward.

All kernels work on chunk-aligned sequences: time is a multiple of the chunk C = 64, split into
NS = C/16 sub-tiles of BC = 16 rows. Layouts follow fla: q, k, g, G, W `[B, T, H, K]`; v, U, o
`[B, T, H, V]`; beta `[B, T, H]`; per-chunk C×C matrices `[B, NT, H, C, C]` fp32; per-chunk states
`[B, NT, H, K, V]`; initial/final states `[N + 1, H, K, V]` fp32 (row N is a dummy for chunks that
belong to no sequence). Chunk metadata `[B, NT]` int32: the sequence index of each chunk and whether
the chunk starts / ends its sequence (the state is reset / emitted there).

Math per chunk (scale s folded into q, G = in-chunk inclusive cumsum of the log gate g, b = G_{C-1}):
  X = strict_lower(Σ_d k_i k_j e^{G_i - G_j})       L = diag(β) X
  P = lower(Σ_d s q_i k_j e^{G_i - G_j})             (diagonal included)
  M = (I + L)^{-1}                                   W = M (β k e^G),  U = M (β v)
  scan:  Vn = U - W S,  o = (s q e^G) S + P Vn,  S' = e^b ⊙ S + (k e^{b-G})ᵀ Vn.

Pairwise decays e^{G_i - G_j} are only formed as products of two factors around a reference r,
e^{G_i - r} · e^{r - G_j}, where r is G at the first row of the query sub-tile (a causal reference: it
never reads a gate after row i). Across sub-tiles (j in an earlier sub-tile) both factors are ≤ 1 for
any gate. On the diagonal 16×16 tiles the key factor reaches e^{15·|g|max}; this is finite only for
bounded gates (|g| ≤ 5 ⇒ ≤ e^75). With `exact_diag=True` the diagonal tiles instead use exact
pairwise differences e^{min(G_i - G_j, 0)} (16 rank-1 steps on the vector units), valid for any g ≤ 0.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

BC = 16  # sub-tile rows: the smallest tensor-core dot


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static configuration shared by the kernels.

  Attributes:
    chunk: chunk length C (multiple of 16).
    scale: query scale s.
    mm_dtype: operand dtype of the large dots (bf16 for bf16 inputs, fp32 otherwise).
    exact_diag: exact pairwise decays on the diagonal sub-tiles (any gate) instead of factored dots.
    gate: 'none' (g is the log decay), 'bounded' (lower_bound·sigmoid(exp(A_log)·(g + dt_bias))) or
      'softplus' (-exp(A_log)·softplus(g + dt_bias)).
    lower_bound: bound of the 'bounded' gate.
    interpret: run in the Pallas interpreter.
    num_warps: Triton warps for the chunk-parallel kernels.
    state_dtype: dtype of the saved per-chunk states and of W, U.
  """
  chunk: int
  scale: float
  mm_dtype: object
  exact_diag: bool
  gate: str
  lower_bound: float
  interpret: bool
  num_warps: int = 4
  state_dtype: object = jnp.float32

  @property
  def ns(self) -> int:
    return self.chunk // BC


def _params(cfg: KernelConfig, num_warps=None, num_stages=None):
  if cfg.interpret:
    return {}
  return dict(compiler_params=pl_triton.CompilerParams(
      num_warps=num_warps or cfg.num_warps, num_stages=num_stages or 1))


def _f32(x):
  return x.astype(jnp.float32)


def _mm(cfg, a, b):
  """Large dot: bf16 operands for bf16 inputs, exact fp32 otherwise; fp32 accumulation."""
  if cfg.mm_dtype == jnp.float32:
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
  return jnp.dot(a.astype(cfg.mm_dtype), b.astype(cfg.mm_dtype), preferred_element_type=jnp.float32)


def _hd(cfg, a, b):
  """fp32-operand dot: exact fp32 for fp32 inputs, TF32 tensor cores for bf16 inputs."""
  prec = lax.Precision.HIGHEST if cfg.mm_dtype == jnp.float32 else lax.Precision.DEFAULT
  return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=prec,
                 preferred_element_type=jnp.float32)


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, i):
  """Row i of a 2D register tile as a [1, n] array (masked reduction: Triton cannot slice values)."""
  return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _col(x, j):
  """Column j of a 2D register tile as a [m, 1] array."""
  return jnp.sum(jnp.where(_iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


def _activate_gate(cfg, graw, a_log, dt):
  """Log decay from the kernel's gate input: graw [n, K] fp32, a_log scalar, dt [1, K]."""
  if cfg.gate == "none":
    return graw
  u = graw + dt
  if cfg.gate == "bounded":
    return cfg.lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * u)
  return -jnp.exp(a_log) * jax.nn.softplus(u)


def _gate_refs(cfg, gate_refs, h):
  if cfg.gate == "none":
    return None, None
  alog_ref, dt_ref = gate_refs
  return alog_ref[h].astype(jnp.float32), dt_ref[...].astype(jnp.float32)[None, :]


# ----------------------------------------------------------------------------------------------
# Forward 1: gate, in-chunk cumsum, X / P tiles and the inverses of the diagonal blocks of I + L.
# ----------------------------------------------------------------------------------------------
def _intra_fwd_kernel(cfg: KernelConfig, q_ref, k_ref, g_ref, beta_ref, *refs):
  ng = 0 if cfg.gate == "none" else 2
  gate_refs, (G_ref, X_ref, P_ref, D_ref) = refs[:ng], refs[ng:]
  h = pl.program_id(2)
  a_log, dt = _gate_refs(cfg, gate_refs, h)
  ns, K = cfg.ns, q_ref.shape[-1]
  tile = (BC, BC)
  ii, jj = _iota(tile, 0), _iota(tile, 1)
  zeros_tile = jnp.zeros(tile, jnp.float32)

  carry = jnp.zeros((1, K), jnp.float32)
  Gs, refs_r, qs, ks = [], [], [], []
  for I in range(ns):
    rows = pl.ds(I * BC, BC)
    g = _activate_gate(cfg, _f32(g_ref[rows, :]), a_log, dt)
    G = lax.cumsum(g, axis=0) + carry
    carry = carry + jnp.sum(g, axis=0, keepdims=True)
    G_ref[rows, :] = G
    Gs.append(G)
    refs_r.append(_row(G, 0))
    qs.append(_f32(q_ref[rows, :]) * cfg.scale)
    ks.append(_f32(k_ref[rows, :]))

  for I in range(ns):
    rows = pl.ds(I * BC, BC)
    e_i = jnp.exp(Gs[I] - refs_r[I])  # ≤ 1
    qa, ka = qs[I] * e_i, ks[I] * e_i
    for J in range(ns):
      cols = pl.ds(J * BC, BC)
      if J > I:
        X_ref[rows, cols] = zeros_tile
        P_ref[rows, cols] = zeros_tile
        D_ref[rows, cols] = zeros_tile
        continue
      if J < I or not cfg.exact_diag:
        kb = ks[J] * jnp.exp(refs_r[I] - Gs[J])  # ≤ 1 off the diagonal, ≤ e^{15|g|} on it
        x = _hd(cfg, ka, kb.T)
        p = _hd(cfg, qa, kb.T)
      else:
        def pair_step(j, xp, G=Gs[I], kt=ks[I], qt=qs[I]):
          x, p = xp
          e = jnp.exp(jnp.minimum(G - _row(G, j), 0.0))
          kje = _row(kt, j) * e
          x = x + jnp.where(jj == j, jnp.sum(kt * kje, axis=1, keepdims=True), 0.0)
          p = p + jnp.where(jj == j, jnp.sum(qt * kje, axis=1, keepdims=True), 0.0)
          return x, p

        x, p = lax.fori_loop(0, BC, pair_step, (zeros_tile, zeros_tile))
      if J == I:
        x = jnp.where(ii > jj, x, 0.0)
        p = jnp.where(ii >= jj, p, 0.0)
        # (I + L_II)^{-1} by forward substitution, one row at a time.
        beta = _f32(beta_ref[rows])[:, None]
        lmat = beta * x
        def subst_step(i, inv, lmat=lmat):
          li = _row(lmat, i)  # [1, BC]
          new = jnp.sum(li.T * inv, axis=0, keepdims=True)  # l_i @ inv (rows < i are final)
          return jnp.where(ii == i, inv - new, inv)

        inv = lax.fori_loop(1, BC, subst_step, jnp.where(ii == jj, 1.0, 0.0))
        D_ref[rows, cols] = inv
      else:
        D_ref[rows, cols] = zeros_tile
      X_ref[rows, cols] = x
      P_ref[rows, cols] = p


# ----------------------------------------------------------------------------------------------
# Forward 2: merge the block inverses into M = (I + L)^{-1}; W = M (β k e^G), U = M (β v).
# ----------------------------------------------------------------------------------------------
def _wy_fwd_kernel(cfg: KernelConfig, k_ref, v_ref, beta_ref, G_ref, X_ref, D_ref,
                   M_ref, W_ref, U_ref):
  C = cfg.chunk
  ii, jj = _iota((C, C), 0), _iota((C, C), 1)
  beta = _f32(beta_ref[...])[:, None]
  lmat = beta * X_ref[...]
  l_off = jnp.where(ii // BC > jj // BC, lmat, 0.0)
  dinv = D_ref[...]
  # I + L = (I + L_diag)(I + N), N = D L_off strictly block-lower (N^NS = 0), so
  # (I + L)^{-1} = (I - N + N² - N³ ...) D, evaluated as a product of (I + (-N)^{2^m}) factors.
  n = _hd(cfg, dinv, l_off)
  m = dinv
  power = -n
  steps = (cfg.ns - 1).bit_length()
  for step in range(steps):  # m ← (I + (-N)^{2^step}) m
    m = m + _hd(cfg, power, m)
    if step + 1 < steps:
      power = _hd(cfg, power, power)
  M_ref[...] = m
  kb = beta * _f32(k_ref[...]) * jnp.exp(G_ref[...])
  vb = beta * _f32(v_ref[...])
  W_ref[...] = _mm(cfg, m, kb).astype(W_ref.dtype)
  U_ref[...] = _mm(cfg, m, vb).astype(U_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Forward 3: sequential scan over chunks (one program per batch row, head and V block).
# ----------------------------------------------------------------------------------------------
def _scan_fwd_kernel(cfg: KernelConfig, nt, bv, q_ref, k_ref, G_ref, W_ref, U_ref, P_ref, h0_ref,
                     seq_ref, first_ref, last_ref, o_ref, hs_ref, ht_ref):
  b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, K = cfg.chunk, q_ref.shape[-1]
  vs = pl.ds(iv * bv, bv)

  def body(c, s):
    t0 = c * C
    rows = pl.ds(t0, C)
    seq = seq_ref[b, c]
    s = lax.cond(first_ref[b, c] != 0, lambda: h0_ref[seq, h, :, vs].astype(jnp.float32),
                 lambda: s)
    hs_ref[b, c, h, :, vs] = s.astype(hs_ref.dtype)
    G = G_ref[b, rows, h, :]
    gb = G_ref[b, t0 + C - 1, h, :][None, :]
    vn = _f32(U_ref[b, rows, h, vs]) - _mm(cfg, W_ref[b, rows, h, :], s)
    qg = _f32(q_ref[b, rows, h, :]) * (cfg.scale * jnp.exp(G))
    o = _mm(cfg, qg, s) + _mm(cfg, P_ref[b, c, h, :, :], vn)
    o_ref[b, rows, h, vs] = o.astype(o_ref.dtype)
    kg = _f32(k_ref[b, rows, h, :]) * jnp.exp(gb - G)
    s = jnp.exp(gb).T * s + _mm(cfg, kg.T, vn)

    @pl.when(last_ref[b, c] != 0)
    def _():
      ht_ref[seq, h, :, vs] = s

    return s

  lax.fori_loop(0, nt, body, jnp.zeros((K, bv), jnp.float32))


# ----------------------------------------------------------------------------------------------
# Backward 1: reverse scan for dS (gradient of each chunk's end state) and dVn.
# ----------------------------------------------------------------------------------------------
def _scan_bwd_kernel(cfg: KernelConfig, nt, bv, q_ref, k_ref, G_ref, W_ref, P_ref, do_ref, dht_ref,
                     seq_ref, first_ref, last_ref, dhs_ref, dvn_ref, dh0_ref):
  b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, K = cfg.chunk, q_ref.shape[-1]
  vs = pl.ds(iv * bv, bv)

  def body(i, ds):
    c = nt - 1 - i
    t0 = c * C
    rows = pl.ds(t0, C)
    seq = seq_ref[b, c]
    ds = lax.cond(last_ref[b, c] != 0, lambda: dht_ref[seq, h, :, vs].astype(jnp.float32),
                  lambda: ds)
    dhs_ref[b, c, h, :, vs] = ds.astype(dhs_ref.dtype)
    G = G_ref[b, rows, h, :]
    gb = G_ref[b, t0 + C - 1, h, :][None, :]
    do = _f32(do_ref[b, rows, h, vs])
    kg = _f32(k_ref[b, rows, h, :]) * jnp.exp(gb - G)
    dvn = _mm(cfg, P_ref[b, c, h, :, :].T, do) + _mm(cfg, kg, ds)
    dvn_ref[b, rows, h, vs] = dvn
    qg = _f32(q_ref[b, rows, h, :]) * (cfg.scale * jnp.exp(G))
    ds = jnp.exp(gb).T * ds + _mm(cfg, qg.T, do) - _mm(cfg, W_ref[b, rows, h, :].T, dvn)

    @pl.when(first_ref[b, c] != 0)
    def _():
      dh0_ref[seq, h, :, vs] = ds

    return ds

  lax.fori_loop(0, nt, body, jnp.zeros((K, bv), jnp.float32))


# ----------------------------------------------------------------------------------------------
# Backward 2: dense per-chunk gradients (WY representation, inter-chunk terms, dP, dX).
# ----------------------------------------------------------------------------------------------
def _dense_bwd_kernel(cfg: KernelConfig, q_ref, k_ref, v_ref, beta_ref, G_ref, W_ref, U_ref,
                      M_ref, X_ref, hs_ref, dhs_ref, dvn_ref, do_ref,
                      dP_ref, dX_ref, dq_ref, dk_ref, dG_ref, dv_ref, dbeta_ref):
  C = cfg.chunk
  ii, jj = _iota((C, C), 0), _iota((C, C), 1)
  s = _f32(hs_ref[...])
  ds = dhs_ref[...]
  dvn = dvn_ref[...]
  do = _f32(do_ref[...])
  G = G_ref[...]
  gb = G_ref[pl.ds(C - 1, 1), :]
  eg = jnp.exp(G)
  egb = jnp.exp(gb - G)
  q = _f32(q_ref[...]) * cfg.scale
  k = _f32(k_ref[...])
  v = _f32(v_ref[...])
  beta = _f32(beta_ref[...])[:, None]
  m = M_ref[...]

  vn = _f32(U_ref[...]) - _mm(cfg, W_ref[...], s)
  dP_ref[...] = jnp.where(ii >= jj, _mm(cfg, do, vn.T), 0.0)
  dw = -_mm(cfg, dvn, s.T)
  dqg = _mm(cfg, do, s.T)      # gradient of q e^G (scaled q)
  dkg = _mm(cfg, vn, ds.T)     # gradient of k e^{b-G}
  kt = k * eg
  kb, vb = beta * kt, beta * v
  dm = jnp.where(ii >= jj, _mm(cfg, dw, kb.T) + _mm(cfg, dvn, vb.T), 0.0)
  dkb = _mm(cfg, m.T, dw)
  dvb = _mm(cfg, m.T, dvn)
  dv_ref[...] = (beta * dvb).astype(dv_ref.dtype)
  # M = (I + L)^{-1}  ⇒  dL = -Mᵀ dM Mᵀ (strictly lower part).
  dl = -_hd(cfg, _hd(cfg, m.T, dm), m.T)
  dl = jnp.where(ii > jj, dl, 0.0)
  x = X_ref[...]
  dbeta = jnp.sum(dvb * v, axis=1) + jnp.sum(dkb * kt, axis=1) + jnp.sum(dl * x, axis=1)
  dbeta_ref[...] = dbeta
  dX_ref[...] = beta * dl
  dkt = beta * dkb
  kgv = k * egb
  dq_ref[...] = cfg.scale * dqg * eg
  dk_ref[...] = dkt * eg + dkg * egb
  dG = dqg * q * eg + dkt * kt - dkg * kgv
  db = jnp.exp(gb) * jnp.sum(s * ds, axis=1)[None, :] + jnp.sum(dkg * kgv, axis=0, keepdims=True)
  dG_ref[...] = jnp.where(_iota(dG.shape, 0) == C - 1, dG + db, dG)


# ----------------------------------------------------------------------------------------------
# Backward 3: intra-chunk pair terms from dP, dX (sub-tiled), reverse cumsum, gate backward.
# ----------------------------------------------------------------------------------------------
def _intra_bwd_kernel(cfg: KernelConfig, q_ref, k_ref, g_ref, G_ref, dP_ref, dX_ref, dqp_ref,
                      dkp_ref, dGp_ref, *refs):
  ng = 0 if cfg.gate == "none" else 2
  gate_refs, out_refs = refs[:ng], refs[ng:]
  if cfg.gate == "none":
    dq_ref, dk_ref, dg_ref = out_refs
  else:
    dq_ref, dk_ref, dg_ref, da_ref = out_refs
  h = pl.program_id(2)
  ns = cfg.ns
  tile = (BC, BC)
  ii, jj = _iota(tile, 0), _iota(tile, 1)

  Gs, rs, qs, ks, dqs, dks, dGs = [], [], [], [], [], [], []
  for I in range(ns):
    rows = pl.ds(I * BC, BC)
    G = G_ref[rows, :]
    Gs.append(G)
    rs.append(_row(G, 0))
    qs.append(_f32(q_ref[rows, :]) * cfg.scale)
    ks.append(_f32(k_ref[rows, :]))
    dqs.append(dqp_ref[rows, :])
    dks.append(dkp_ref[rows, :])
    dGs.append(dGp_ref[rows, :])

  for I in range(ns):
    rows = pl.ds(I * BC, BC)
    e_i = jnp.exp(Gs[I] - rs[I])
    qa, ka = qs[I] * e_i, ks[I] * e_i
    for J in range(I + 1):
      cols = pl.ds(J * BC, BC)
      dp = dP_ref[rows, cols]
      dx = dX_ref[rows, cols]
      if J == I:
        dp = jnp.where(ii >= jj, dp, 0.0)
        dx = jnp.where(ii > jj, dx, 0.0)
      if J < I or not cfg.exact_diag:
        e_j = jnp.exp(rs[I] - Gs[J])
        kb = ks[J] * e_j
        left_q = e_i * _hd(cfg, dp, kb)
        left_k = e_i * _hd(cfg, dx, kb)
        right = e_j * (_hd(cfg, dp.T, qa) + _hd(cfg, dx.T, ka))
      else:
        def pair_step(j, acc, G=Gs[I], kt=ks[I], qt=qs[I], dp=dp, dx=dx):
          left_q, left_k, right = acc
          e = jnp.exp(jnp.minimum(G - _row(G, j), 0.0))
          kje = _row(kt, j) * e
          dpj, dxj = _col(dp, j), _col(dx, j)
          left_q = left_q + dpj * kje
          left_k = left_k + dxj * kje
          rrow = jnp.sum((dpj * qt + dxj * kt) * e, axis=0, keepdims=True)
          right = jnp.where(_iota(right.shape, 0) == j, right + rrow, right)
          return left_q, left_k, right

        z = jnp.zeros_like(qs[I])
        left_q, left_k, right = lax.fori_loop(0, BC, pair_step, (z, z, z))
      dqs[I] = dqs[I] + cfg.scale * left_q
      dks[I] = dks[I] + left_k
      dGs[I] = dGs[I] + qs[I] * left_q + ks[I] * left_k
      dks[J] = dks[J] + right
      dGs[J] = dGs[J] - ks[J] * right

  h_a_log, dt = _gate_refs(cfg, gate_refs, h)
  tail = jnp.zeros_like(rs[0])
  for I in reversed(range(ns)):
    rows = pl.ds(I * BC, BC)
    dq_ref[rows, :] = dqs[I].astype(dq_ref.dtype)
    dk_ref[rows, :] = dks[I].astype(dk_ref.dtype)
    d = dGs[I]
    total = jnp.sum(d, axis=0, keepdims=True)
    dg = total - lax.cumsum(d, axis=0) + d + tail  # reverse cumsum within the chunk
    tail = tail + total
    if cfg.gate == "none":
      dg_ref[rows, :] = dg.astype(dg_ref.dtype)
      continue
    u = _f32(g_ref[rows, :]) + dt
    ea = jnp.exp(h_a_log)
    if cfg.gate == "bounded":
      z = ea * u
      sg = jax.nn.sigmoid(z)
      dz = dg * (cfg.lower_bound * sg * (1.0 - sg))
      dg_ref[rows, :] = (dz * ea).astype(dg_ref.dtype)
      # z = -inf on padding (g = 0 there): its gradient factor is 0, keep 0·inf out.
      da_ref[rows] = jnp.sum(jnp.where(dz != 0.0, dz * z, 0.0), axis=1)
    else:
      gval = -ea * jax.nn.softplus(u)
      dg_ref[rows, :] = (dg * (-ea) * jax.nn.sigmoid(u)).astype(dg_ref.dtype)
      da_ref[rows] = jnp.sum(jnp.where(dg != 0.0, dg * gval, 0.0), axis=1)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
def _tok_spec(C, d):
  return pl.BlockSpec((None, C, None, d), lambda b, c, h: (b, c, h, 0))


def _vec_spec(C):
  return pl.BlockSpec((None, C, None), lambda b, c, h: (b, c, h))


def _mat_spec(C):
  return pl.BlockSpec((None, None, None, C, C), lambda b, c, h: (b, c, h, 0, 0))


def _state_spec(K, V):
  return pl.BlockSpec((None, None, None, K, V), lambda b, c, h: (b, c, h, 0, 0))


def intra_fwd(cfg, q, k, g, beta, a_log=None, dt_bias=None):
  """Returns G [B,T,H,K] fp32 and X, P, D [B,NT,H,C,C] fp32."""
  B, T, H, K = q.shape
  C = cfg.chunk
  nt = T // C
  f32 = jnp.float32
  in_specs = [_tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, K), _vec_spec(C)]
  args = [q, k, g, beta]
  if cfg.gate != "none":
    in_specs += [pl.BlockSpec((H,), lambda b, c, h: (0,)),
                 pl.BlockSpec((None, K), lambda b, c, h: (h, 0))]
    args += [a_log.astype(f32), dt_bias.astype(f32)]
  mat = jax.ShapeDtypeStruct((B, nt, H, C, C), f32)
  return pl.pallas_call(
      functools.partial(_intra_fwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=in_specs,
      out_specs=[_tok_spec(C, K), _mat_spec(C), _mat_spec(C), _mat_spec(C)],
      out_shape=[jax.ShapeDtypeStruct((B, T, H, K), f32), mat, mat, mat],
      interpret=cfg.interpret, name="kda_intra_fwd", **_params(cfg),
  )(*args)


def wy_fwd(cfg, k, v, beta, G, X, D):
  """Returns M [B,NT,H,C,C] fp32, W [B,T,H,K] and U [B,T,H,V] (cfg.state_dtype)."""
  B, T, H, K = k.shape
  V = v.shape[-1]
  C = cfg.chunk
  nt = T // C
  return pl.pallas_call(
      functools.partial(_wy_fwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=[_tok_spec(C, K), _tok_spec(C, V), _vec_spec(C), _tok_spec(C, K), _mat_spec(C),
                _mat_spec(C)],
      out_specs=[_mat_spec(C), _tok_spec(C, K), _tok_spec(C, V)],
      out_shape=[jax.ShapeDtypeStruct((B, nt, H, C, C), jnp.float32),
                 jax.ShapeDtypeStruct((B, T, H, K), cfg.state_dtype),
                 jax.ShapeDtypeStruct((B, T, H, V), cfg.state_dtype)],
      interpret=cfg.interpret, name="kda_wy_fwd", **_params(cfg),
  )(k, v, beta, G, X, D)


def _bv(V):
  return min(V, 64)


def scan_fwd(cfg, q, k, G, W, U, P, h0, seq, first, last, out_dtype):
  """Returns o [B,T,H,V], per-chunk start states [B,NT,H,K,V], final states like h0."""
  B, T, H, K = q.shape
  V = U.shape[-1]
  C = cfg.chunk
  nt = T // C
  bv = _bv(V)
  return pl.pallas_call(
      functools.partial(_scan_fwd_kernel, cfg, nt, bv),
      grid=(B, H, V // bv),
      out_shape=[jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
                 jax.ShapeDtypeStruct((B, nt, H, K, V), cfg.state_dtype),
                 jax.ShapeDtypeStruct(h0.shape, jnp.float32)],
      input_output_aliases={6: 2},  # sequences with no chunk keep their initial state
      interpret=cfg.interpret, name="kda_scan_fwd", **_params(cfg),
  )(q, k, G, W, U, P, h0, seq, first, last)


def scan_bwd(cfg, q, k, G, W, P, do, dht, seq, first, last):
  """Returns dS per chunk end [B,NT,H,K,V] fp32, dVn [B,T,H,V] fp32, dh0 like dht."""
  B, T, H, K = q.shape
  V = do.shape[-1]
  C = cfg.chunk
  nt = T // C
  bv = _bv(V)
  return pl.pallas_call(
      functools.partial(_scan_bwd_kernel, cfg, nt, bv),
      grid=(B, H, V // bv),
      out_shape=[jax.ShapeDtypeStruct((B, nt, H, K, V), jnp.float32),
                 jax.ShapeDtypeStruct((B, T, H, V), jnp.float32),
                 jax.ShapeDtypeStruct(dht.shape, jnp.float32)],
      input_output_aliases={6: 2},
      interpret=cfg.interpret, name="kda_scan_bwd", **_params(cfg),
  )(q, k, G, W, P, do, dht, seq, first, last)


def dense_bwd(cfg, q, k, v, beta, G, W, U, M, X, hs, dhs, dvn, do):
  """Returns dP, dX [B,NT,H,C,C]; partial dq, dk, dG [B,T,H,K] fp32; dv [B,T,H,V]; dbeta [B,T,H]."""
  B, T, H, K = q.shape
  V = v.shape[-1]
  C = cfg.chunk
  nt = T // C
  f32 = jnp.float32
  mat = jax.ShapeDtypeStruct((B, nt, H, C, C), f32)
  tokk = jax.ShapeDtypeStruct((B, T, H, K), f32)
  return pl.pallas_call(
      functools.partial(_dense_bwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=[_tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, V), _vec_spec(C), _tok_spec(C, K),
                _tok_spec(C, K), _tok_spec(C, V), _mat_spec(C), _mat_spec(C), _state_spec(K, V),
                _state_spec(K, V), _tok_spec(C, V), _tok_spec(C, V)],
      out_specs=[_mat_spec(C), _mat_spec(C), _tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, K),
                 _tok_spec(C, V), _vec_spec(C)],
      out_shape=[mat, mat, tokk, tokk, tokk, jax.ShapeDtypeStruct((B, T, H, V), v.dtype),
                 jax.ShapeDtypeStruct((B, T, H), f32)],
      interpret=cfg.interpret, name="kda_dense_bwd", **_params(cfg),
  )(q, k, v, beta, G, W, U, M, X, hs, dhs, dvn, do)


def intra_bwd(cfg, q, k, g, G, dP, dX, dq, dk, dG, a_log=None, dt_bias=None):
  """Returns dq, dk [B,T,H,K] (input dtype), dg [B,T,H,K] fp32 (w.r.t. the gate input) and, for a
  fused gate, the per-token A_log gradient terms [B,T,H] fp32."""
  B, T, H, K = q.shape
  C = cfg.chunk
  nt = T // C
  f32 = jnp.float32
  in_specs = [_tok_spec(C, K)] * 4 + [_mat_spec(C)] * 2 + [_tok_spec(C, K)] * 3
  args = [q, k, g, G, dP, dX, dq, dk, dG]
  out_specs = [_tok_spec(C, K)] * 3
  out_shape = [jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
               jax.ShapeDtypeStruct((B, T, H, K), k.dtype),
               jax.ShapeDtypeStruct((B, T, H, K), f32)]
  if cfg.gate != "none":
    in_specs += [pl.BlockSpec((H,), lambda b, c, h: (0,)),
                 pl.BlockSpec((None, K), lambda b, c, h: (h, 0))]
    args += [a_log.astype(f32), dt_bias.astype(f32)]
    out_specs.append(_vec_spec(C))
    out_shape.append(jax.ShapeDtypeStruct((B, T, H), f32))
  return pl.pallas_call(
      functools.partial(_intra_bwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      interpret=cfg.interpret, name="kda_intra_bwd", **_params(cfg),
  )(*args)
