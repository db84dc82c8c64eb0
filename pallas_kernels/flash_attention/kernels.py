"""Flash attention over per-query key ranges: forward, dq and dk/dv kernels (Pallas, Triton lowering).

Query t sees the keys s with k_lo[t] <= s < k_hi[t] (a packed document, causal or not, is such a
range). Each program walks only the key blocks that its query block's ranges touch (dq and the
forward), or only the query blocks listed for its key block by the caller's per-key query ranges
[q_lo[s], q_hi[s]) (dk/dv), so a row of many documents costs the sum of its documents' blocks,
not a whole causal pass. The per-element mask inside a block always comes from k_lo / k_hi, so
the query ranges only need to cover every query that sees the key (a superset is correct, only
slower).

Inputs arrive padded by `ops.py`: sequence lengths to whole blocks, the q/k head dim D to a
multiple of 16 and the value dim to a power of two, padded queries with an empty range (k_lo = S,
k_hi = 0) and padded keys with q_lo = T, q_hi = 0 so that they widen no block's loop. Triton's
tiles are powers of two, so the kernels read and write q, k, dq and dk as pieces of D whose sizes
are powers of two (`head_pieces`: MLA's 192 is 128 + 64) and sum the pieces' q·kᵀ products:
padding 192 to 256 instead would cost a third more q/k memory and QKᵀ work (at 1M tokens, four
more 0.75 GiB arrays in the backward).

Layouts: q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv], out/dout [B, T, H, Dv], lse/delta
[B, H, T] fp32, k_lo/k_hi [B, T] int32, q_lo/q_hi [B, S] int32; H = Hk · G, query head h reads key
head h // G. Matmul operands in the input dtype, accumulation and softmax in fp32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels.common import check_powers_of_two


@dataclasses.dataclass(frozen=True)
class FlashConfig:
  """Block sizes (powers of two) and launch parameters; the interpreter ignores the launches.

  Attributes:
    block_q / block_k: forward and dq kernel tiles (queries per program, keys per step).
    block_q_dkv / block_k_dkv: dk/dv kernel tiles (keys per program, queries per step).
    fwd_launch / dq_launch / dkv_launch: (num_warps, num_stages) of each kernel.
    interpret: run in the Pallas interpreter (CPU tests).
  """
  block_q: int = 64
  block_k: int = 64
  block_q_dkv: int = 64
  block_k_dkv: int = 64
  fwd_launch: tuple = (4, 2)
  dq_launch: tuple = (4, 2)
  dkv_launch: tuple = (4, 2)
  interpret: bool = False

  def __post_init__(self):
    check_powers_of_two(self, "block_q", "block_k", "block_q_dkv", "block_k_dkv")


def head_pieces(d: int) -> tuple[tuple[int, int], ...]:
  """(offset, size) pieces of a head dim d (a multiple of 16), sizes powers of two, largest first."""
  if d % 16:
    raise ValueError(f"head dim {d} must be a multiple of 16 (ops.py pads it)")
  pieces, offset = [], 0
  for bit in reversed(range(d.bit_length())):
    if d & (1 << bit):
      pieces.append((offset, 1 << bit))
      offset += 1 << bit
  return tuple(pieces)


def _params(cfg: FlashConfig, launch) -> dict:
  if cfg.interpret:
    return {}
  num_warps, num_stages = launch
  return dict(compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                                       num_stages=num_stages))


def _dot(a, b):
  """a [m, k] · b [k, n] with fp32 accumulation (operands as given)."""
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_t(a, b):
  """a [m, k] · b[n, k]ᵀ with fp32 accumulation."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _iota(shape, dim):
  return lax.broadcasted_iota(jnp.int32, shape, dim)


def _block_span(lo, hi, block: int):
  """First and one-past-last block index that the ranges [lo, hi) touch (empty: first >= last)."""
  first = jnp.min(lo) // block
  last = (jnp.max(hi) + block - 1) // block
  return first, jnp.maximum(first, last)


def _load_pieces(ref, rows, pieces, *lead):
  """ref[rows, *lead, piece] for each head-dim piece: the pieces of one [rows, D] tile."""
  return [ref[(rows, *lead, pl.ds(off, size))] for off, size in pieces]


def _dot_t_pieces(a_pieces, b_pieces):
  """Σ over head-dim pieces of a_piece · b_pieceᵀ ([m, n] fp32): a · bᵀ over the whole D."""
  out = None
  for a, b in zip(a_pieces, b_pieces):
    part = _dot_t(a, b)
    out = part if out is None else out + part
  return out


def _fwd_kernel(scale, bk, pieces, q_ref, k_ref, v_ref, klo_ref, khi_ref, o_ref, lse_ref):
  q = _load_pieces(q_ref, slice(None), pieces)
  klo, khi = klo_ref[...], khi_ref[...]
  bq = q[0].shape[0]
  first, last = _block_span(klo, khi, bk)

  def step(j, carry):
    m, l, acc = carry
    start = pl.multiple_of(j * bk, bk)
    vb = v_ref[pl.ds(start, bk), :]
    cols = start + _iota((bq, bk), 1)
    seen = (cols >= klo[:, None]) & (cols < khi[:, None])
    kb = _load_pieces(k_ref, pl.ds(start, bk), pieces)
    s = jnp.where(seen, _dot_t_pieces(q, kb) * scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # nothing seen yet: avoid inf - inf
    p = jnp.exp(s - m_safe[:, None])
    alpha = jnp.exp(m - m_safe)
    return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + _dot(p.astype(vb.dtype),
                                                                            vb)

  init = (jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32),
          jnp.zeros((bq, v_ref.shape[-1]), jnp.float32))
  m, l, acc = lax.fori_loop(first, last, step, init)
  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  o_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)


def _dq_kernel(scale, bk, pieces, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, klo_ref,
               khi_ref, dq_ref):
  q = _load_pieces(q_ref, slice(None), pieces)
  do = do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  klo, khi = klo_ref[...], khi_ref[...]
  bq = do.shape[0]
  first, last = _block_span(klo, khi, bk)

  def step(j, dq):
    start = pl.multiple_of(j * bk, bk)
    rows = pl.ds(start, bk)
    kb = _load_pieces(k_ref, rows, pieces)
    vb = v_ref[rows, :]
    cols = start + _iota((bq, bk), 1)
    seen = (cols >= klo[:, None]) & (cols < khi[:, None])
    p = jnp.where(seen, jnp.exp(_dot_t_pieces(q, kb) * scale - lse[:, None]), 0.0)
    ds = (p * (_dot_t(do, vb) - delta[:, None])).astype(vb.dtype)
    return tuple(acc + _dot(ds, kp) for acc, kp in zip(dq, kb))

  dq = lax.fori_loop(first, last, step,
                     tuple(jnp.zeros((bq, size), jnp.float32) for _, size in pieces))
  for acc, (off, size) in zip(dq, pieces):
    dq_ref[:, pl.ds(off, size)] = (acc * scale).astype(dq_ref.dtype)


def _dkv_kernel(scale, bq, groups, pieces, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                klo_ref, khi_ref, qlo_ref, qhi_ref, dk_ref, dv_ref):
  kb = _load_pieces(k_ref, slice(None), pieces)
  vb = v_ref[...]
  bk = vb.shape[0]
  key0 = pl.program_id(2) * bk
  first, last = _block_span(qlo_ref[...], qhi_ref[...], bq)
  rows = key0 + _iota((bk, bq), 0)

  def step(i, carry, g):
    dk, dv = carry
    start = pl.multiple_of(i * bq, bq)
    qb = _load_pieces(q_ref, pl.ds(start, bq), pieces, g)
    dob = do_ref[pl.ds(start, bq), g, :]
    lse = lse_ref[g, pl.ds(start, bq)]
    delta = delta_ref[g, pl.ds(start, bq)]
    klo = klo_ref[pl.ds(start, bq)]
    khi = khi_ref[pl.ds(start, bq)]
    seen = (rows >= klo[None, :]) & (rows < khi[None, :])
    p = jnp.where(seen, jnp.exp(_dot_t_pieces(kb, qb) * scale - lse[None, :]), 0.0)  # [bk, bq]
    dv = dv + _dot(p.astype(dob.dtype), dob)
    ds = (p * (_dot_t(vb, dob) - delta[None, :])).astype(dob.dtype)
    return tuple(acc + _dot(ds, qp) for acc, qp in zip(dk, qb)), dv

  carry = (tuple(jnp.zeros((bk, size), jnp.float32) for _, size in pieces),
           jnp.zeros(vb.shape, jnp.float32))
  for g in range(groups):  # the query heads that share this key head, one after the other
    carry = lax.fori_loop(first, last, functools.partial(step, g=g), carry)
  dk, dv = carry
  for acc, (off, size) in zip(dk, pieces):
    dk_ref[:, pl.ds(off, size)] = (acc * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_fwd(q, k, v, k_lo, k_hi, *, scale: float, cfg: FlashConfig):
  """Padded inputs (module docstring) -> out [B, T, H, Dv] in q.dtype, lse [B, H, T] fp32."""
  b, t, h, d = q.shape
  s, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
  g, bq, bk = h // hk, cfg.block_q, cfg.block_k
  return pl.pallas_call(
      functools.partial(_fwd_kernel, scale, bk, head_pieces(d)),
      grid=(b, h, t // bq),
      in_specs=[
          pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
          pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
          pl.BlockSpec((None, s, None, dv), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
          pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
          pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, dv), lambda bi, hi, qi: (bi, qi, hi, 0)),
          pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, t, h, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, h, t), jnp.float32)],
      interpret=cfg.interpret, name="flash_ranges_fwd", **_params(cfg, cfg.fwd_launch),
  )(q, k, v, k_lo, k_hi)


def flash_bwd_dq(q, k, v, dout, lse, delta, k_lo, k_hi, *, scale: float, cfg: FlashConfig):
  """Padded inputs (module docstring) -> dq [B, T, H, D] in q.dtype."""
  b, t, h, d = q.shape
  s, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
  g = h // hk
  bq, bk = cfg.block_q, cfg.block_k
  return pl.pallas_call(
      functools.partial(_dq_kernel, scale, bk, head_pieces(d)),
      grid=(b, h, t // bq),
      in_specs=[
          pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
          pl.BlockSpec((None, s, None, d), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
          pl.BlockSpec((None, s, None, dv), lambda bi, hi, qi: (bi, 0, hi // g, 0)),
          pl.BlockSpec((None, bq, None, dv), lambda bi, hi, qi: (bi, qi, hi, 0)),
          pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),
          pl.BlockSpec((None, None, bq), lambda bi, hi, qi: (bi, hi, qi)),
          pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
          pl.BlockSpec((None, bq), lambda bi, hi, qi: (bi, qi)),
      ],
      out_specs=pl.BlockSpec((None, bq, None, d), lambda bi, hi, qi: (bi, qi, hi, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      interpret=cfg.interpret, name="flash_ranges_dq", **_params(cfg, cfg.dq_launch),
  )(q, k, v, dout, lse, delta, k_lo, k_hi)


def flash_bwd_dkv(q, k, v, dout, lse, delta, k_lo, k_hi, q_lo, q_hi, *, scale: float,
                  cfg: FlashConfig):
  """Padded inputs (module docstring) -> dk [B, S, Hk, D], dv [B, S, Hk, Dv] in k's / v's dtype."""
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  g = h // hk
  bq, bk = cfg.block_q_dkv, cfg.block_k_dkv
  dv = v.shape[-1]
  return pl.pallas_call(
      functools.partial(_dkv_kernel, scale, bq, g, head_pieces(d)),
      grid=(b, hk, s // bk),
      in_specs=[
          pl.BlockSpec((None, t, g, d), lambda bi, hi, ki: (bi, 0, hi, 0)),
          pl.BlockSpec((None, bk, None, d), lambda bi, hi, ki: (bi, ki, hi, 0)),
          pl.BlockSpec((None, bk, None, dv), lambda bi, hi, ki: (bi, ki, hi, 0)),
          pl.BlockSpec((None, t, g, dv), lambda bi, hi, ki: (bi, 0, hi, 0)),
          pl.BlockSpec((None, g, t), lambda bi, hi, ki: (bi, hi, 0)),
          pl.BlockSpec((None, g, t), lambda bi, hi, ki: (bi, hi, 0)),
          pl.BlockSpec((None, t), lambda bi, hi, ki: (bi, 0)),
          pl.BlockSpec((None, t), lambda bi, hi, ki: (bi, 0)),
          pl.BlockSpec((None, bk), lambda bi, hi, ki: (bi, ki)),
          pl.BlockSpec((None, bk), lambda bi, hi, ki: (bi, ki)),
      ],
      out_specs=[pl.BlockSpec((None, bk, None, d), lambda bi, hi, ki: (bi, ki, hi, 0)),
                 pl.BlockSpec((None, bk, None, dv), lambda bi, hi, ki: (bi, ki, hi, 0))],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      interpret=cfg.interpret, name="flash_ranges_dkv", **_params(cfg, cfg.dkv_launch),
  )(q, k, v, dout, lse, delta, k_lo, k_hi, q_lo, q_hi)
