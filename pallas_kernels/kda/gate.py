"""Forward stage 1 of chunked KDA: the gate, its in-chunk cumsum and the gated operands of the later
kernels (`gate_fwd`; fla's `fla.ops.kda.gate.kda_gate_chunk_cumsum`, with the gated q / k that fla
forms in `chunk_kda_fwd_intra` formed here too).

Per chunk and K column, with s the query scale and x the kernel's gate input:
  g  = x (cfg.gate 'none'), lower_bound·sigmoid(e^{A_log}·(x + dt_bias)) ('bounded') or
       -e^{A_log}·softplus(x + dt_bias) ('softplus')
  G_i = Σ_{j ≤ i} g_j (inclusive cumsum within the chunk),  b = G_{C-1}
  qg = s q e^G (the output's and the backward scan's queries),  kb = β k e^G (W's keys),
  kg = k e^{b-G} (the state update's keys)
With documents (`common`), qg and kb keep only document 0's rows and kg only the last document's.

q/k L2 norm (cfg.qk_l2norm): gate_fwd reads the raw q, k, forms r = (Σ_d x² + 1e-6)^{-1/2} per
token, writes the gated operands of the normalised rows and r_q, r_k and, for a backward
(`normalized`), the normalised q, k; `intra_chunk.intra_fwd` reads the raw q, k and scales its
finished tiles by r_q, r_k. What this saves is the XLA pass that normalised q and k before the
kernels (a read and a write of both: 0.127 of 1.655 ms at (8, 4096, 16, 128)); the row sums cost
gate_fwd ~0.1 ms of it (RESULTS.md run 7). The norm's gradient is taken in the gate's backward
(`backward.intra_bwd`, its second kernel), which holds a chunk's whole rows.

gate_fwd, grid (B, NT, H): one chunk per program, its K columns in blocks of `Tuning.gate_fwd_bk`
(a loop).
  in:  q, k [B, T, H, K] (raw with cfg.qk_l2norm); g [B, T, H, K] (the log decay, or the fused
       gate's input x); beta [B, T, H]; fused gate: A_log [H], dt_bias [H, K] fp32; cfg.segmented:
       dseg [B, T] int32.
  out: G [B, T, H, K] fp32; qg, kb, kg [B, T, H, K] cfg.state_dtype; cfg.qk_l2norm: r_q, r_k
       [B, T, H] fp32; `normalized`: the normalised q, k [B, T, H, K] in q's dtype.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import (_block, _check_seg, _doc_masks, _f32, _gate_refs,
                                       _gate_specs, _params, _row, _seg_spec, _tok_spec,
                                       _vec_spec)
from pallas_kernels.kda.config import KernelConfig

L2NORM_EPS = 1e-6  # q/k L2 norm: x (Σ x² + eps)^{-1/2}, as k3jax.ops.kda_inputs.l2_normalize


def _activate_gate(cfg, graw, a_log, dt):
  """Log decay from the kernel's gate input: graw [n, K] fp32, a_log scalar, dt [1, K]."""
  if cfg.gate == "none":
    return graw
  u = graw + dt
  if cfg.gate == "bounded":
    return cfg.lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * u)
  return -jnp.exp(a_log) * jax.nn.softplus(u)


def _split_refs(cfg, refs):
  ng = 0 if cfg.gate == "none" else 2
  gate_refs, refs = refs[:ng], refs[ng:]
  dseg_ref = None
  if cfg.segmented:
    dseg_ref, refs = refs[0], refs[1:]
  return gate_refs, dseg_ref, refs


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
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
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
