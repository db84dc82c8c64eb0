"""Chunked Kimi Delta Attention as Pallas kernels (forward and backward).

`ops.chunk_kda` is the entry point, a `custom_vjp` over Pallas (Triton lowering) kernels on
chunk-aligned sequences (chunk C = 64 by default, NS = C / 16 sub-tiles of 16 rows). Per chunk,
with the query scale s folded into q, G the in-chunk inclusive cumsum of the log gate g and
b = G_{C-1}:
  X = strict_lower(Σ_d k_i k_j e^{G_i - G_j})       L = diag(β) X
  P = lower(Σ_d s q_i k_j e^{G_i - G_j})             (diagonal included)
  M = (I + L)^{-1}                                   W = M (β k e^G),  U = M (β v)
  scan:  Vn = U - W S,  S' = e^b ⊙ S + (k e^{b-G})ᵀ Vn       (sequential over chunks)
  output: o = (s q e^G) S + P Vn                              (parallel over chunks)

The kernels are split by stage, as fla's `fla.ops.kda`:
  gate         gate_fwd: the gate, G and the gated operands s q e^G, β k e^G, k e^{b-G}
               (and the q/k L2 norm)
  intra_chunk  intra_fwd: X, P and M; wy_fwd: W, U (the WY representation)
  scan         scan_fwd: the states and Vn; scan_out_fwd: the same scan forming o, for a forward
               without gradient
  output       out_fwd: o from the stored states
  backward     scan_bwd, dense_bwd, intra_bwd (the pair terms, then the gate's backward)
  config       KernelConfig, Tuning, default_tuning
  common       the layouts and documents (segment ids), shared helpers and block specs
A training forward runs gate_fwd, intra_fwd, wy_fwd, scan_fwd, out_fwd; a forward without gradient
runs scan_out_fwd instead of the last two; the backward runs scan_bwd, dense_bwd, intra_bwd.
"""
from pallas_kernels.kda.ops import chunk_kda

__all__ = ["chunk_kda"]
