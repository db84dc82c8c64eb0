"""Pallas (Triton lowering) kernels of chunked Kimi Delta Attention, forward and backward.

All kernels work on chunk-aligned sequences: time is a multiple of the chunk C = 64, split into
NS = C/16 sub-tiles of BC = 16 rows. Layouts follow fla: q, k, g, G, W, kg `[B, T, H, K]`; v, U, Vn,
o `[B, T, H, V]`; beta `[B, T, H]`; per-chunk C×C matrices `[B, NT, H, C, C]` fp32; per-chunk
states `[B, NT, H, K, V]`; initial/final states `[N + 1, H, K, V]` fp32 (row N is a dummy for chunks
that belong to no sequence). Chunk metadata `[B, NT]` int32: the sequence index of each chunk and
whether the chunk starts / ends its sequence (the state is reset / emitted there).

Math per chunk (scale s folded into q, G = in-chunk inclusive cumsum of the log gate g, b = G_{C-1}):
  X = strict_lower(Σ_d k_i k_j e^{G_i - G_j})       L = diag(β) X
  P = lower(Σ_d s q_i k_j e^{G_i - G_j})             (diagonal included)
  M = (I + L)^{-1}                                   W = M (β k e^G),  U = M (β v)
  scan:  Vn = U - W S,  S' = e^b ⊙ S + (k e^{b-G})ᵀ Vn       (sequential over chunks)
  output: o = (s q e^G) S + P Vn                              (parallel over chunks)

Documents inside a chunk (segment ids): `dseg [B, T]` int32 numbers the documents within each
chunk (0 = the document the incoming state belongs to, +1 at every reset). A reset is the same as a
log decay of -inf before the token, which the kernels apply as masks instead of infinities: pair
terms (X, P) only within one document; the incoming state only reaches document 0 (rows of q e^G
and of β k e^G, hence of W, are masked); the outgoing state only keeps the chunk's last document
(rows of k e^{b-G} masked, e^b zeroed if the chunk has a reset). Within a document the cumsum G is
the plain one, so all decays are unchanged.

Pairwise decays e^{G_i - G_j} are only formed as products of two factors around a reference r,
e^{G_i - r} · e^{r - G_j}, where r is G at the first row of the query sub-tile (a causal reference: it
never reads a gate after row i). Across sub-tiles (j in an earlier sub-tile) both factors are ≤ 1 for
any gate. On the diagonal 16×16 tiles the key factor reaches e^{15·|g|max}; this is finite only for
bounded gates (|g| ≤ 5 ⇒ ≤ e^75). With `exact_diag=True` the diagonal tiles instead use exact
pairwise differences e^{min(G_i - G_j, 0)} (16 rank-1 steps on the vector units), valid for any g ≤ 0.

q/k L2 norm (`qk_l2norm`): gate_fwd reads the raw q, k, forms r = (Σ_d x² + 1e-6)^{-1/2} per token,
writes the gated operands of the normalised rows and r_q, r_k ([B, T, H] fp32) and, for a
backward, the normalised q, k; intra_fwd reads the raw q, k and scales its finished tiles,
X_ij · r_k,i r_k,j and P_ij · r_q,i r_k,j (each tile is bilinear in its rows). What this saves is
the XLA pass that normalised q and k before the kernels (a read and a write of both: 0.127 of
1.655 ms at (8, 4096, 16, 128)); the row sums cost gate_fwd ~0.1 ms of it (RESULTS.md run 7).
The backward's kernels read q, k themselves and take the normalised ones (dense_bwd and
intra_bwd refuse qk_l2norm); gate_bwd, which holds a chunk's whole rows, takes dq, dk through the
norm (intra_bwd's `norm`).

Kernels (grid: what one program does). Forward: gate_fwd (B, NT, H: the gate, G and the gated q /
k), intra_fwd (B, NT, H: one chunk, its K columns in blocks of `Tuning.intra_fwd_bk`, a loop; the
pair tiles and M), wy_fwd (B, NT, H), scan_fwd (B, H, V/bv: sequential over the chunks), out_fwd
(B, NT, H); the forward alone (no gradient) runs scan_out_fwd instead of the last two: the same scan
forming the outputs, with nothing stored for a backward.
Backward: scan_bwd (B, H, V/bv), dense_bwd (B, NT, H: loops over V and K blocks,
`Tuning.dense_bwd_bv` / `dense_bwd_bk`), intra_bwd (B, NT, H, K/bk · NS: one 16-row sub-tile and K
block), gate_bwd (B, NT, H). Small register tiles and many programs were what made the intra-chunk
kernels fast on the H200 (RESULTS.md, run 4); so was keeping the gate out of the pair kernel
(intra_fwd 1.07 → 0.66 ms, run 5).
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
L2NORM_EPS = 1e-6  # q/k L2 norm: x (Σ x² + eps)^{-1/2}, as k3jax.ops.kda.l2_normalize


@dataclasses.dataclass(frozen=True)
class Tuning:
  """Launch parameters and block sizes of the kernels (the interpreter ignores the launches).

  Each `*_launch` is (num_warps, num_stages); `bv_*` is the V block of the sequential scans (more
  blocks = more programs in parallel, each re-reading the chunk's K-side operands).
  `gate_fwd_bk` / `intra_fwd_bk` / `intra_bwd_bk` are the K blocks of the loops of `gate_fwd`,
  `intra_fwd` and `intra_bwd`; they apply in the interpreter too.
  `dense_bwd_bv` / `dense_bwd_bk`: the V and K blocks of `dense_bwd`'s loops.
  """
  intra_fwd_launch: tuple = (4, 1)
  wy_fwd_launch: tuple = (4, 1)
  scan_fwd_launch: tuple = (4, 1)
  out_fwd_launch: tuple = (4, 1)
  scan_bwd_launch: tuple = (4, 1)
  dense_bwd_launch: tuple = (4, 1)
  intra_bwd_launch: tuple = (4, 1)
  bv_fwd: int = 64
  bv_bwd: int = 64
  intra_fwd_bk: int = 64
  intra_bwd_bk: int = 64
  dense_bwd_bv: int = 128
  dense_bwd_bk: int = 128
  gate_bwd_launch: tuple = (4, 1)
  gate_fwd_launch: tuple = (4, 1)
  gate_fwd_bk: int = 64


def default_tuning(rows_heads: int, K: int, V: int) -> Tuning:
  """Launch parameters and blocks measured best on an H200 (RESULTS.md, runs 4 to 7) for B·H =
  rows_heads and head dims K, V.

  With few rows × heads the scans run on few programs: smaller V blocks (more programs) and a
  3-stage software pipeline over the chunk loop pay (measured at 16); from 48 on (medium.gin's
  4 rows × 12 heads, run 26: the KDA op's forward+backward 7.02 → 6.51 ms) 64-wide blocks do.
  gate_fwd (with the q/k norm inside since run 7) runs best on 4 warps over 64-column K blocks
  after a first pass for the norms, intra_fwd on one warp over 16-column K blocks, dense_bwd on 8
  warps over 64 × 64 (V, K) blocks, intra_bwd on 2 warps per 64-column K block. (A head dim that
  the block does not divide, possible in the interpreter, is one block.)
  """
  if rows_heads >= 48:   # scan_fwd 0.39 against 0.58 ms (16-wide) at 4 x 8192 x 12 (run 26)
    bv_fwd, bv_bwd, scan_bwd = 64, 64, (8, 3)
  else:  # 16-wide forward blocks since run 6 (scan_fwd 0.87 vs 1.03 ms for 32 at 1 x 32768 x 16)
    bv_fwd, bv_bwd, scan_bwd = 16, 16, (4, 3)
  fit = lambda block, width: block if width % block == 0 else width
  return Tuning(gate_fwd_launch=(4, 1), gate_fwd_bk=fit(64, K), intra_fwd_launch=(1, 1),
                intra_fwd_bk=fit(16, K), scan_fwd_launch=(4, 3),
                scan_bwd_launch=scan_bwd, dense_bwd_launch=(8, 1), dense_bwd_bv=fit(64, V),
                dense_bwd_bk=fit(64, K), intra_bwd_launch=(2, 1), intra_bwd_bk=fit(64, K),
                bv_fwd=min(bv_fwd, V), bv_bwd=min(bv_bwd, V))


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
    state_dtype: dtype of the saved per-chunk states and of W, U, Vn, kg.
    segmented: the kernels take `dseg` (documents within chunks, see the module docstring).
    qk_l2norm: gate_fwd and intra_fwd take raw q, k and normalise them (module docstring);
      dense_bwd and intra_bwd require False.
    tuning: launch parameters.
  """
  chunk: int
  scale: float
  mm_dtype: object
  exact_diag: bool
  gate: str
  lower_bound: float
  interpret: bool
  state_dtype: object = jnp.float32
  segmented: bool = False
  qk_l2norm: bool = False
  tuning: Tuning = Tuning()

  @property
  def ns(self) -> int:
    return self.chunk // BC


def _params(cfg: KernelConfig, launch):
  if cfg.interpret:
    return {}
  num_warps, num_stages = launch
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages))


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


def _gate_refs(cfg, gate_refs, h, cols):
  """A_log of head h (scalar) and dt_bias of the K columns `cols` ([1, bk]), fp32."""
  if cfg.gate == "none":
    return None, None
  alog_ref, dt_ref = gate_refs
  return alog_ref[h].astype(jnp.float32), dt_ref[cols].astype(jnp.float32)[None, :]


def _block(width: int, block: int, what: str) -> int:
  """The block size along a head dimension of `width`: min(block, width), which must divide it."""
  b = min(block, width)
  if width % b:
    raise ValueError(f"{what} ({block}) must divide the head dimension {width}")
  return b


def _sub(I):
  """Rows (or columns) of the 16-row sub-tile I of a chunk."""
  return pl.ds(I * BC, BC)


def _doc_masks(d):
  """From a chunk's document numbers d [C] int32: first-document rows [C, 1], last-document rows
  [C, 1] and whether the chunk has no reset (scalar), all boolean."""
  last = jnp.max(d)
  return (d == 0)[:, None], (d == last)[:, None], last == 0


# ----------------------------------------------------------------------------------------------
# Forward 1: the gate, its in-chunk cumsum G and the gated operands of the later kernels.
# ----------------------------------------------------------------------------------------------
def _gate_fwd_kernel(cfg: KernelConfig, normalized, q_ref, k_ref, g_ref, beta_ref, *refs):
  """G (fp32) and qg = s q e^G (the output's and the backward scan's queries), kb = β k e^G (W's
  keys), kg = k e^{b-G} (the state update's keys), K block by K block (`tuning.gate_fwd_bk`; every
  column is independent). Computed once here, they spare intra_fwd the gate and wy_fwd / out_fwd
  reading G and q / k back (fla's split: a gate/cumsum kernel before the pair kernel).

  With cfg.qk_l2norm, q and k come raw: they are L2-normalised first (over several K blocks a
  first loop sums the squares), their reciprocal norms r_q, r_k are written (intra_fwd's scales)
  and, with `normalized` (a training forward), the normalised q, k too (the backward's operands)."""
  gate_refs, dseg_ref, out_refs = _split_refs(cfg, refs)
  G_ref, qg_ref, kb_ref, kg_ref = out_refs[:4]
  rq_ref, rk_ref = out_refs[4:6] if cfg.qk_l2norm else (None, None)
  qn_ref, kn_ref = out_refs[6:8] if normalized else (None, None)
  h = pl.program_id(2)
  C, K = cfg.chunk, q_ref.shape[-1]
  bk = _block(K, cfg.tuning.gate_fwd_bk, "tuning.gate_fwd_bk")
  beta = _f32(beta_ref[...])[:, None]
  if cfg.segmented:
    first_doc, last_doc, _ = _doc_masks(dseg_ref[...])

  row_sumsq = lambda x: jnp.sum(x * x, axis=1)
  rstd = lambda ssq: lax.rsqrt(ssq + L2NORM_EPS)

  def sumsq(ik, acc):
    cols = pl.ds(ik * bk, bk)
    return acc[0] + row_sumsq(_f32(q_ref[:, cols])), acc[1] + row_sumsq(_f32(k_ref[:, cols]))

  if cfg.qk_l2norm and K != bk:
    sq, sk = lax.fori_loop(0, K // bk, sumsq, (jnp.zeros((C,), jnp.float32),) * 2)
    norms = (rstd(sq), rstd(sk))
    rq_ref[...], rk_ref[...] = norms

  def k_block(ik, carry):
    cols = pl.ds(ik * bk, bk)
    a_log, dt = _gate_refs(cfg, gate_refs, h, cols)
    G = lax.cumsum(_activate_gate(cfg, _f32(g_ref[:, cols]), a_log, dt), axis=0)
    G_ref[:, cols] = G
    eg = jnp.exp(G)
    q, k = _f32(q_ref[:, cols]), _f32(k_ref[:, cols])
    if cfg.qk_l2norm:
      if K == bk:  # the whole rows are loaded: no first pass
        rq, rk = rstd(row_sumsq(q)), rstd(row_sumsq(k))
        rq_ref[...], rk_ref[...] = rq, rk
      else:
        rq, rk = norms
      q, k = q * rq[:, None], k * rk[:, None]
      if normalized:
        qn_ref[:, cols] = q.astype(qn_ref.dtype)
        kn_ref[:, cols] = k.astype(kn_ref.dtype)
    qg = q * (cfg.scale * eg)
    kb = beta * k * eg
    kg = k * jnp.exp(_row(G, C - 1) - G)
    if cfg.segmented:  # later documents never see the incoming state; only the last document
      qg = jnp.where(first_doc, qg, 0.0)  # reaches the outgoing one
      kb = jnp.where(first_doc, kb, 0.0)
      kg = jnp.where(last_doc, kg, 0.0)
    qg_ref[:, cols] = qg.astype(qg_ref.dtype)
    kb_ref[:, cols] = kb.astype(kb_ref.dtype)
    kg_ref[:, cols] = kg.astype(kg_ref.dtype)
    return carry

  if K == bk:  # one block: straight-line code, no one-trip loop around it
    k_block(0, 0)
  else:
    lax.fori_loop(0, K // bk, k_block, 0)


# ----------------------------------------------------------------------------------------------
# Forward 2: X / P tiles and M = (I + L)^{-1}.
# ----------------------------------------------------------------------------------------------
def _intra_fwd_kernel(cfg: KernelConfig, residuals, q_ref, k_ref, G_ref, beta_ref, *refs):
  """X and P tiles (zero above the diagonal) and M = (I + L)^{-1} (lower block triangular). With
  `residuals` (a training forward) also X, and M in fp32 (the backward's inputs); without, M in
  cfg.mm_dtype, the dtype in which wy_fwd's dots read it.

  The pair tiles are sums over K: they accumulate over K blocks of `tuning.intra_fwd_bk` columns
  (a loop), so only [BC, bk] operands are live at a time (fla's layout; on the H200, 3.65 → 1.07 ms
  at (8, 4096, 16, 128) against the whole K width, RESULTS.md run 4; 0.66 ms once the gate moved
  to gate_fwd, run 5).

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
  # on tiles already in registers (wy_fwd formerly re-read X and the inverses for this).
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


def _split_refs(cfg, refs):
  ng = 0 if cfg.gate == "none" else 2
  gate_refs, refs = refs[:ng], refs[ng:]
  dseg_ref = None
  if cfg.segmented:
    dseg_ref, refs = refs[0], refs[1:]
  return gate_refs, dseg_ref, refs


# ----------------------------------------------------------------------------------------------
# Forward 3: the WY keys and values W = M kb, U = M (β v) (M from intra_fwd).
# ----------------------------------------------------------------------------------------------
def _wy_fwd_kernel(cfg: KernelConfig, kb_ref, v_ref, beta_ref, M_ref, W_ref, U_ref):
  beta = _f32(beta_ref[...])[:, None]
  m = M_ref[...]
  W_ref[...] = _mm(cfg, m, kb_ref[...]).astype(W_ref.dtype)
  U_ref[...] = _mm(cfg, m, beta * _f32(v_ref[...])).astype(U_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Forward 4: sequential scan over chunks for the states and pseudo-values (one program per batch
# row, head and V block); with `fused`, also the outputs (forward 5 inside the scan).
# ----------------------------------------------------------------------------------------------
def _scan_fwd_kernel(cfg: KernelConfig, nt, bv, fused, kg_ref, G_ref, W_ref, U_ref, *refs):
  """States S per chunk start and Vn = U - W S, sequentially over chunks.

  Training forward (not fused): stores Vn and the per-chunk states for out_fwd and the backward.
  Forward alone (fused): forms each chunk's outputs o = qg S + P Vn here from the state and Vn in
  registers (extra inputs qg, P) and stores neither; out_fwd is not launched.
  """
  if fused:
    qg_ref, P_ref, refs = refs[0], refs[1], refs[2:]
  h0_ref, seq_ref, first_ref, last_ref, refs = refs[0], refs[1], refs[2], refs[3], refs[4:]
  if cfg.segmented:
    dseg_ref, refs = refs[0], refs[1:]
  if fused:
    o_ref, ht_ref = refs
  else:
    vn_ref, hs_ref, ht_ref = refs
  b, h, iv = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  C, K = cfg.chunk, kg_ref.shape[-1]
  vs = pl.ds(iv * bv, bv)

  def body(c, s):
    t0 = c * C
    rows = pl.ds(t0, C)
    seq = seq_ref[b, c]
    s = lax.cond(first_ref[b, c] != 0, lambda: h0_ref[seq, h, :, vs].astype(jnp.float32),
                 lambda: s)
    if not fused:
      hs_ref[b, c, h, :, vs] = s.astype(hs_ref.dtype)
    decay = jnp.exp(G_ref[b, t0 + C - 1, h, :])[:, None]
    if cfg.segmented:  # a reset inside the chunk drops the incoming state at the chunk's end
      decay = jnp.where(dseg_ref[b, t0 + C - 1] == 0, decay, 0.0)
    vn = _f32(U_ref[b, rows, h, vs]) - _mm(cfg, W_ref[b, rows, h, :], s)
    if fused:  # the operands rounded as out_fwd reads them back from the stores: the same o
      s_op = s.astype(cfg.state_dtype)
      vn_op = vn.astype(cfg.state_dtype)
      o = _mm(cfg, qg_ref[b, rows, h, :], s_op) + _mm(cfg, P_ref[b, c, h, :, :], vn_op)
      o_ref[b, rows, h, vs] = o.astype(o_ref.dtype)
    else:
      vn_ref[b, rows, h, vs] = vn.astype(vn_ref.dtype)
    s = decay * s + _mm(cfg, kg_ref[b, rows, h, :].T, vn)

    @pl.when(last_ref[b, c] != 0)
    def _():
      ht_ref[seq, h, :, vs] = s

    return s

  lax.fori_loop(0, nt, body, jnp.zeros((K, bv), jnp.float32))


# ----------------------------------------------------------------------------------------------
# Forward 5 (training forward): outputs o = qg S + P Vn, parallel over chunks (qg = s q e^G from
# gate_fwd).
# ----------------------------------------------------------------------------------------------
def _out_fwd_kernel(cfg: KernelConfig, qg_ref, hs_ref, P_ref, vn_ref, o_ref):
  o = _mm(cfg, qg_ref[...], hs_ref[...]) + _mm(cfg, P_ref[...], vn_ref[...])
  o_ref[...] = o.astype(o_ref.dtype)


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
def _tok_spec(C, d):
  return pl.BlockSpec((None, C, None, d), lambda b, c, h: (b, c, h, 0))


def _vec_spec(C):
  return pl.BlockSpec((None, C, None), lambda b, c, h: (b, c, h))


def _seg_spec(C):
  return pl.BlockSpec((None, C), lambda b, c, h: (b, c))


def _mat_spec(C):
  return pl.BlockSpec((None, None, None, C, C), lambda b, c, h: (b, c, h, 0, 0))


def _state_spec(K, V):
  return pl.BlockSpec((None, None, None, K, V), lambda b, c, h: (b, c, h, 0, 0))


def _gate_specs(H, K):
  """Blocks of the fused gate's parameters on a (B, NT, H) grid: A_log [H] whole, dt_bias [H, K]
  by head."""
  return [pl.BlockSpec((H,), lambda b, c, h: (0,)), pl.BlockSpec((None, K), lambda b, c, h: (h, 0))]


def _check_seg(cfg, dseg):
  if cfg.segmented != (dseg is not None):
    raise ValueError(f"dseg must be given exactly when cfg.segmented; segmented={cfg.segmented}, "
                     f"dseg={'given' if dseg is not None else None}")


def gate_fwd(cfg, q, k, g, beta, a_log=None, dt_bias=None, dseg=None, normalized=False):
  """Returns G [B,T,H,K] fp32 and qg, kb, kg [B,T,H,K] in cfg.state_dtype; with cfg.qk_l2norm
  (q, k raw) also r_q, r_k [B,T,H] fp32, their reciprocal L2 norms, and with `normalized` the
  normalised q, k [B,T,H,K] in q.dtype."""
  _check_seg(cfg, dseg)
  if normalized and not cfg.qk_l2norm:
    raise ValueError("normalized=True needs cfg.qk_l2norm (the kernel normalises q and k)")
  B, T, H, K = q.shape
  C = cfg.chunk
  nt = T // C
  f32 = jnp.float32
  in_specs = [_tok_spec(C, K), _tok_spec(C, K), _tok_spec(C, K), _vec_spec(C)]
  args = [q, k, g, beta]
  if cfg.gate != "none":
    in_specs += _gate_specs(H, K)
    args += [a_log.astype(f32), dt_bias.astype(f32)]
  if cfg.segmented:
    in_specs.append(_seg_spec(C))
    args.append(dseg)
  tok = lambda dtype: jax.ShapeDtypeStruct((B, T, H, K), dtype)
  out_specs = [_tok_spec(C, K)] * 4
  out_shape = [tok(f32)] + [tok(cfg.state_dtype)] * 3
  if cfg.qk_l2norm:
    out_specs += [_vec_spec(C)] * 2
    out_shape += [jax.ShapeDtypeStruct((B, T, H), f32)] * 2
  if normalized:
    out_specs += [_tok_spec(C, K)] * 2
    out_shape += [tok(q.dtype)] * 2
  return pl.pallas_call(
      functools.partial(_gate_fwd_kernel, cfg, normalized),
      grid=(B, nt, H),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=cfg.interpret, name="kda_gate_fwd", **_params(cfg, cfg.tuning.gate_fwd_launch),
  )(*args)


def _require_normalized(cfg, name):
  if cfg.qk_l2norm:
    raise ValueError(f"{name} reads q and k themselves and takes them normalised: cfg.qk_l2norm "
                     "must be False (gate_fwd writes them for a backward)")


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


def _bv(V, bv):
  bv = min(V, bv)
  if V % bv:
    raise ValueError(f"the scan's V block ({bv}) must divide V = {V}")
  return bv


def _scan_fwd_call(cfg, fused, chunk_inputs, h0, seq, first, last, dseg, out_shape):
  """chunk_inputs: kg, G, W, U (+ qg, P when fused), in the kernel's order; the final states
  (last output) alias h0."""
  _check_seg(cfg, dseg)
  B, T, H, _ = chunk_inputs[0].shape
  V = chunk_inputs[3].shape[-1]
  bv = _bv(V, cfg.tuning.bv_fwd)
  args = list(chunk_inputs) + [h0, seq, first, last] + ([dseg] if cfg.segmented else [])
  return pl.pallas_call(
      functools.partial(_scan_fwd_kernel, cfg, T // cfg.chunk, bv, fused),
      grid=(B, H, V // bv),
      out_shape=out_shape,
      # sequences with no chunk keep their initial state
      input_output_aliases={len(chunk_inputs): len(out_shape) - 1},
      interpret=cfg.interpret, name="kda_scan_out_fwd" if fused else "kda_scan_fwd",
      **_params(cfg, cfg.tuning.scan_fwd_launch),
  )(*args)


def scan_fwd(cfg, kg, G, W, U, h0, seq, first, last, dseg=None):
  """The training forward's scan. Returns Vn [B,T,H,V] (cfg.state_dtype), per-chunk start states
  [B,NT,H,K,V] (cfg.state_dtype), final states like h0."""
  B, T, H, K = kg.shape
  V = U.shape[-1]
  return _scan_fwd_call(cfg, False, (kg, G, W, U), h0, seq, first, last, dseg, [
      jax.ShapeDtypeStruct((B, T, H, V), cfg.state_dtype),
      jax.ShapeDtypeStruct((B, T // cfg.chunk, H, K, V), cfg.state_dtype),
      jax.ShapeDtypeStruct(h0.shape, jnp.float32)])


def scan_out_fwd(cfg, kg, G, W, U, qg, P, h0, seq, first, last, dseg=None, *, out_dtype):
  """The forward alone (nothing kept for a backward): the scan forms the outputs. Returns o
  [B,T,H,V] in out_dtype and the final states, like h0."""
  B, T, H, _ = kg.shape
  V = U.shape[-1]
  return _scan_fwd_call(cfg, True, (kg, G, W, U, qg, P), h0, seq, first, last, dseg,
                        [jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
                         jax.ShapeDtypeStruct(h0.shape, jnp.float32)])


def out_fwd(cfg, qg, hs, P, vn, out_dtype):
  """Returns o [B,T,H,V] in out_dtype."""
  B, T, H, K = qg.shape
  V = vn.shape[-1]
  C = cfg.chunk
  nt = T // C
  return pl.pallas_call(
      functools.partial(_out_fwd_kernel, cfg),
      grid=(B, nt, H),
      in_specs=[_tok_spec(C, K), _state_spec(K, V), _mat_spec(C), _tok_spec(C, V)],
      out_specs=_tok_spec(C, V),
      out_shape=jax.ShapeDtypeStruct((B, T, H, V), out_dtype),
      interpret=cfg.interpret, name="kda_out_fwd", **_params(cfg, cfg.tuning.out_fwd_launch),
  )(qg, hs, P, vn)


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
