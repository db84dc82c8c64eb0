"""Helpers shared by the stages of the chunked KDA kernels: the dots, register-tile rows and
columns, the fused gate's parameters, document masks, block specs and argument checks.

Layouts follow fla. B batch rows, T tokens (a multiple of the chunk C), H heads, K / V the key /
value head dims, NT = T / C chunks, N sequences:
  q, k, g, G and the other per-token K-side operands (qg, kb, kg, W)  [B, T, H, K]
  v, U, Vn, o                                                         [B, T, H, V]
  beta                                                                [B, T, H]
  per-chunk C×C matrices (X, P, M and their gradients)                [B, NT, H, C, C]
  per-chunk states                                                    [B, NT, H, K, V]
  initial / final states, fp32                                        [N + 1, H, K, V]
Row N of the states is a dummy for chunks that belong to no sequence. Chunk metadata seq, first,
last [B, NT] int32: the sequence index of each chunk and whether the chunk starts / ends its
sequence (the state is reset / emitted there). The fused gate's parameters: A_log [H] and dt_bias
[H, K], both fp32 (`_gate_specs`, `_gate_refs`).

Documents inside a chunk (segment ids): dseg [B, T] int32 numbers the documents within each
chunk (0 = the document the incoming state belongs to, +1 at every reset). A reset is the same as a
log decay of -inf before the token, which the kernels apply as masks instead of infinities: pair
terms (X, P) only within one document; the incoming state only reaches document 0 (rows of q e^G
and of β k e^G, hence of W, are masked); the outgoing state only keeps the chunk's last document
(rows of k e^{b-G} masked, e^b zeroed if the chunk has a reset). Within a document the cumsum G is
the plain one, so all decays are unchanged. `_doc_masks` forms the row masks from a chunk's dseg.
"""
from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.kda.config import BC, KernelConfig


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


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _row(x, i):
  """Row i of a 2D register tile as a [1, n] array (masked reduction: Triton cannot slice values)."""
  return jnp.sum(jnp.where(_iota(x.shape, 0) == i, x, 0.0), axis=0, keepdims=True)


def _col(x, j):
  """Column j of a 2D register tile as a [m, 1] array."""
  return jnp.sum(jnp.where(_iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


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


def _bv(V, bv):
  bv = min(V, bv)
  if V % bv:
    raise ValueError(f"the scan's V block ({bv}) must divide V = {V}")
  return bv
