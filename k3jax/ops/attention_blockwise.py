"""Flash-style blockwise softmax attention in plain XLA: no [T, S] array, forward or backward.

The XLA implementation behind `k3jax.ops.attention.attention`, and the per-head max logit that
QK-Clip reads (`blockwise_max_logits`). Queries and keys are cut into blocks of `q_block` and
`kv_block` tokens; each (query block, key block) pair builds its own [B, q_block, kv_block] mask
from per-token vectors (segment ids and positions) and is skipped (`lax.cond`) when the vectors'
per-block ranges show that no query of the block sees any key of the other. The softmax is online
(running max and sum in fp32), and the VJP is written out (`jax.custom_vjp`): the forward keeps
only the output and the per-query log-sum-exp, the backward recomputes each block's
probabilities. Memory is O(B · H · q_block · kv_block) per step plus the inputs and gradients.

Masking (query t, key s of one batch row): t sees s when q_seg[t] == kv_seg[s] != 0 and, if
causal, kv_pos[s] <= q_pos[t]. A query that sees no key returns zeros (and zero gradients).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp


class BlockRanges(NamedTuple):
  """Per-block summaries of the mask vectors used to skip blocks: [n_blocks] int32 each.

  seg_lo / seg_hi: smallest / largest nonzero segment id in the block over the whole batch (an
  all-padding block gets seg_lo > seg_hi); pos_lo / pos_hi: smallest / largest position.
  """
  seg_lo: jax.Array
  seg_hi: jax.Array
  pos_lo: jax.Array
  pos_hi: jax.Array


def _ranges(seg: jax.Array, pos: jax.Array, block: int) -> BlockRanges:
  """seg, pos [B, n·block] int32 -> BlockRanges over the n blocks."""
  b, length = seg.shape
  seg_b = seg.reshape(b, length // block, block)
  pos_b = pos.reshape(b, length // block, block)
  big = jnp.iinfo(jnp.int32).max
  seg_lo = jnp.min(jnp.where(seg_b != 0, seg_b, big), axis=(0, 2))
  seg_hi = jnp.max(jnp.where(seg_b != 0, seg_b, -1), axis=(0, 2))
  return BlockRanges(seg_lo, seg_hi, jnp.min(pos_b, axis=(0, 2)), jnp.max(pos_b, axis=(0, 2)))


def _live(qr: BlockRanges, kr: BlockRanges, i, j, causal: bool) -> jax.Array:
  """Whether query block i may see anything of key block j (conservative: never a false 'no')."""
  live = (qr.seg_lo[i] <= kr.seg_hi[j]) & (kr.seg_lo[j] <= qr.seg_hi[i])
  if causal:
    live &= kr.pos_lo[j] <= qr.pos_hi[i]
  return live


def _mask(qs, qp, ks, kp, causal: bool) -> jax.Array:
  """Block mask [B, tq, tk] from the block's vectors qs, qp [B, tq] and ks, kp [B, tk]."""
  mask = (qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != 0)
  if causal:
    mask &= kp[:, None, :] <= qp[:, :, None]
  return mask


def _pad_to(x: jax.Array, axis: int, length: int) -> jax.Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  return jnp.pad(x, pad)


class _Blocks(NamedTuple):
  """Inputs padded to whole blocks; padded tokens carry segment id 0 (never seen, see nothing)."""
  q: jax.Array       # [B, nq·bq, Hk, G, D]
  k: jax.Array       # [B, nk·bk, Hk, D]
  v: jax.Array       # [B, nk·bk, Hk, Dv]
  q_seg: jax.Array   # [B, nq·bq] int32
  q_pos: jax.Array
  kv_seg: jax.Array  # [B, nk·bk] int32
  kv_pos: jax.Array
  bq: int
  bk: int


def _blocks(q, k, v, q_seg, q_pos, kv_seg, kv_pos, bq: int, bk: int) -> _Blocks:
  b, t, h, d = q.shape
  s, hk = k.shape[1], k.shape[2]
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  q = _pad_to(q, 1, tp).reshape(b, tp, hk, h // hk, d)
  return _Blocks(q, _pad_to(k, 1, sp), _pad_to(v, 1, sp), _pad_to(q_seg, 1, tp),
                 _pad_to(q_pos, 1, tp), _pad_to(kv_seg, 1, sp), _pad_to(kv_pos, 1, sp), bq, bk)


def _q_block(x: _Blocks, i):
  sl = lambda a: lax.dynamic_slice_in_dim(a, i * x.bq, x.bq, axis=1)
  return sl(x.q), sl(x.q_seg), sl(x.q_pos)


def _kv_block(x: _Blocks, j):
  sl = lambda a: lax.dynamic_slice_in_dim(a, j * x.bk, x.bk, axis=1)
  return sl(x.k), sl(x.v), sl(x.kv_seg), sl(x.kv_pos)


def _logits(qb, kb, scale: float, precision=None) -> jax.Array:
  """qb [B, tq, Hk, G, D], kb [B, tk, Hk, D] -> fp32 [B, Hk, G, tq, tk]."""
  return jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32,
                    precision=precision) * scale


def _forward(x: _Blocks, scale: float, causal: bool):
  """Returns out [B, nq·bq, Hk, G, Dv] fp32 and lse [B, Hk, G, nq·bq] fp32 (+inf: sees nothing)."""
  b, tp, hk, g, _ = x.q.shape
  dv = x.v.shape[-1]
  nq, nk = tp // x.bq, x.k.shape[1] // x.bk
  qr, kr = _ranges(x.q_seg, x.q_pos, x.bq), _ranges(x.kv_seg, x.kv_pos, x.bk)

  def q_step(i):
    qb, qs, qp = _q_block(x, i)

    def kv_step(j, carry):
      def update(carry):
        m, l, acc = carry
        kb, vb, ks, kp = _kv_block(x, j)
        mask = _mask(qs, qp, ks, kp, causal)[:, None, None]
        logits = jnp.where(mask, _logits(qb, kb, scale), -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(logits - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgqs,bskv->bkgqv", p.astype(vb.dtype), vb,
                        preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[..., None] + pv
      return lax.cond(_live(qr, kr, i, j, causal), update, lambda c: c, carry)

    init = (jnp.full((b, hk, g, x.bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, hk, g, x.bq), jnp.float32),
            jnp.zeros((b, hk, g, x.bq, dv), jnp.float32))
    m, l, acc = _while_range(nk, kv_step, init)
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return out, lse

  out, lse = lax.map(q_step, jnp.arange(nq))        # [nq, B, Hk, G, bq, Dv], [nq, B, Hk, G, bq]
  out = jnp.moveaxis(out, 0, 3).reshape(b, hk, g, tp, dv).transpose(0, 3, 1, 2, 4)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hk, g, tp)
  return out, lse


def _backward(x: _Blocks, scale: float, causal: bool, lse, delta, do):
  """lse, delta [B, Hk, G, nq·bq] fp32; do [B, nq·bq, Hk, G, Dv]. Returns fp32 dq, dk, dv (padded)."""
  b, tp, hk, g, d = x.q.shape
  nq, nk = tp // x.bq, x.k.shape[1] // x.bk
  qr, kr = _ranges(x.q_seg, x.q_pos, x.bq), _ranges(x.kv_seg, x.kv_pos, x.bk)

  def q_step(i, carry):
    dq, dk, dv = carry
    qb, qs, qp = _q_block(x, i)
    sl_q = lambda a: lax.dynamic_slice_in_dim(a, i * x.bq, x.bq, axis=-1)
    lse_b, delta_b = sl_q(lse), sl_q(delta)
    dob = lax.dynamic_slice_in_dim(do, i * x.bq, x.bq, axis=1)

    def kv_step(j, carry):
      def update(carry):
        dq_b, dk, dv = carry
        kb, vb, ks, kp = _kv_block(x, j)
        mask = _mask(qs, qp, ks, kp, causal)[:, None, None]
        p = jnp.where(mask, jnp.exp(_logits(qb, kb, scale) - lse_b[..., None]), 0.0)
        dp = jnp.einsum("bqkgv,bskv->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_b[..., None])
        dq_b = dq_b + jnp.einsum("bkgqs,bskd->bqkgd", ds.astype(kb.dtype), kb,
                                 preferred_element_type=jnp.float32)
        dk_j = jnp.einsum("bkgqs,bqkgd->bskd", ds.astype(qb.dtype), qb,
                          preferred_element_type=jnp.float32)
        dv_j = jnp.einsum("bkgqs,bqkgv->bskv", p.astype(dob.dtype), dob,
                          preferred_element_type=jnp.float32)
        add = lambda full, part: lax.dynamic_update_slice_in_dim(
            full, lax.dynamic_slice_in_dim(full, j * x.bk, x.bk, axis=1) + part, j * x.bk, axis=1)
        return dq_b, add(dk, dk_j), add(dv, dv_j)
      return lax.cond(_live(qr, kr, i, j, causal), update, lambda c: c, carry)

    dq_b, dk, dv = _while_range(nk, kv_step, (jnp.zeros(qb.shape, jnp.float32), dk, dv))
    dq = lax.dynamic_update_slice_in_dim(dq, dq_b, i * x.bq, axis=1)
    return dq, dk, dv

  init = (jnp.zeros(x.q.shape, jnp.float32), jnp.zeros(x.k.shape, jnp.float32),
          jnp.zeros(x.v.shape, jnp.float32))
  dq, dk, dv = _while_range(nq, q_step, init)
  return dq * scale, dk * scale, dv


def _while_range(n: int, body, init):
  """`lax.fori_loop(0, n, body, init)` as a while loop (the forward's and backward's block loops).

  A fori_loop with a static trip count is a scan. Linearising an enclosing scan (the decoder's
  scanned layers) then stacked values of these loops per iteration as residuals, the masks and
  probabilities of every (query block, key block) pair: T² × heads elements, 96 GiB in
  small.gin's step at T = 65536 on CPU (tests/ops/test_attention.py reproduces it). JAX never
  stacks a while loop's values; the custom VJP needs no autodiff through these loops.
  """
  def step(carry):
    i, c = carry
    return i + 1, body(i, c)
  return lax.while_loop(lambda carry: carry[0] < n, step, (jnp.zeros((), jnp.int32), init))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_seg, q_pos, kv_seg, kv_pos, scale, causal, bq, bk):
  return _flash_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, scale, causal, bq, bk)[0]


def _flash_fwd(q, k, v, q_seg, q_pos, kv_seg, kv_pos, scale, causal, bq, bk):
  b, t, h, _ = q.shape
  x = _blocks(q, k, v, q_seg, q_pos, kv_seg, kv_pos, bq, bk)
  out, lse = _forward(x, scale, causal)
  out = out.reshape(b, -1, h, v.shape[-1])[:, :t].astype(q.dtype)
  return out, (q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse)


def _flash_bwd(scale, causal, bq, bk, res, dout):
  q, k, v, q_seg, q_pos, kv_seg, kv_pos, out, lse = res
  b, t, h, _ = q.shape
  s, hk = k.shape[1], k.shape[2]
  x = _blocks(q, k, v, q_seg, q_pos, kv_seg, kv_pos, bq, bk)
  tp = x.q.shape[1]
  # delta_t = sum_s p_ts dp_ts = o_t . do_t: the softmax backward's row term.
  delta = jnp.einsum("bthv,bthv->bth", out.astype(jnp.float32), dout.astype(jnp.float32))
  delta = _pad_to(delta, 1, tp).reshape(b, tp, hk, h // hk).transpose(0, 2, 3, 1)
  do = _pad_to(dout, 1, tp).reshape(b, tp, hk, h // hk, -1)
  dq, dk, dv = _backward(x, scale, causal, lse, delta, do)
  dq = dq.reshape(b, tp, h, -1)[:, :t].astype(q.dtype)
  return dq, dk[:, :s].astype(k.dtype), dv[:, :s].astype(v.dtype), None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_seg: jax.Array,
                        q_pos: jax.Array, kv_seg: jax.Array, kv_pos: jax.Array, *, scale: float,
                        causal: bool, q_block: int, kv_block: int) -> jax.Array:
  """Masked softmax attention, blockwise (see the module docstring), differentiable in q, k, v.

  Args:
    q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv] (H % Hk == 0), one float dtype.
    q_seg, q_pos [B, T] int32; kv_seg, kv_pos [B, S] int32 (segment 0 = padding).
    scale: logit scale. causal: apply kv_pos <= q_pos.
    q_block, kv_block: block sizes (clipped to T and S).

  Returns:
    [B, T, H, Dv] in q.dtype; queries that see no key give zeros.
  """
  bq = max(1, min(q_block, q.shape[1]))
  bk = max(1, min(kv_block, k.shape[1]))
  return _flash(q, k, v, q_seg, q_pos, kv_seg, kv_pos, float(scale), bool(causal), bq, bk)


def blockwise_max_logits(q: jax.Array, k: jax.Array, q_seg: jax.Array, q_pos: jax.Array,
                         kv_seg: jax.Array, kv_pos: jax.Array, *, scale: float, causal: bool,
                         q_block: int, kv_block: int) -> jax.Array:
  """Per-query-head max of the visible scaled logits, fp32 [H]; -inf for a head that sees nothing.

  Same inputs and masking as `blockwise_attention` (v not needed); forward only, no gradient.
  """
  h = q.shape[2]
  q, k = lax.stop_gradient(q), lax.stop_gradient(k)
  bq = max(1, min(q_block, q.shape[1]))
  bk = max(1, min(kv_block, k.shape[1]))
  x = _blocks(q, k, k[..., :1], q_seg, q_pos, kv_seg, kv_pos, bq, bk)
  b, tp, hk, g, _ = x.q.shape
  nq, nk = tp // bq, x.k.shape[1] // bk
  qr, kr = _ranges(x.q_seg, x.q_pos, bq), _ranges(x.kv_seg, x.kv_pos, bk)

  def q_step(i, best):
    qb, qs, qp = _q_block(x, i)

    def kv_step(j, best):
      def update(best):
        kb, _, ks, kp = _kv_block(x, j)
        # fp32 at full precision: QK-Clip compares these maxima against a threshold.
        logits = _logits(qb.astype(jnp.float32), kb.astype(jnp.float32), scale,
                         precision=lax.Precision.HIGHEST)
        mask = _mask(qs, qp, ks, kp, causal)[:, None, None]
        return jnp.maximum(best, jnp.max(jnp.where(mask, logits, -jnp.inf), axis=(0, 3, 4)))
      return lax.cond(_live(qr, kr, i, j, causal), update, lambda c: c, best)

    return lax.fori_loop(0, nk, kv_step, best)

  best = lax.fori_loop(0, nq, q_step, jnp.full((hk, g), -jnp.inf, jnp.float32))
  return best.reshape(h)
