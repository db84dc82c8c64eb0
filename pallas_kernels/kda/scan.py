"""Forward stage 4 of chunked KDA: the state recurrence, sequential over the chunks (`scan_fwd`,
and `scan_out_fwd` for a forward without gradient; fla's
`fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_fwd_h`).

Per chunk, from the state S [K, V] at its start (fp32, carried in registers; the sequence's initial
state where the chunk starts one) and b = G_{C-1} (`gate.gate_fwd`):
  Vn = U - W S                   (the pseudo-values)
  S' = e^b ⊙ S + kgᵀ Vn         (e^b scales the K rows of S; kg = k e^{b-G})
S' is the next chunk's start state, and the sequence's final state where the chunk ends one. With
documents (`common`), a reset inside the chunk zeroes e^b; kg and kb (hence W) are masked in
gate_fwd.

One program per batch row, head and V block of `Tuning.bv_fwd` columns: grid (B, H, V / bv), a
loop over the NT chunks. The inputs are whole arrays (no blocks); the final states are written
in place of the initial ones (input_output_aliases), so sequences with no chunk keep their initial
state.

scan_fwd (a training forward):
  in:  kg [B, T, H, K] cfg.state_dtype; G [B, T, H, K] fp32; W [B, T, H, K] and U [B, T, H, V]
       cfg.state_dtype; h0 [N + 1, H, K, V] fp32; seq, first, last [B, NT] int32; cfg.segmented:
       dseg [B, T] int32.
  out: Vn [B, T, H, V] cfg.state_dtype; the start state of every chunk [B, NT, H, K, V]
       cfg.state_dtype; the final states [N + 1, H, K, V] fp32.
scan_out_fwd (the forward alone, nothing stored for a backward): the same scan also forms each
chunk's output o = qg S + P Vn (`output`) from the state and Vn in registers, so out_fwd is not
launched.
  in:  those of scan_fwd, and qg [B, T, H, K] cfg.state_dtype, P [B, NT, H, C, C] cfg.mm_dtype.
  out: o [B, T, H, V] in `out_dtype`; the final states [N + 1, H, K, V] fp32.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import _bv, _check_seg, _f32, _mm, _params
from pallas_kernels.kda.config import KernelConfig


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
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
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
