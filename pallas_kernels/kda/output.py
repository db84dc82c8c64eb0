"""Forward stage 5 of chunked KDA (a training forward): the outputs, parallel over the chunks
(`out_fwd`; fla's `fla.ops.gla.chunk.chunk_gla_fwd_o_gk`).

Per chunk, from its start state S and pseudo-values Vn (`scan.scan_fwd`), the query-key matrix P
(`intra_chunk.intra_fwd`) and qg = s q e^G (`gate.gate_fwd`):
  o = qg S + P Vn
A forward without gradient forms the same o inside the scan (`scan.scan_out_fwd`), from operands
rounded as they are stored for this kernel.

out_fwd, grid (B, NT, H):
  in:  qg [B, T, H, K] cfg.state_dtype; S [B, NT, H, K, V] cfg.state_dtype; P [B, NT, H, C, C]
       cfg.mm_dtype; Vn [B, T, H, V] cfg.state_dtype.
  out: o [B, T, H, V] in `out_dtype`.
"""
from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from pallas_kernels.kda.common import _mat_spec, _mm, _params, _state_spec, _tok_spec
from pallas_kernels.kda.config import KernelConfig


# ----------------------------------------------------------------------------------------------
# Forward 5 (training forward): outputs o = qg S + P Vn, parallel over chunks (qg = s q e^G from
# gate_fwd).
# ----------------------------------------------------------------------------------------------
def _out_fwd_kernel(cfg: KernelConfig, qg_ref, hs_ref, P_ref, vn_ref, o_ref):
  o = _mm(cfg, qg_ref[...], hs_ref[...]) + _mm(cfg, P_ref[...], vn_ref[...])
  o_ref[...] = o.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers.
# ----------------------------------------------------------------------------------------------
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
