"""pallas_kernels.flash_attention's Mosaic GPU backward in Mosaic GPU's interpreter (CPU).

The interpreter runs the kernels' warpgroups, barriers, TMA copies and wgmma with P and dS staged
through shared memory (`register_operands=False`; the GPU feeds them from registers, checked on
the H200 by experiments/benchmarks/attention_bench.py's numerics rows). The forward is the
caller's (tokamax's Mosaic GPU kernel in k3jax): here `dense_forward`, a dense fp32 attention
with its log-sum-exp. It and the references (`testlib.segment_attention`) mask by comparing
segment ids, never with the ranges of `attention_gpu.key_ranges` that the kernels are given: a
wrong range fails here.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attention_gpu
from pallas_kernels.flash_attention import MosaicBwdConfig, flash_attention
from pallas_kernels.flash_attention import mosaic_bwd
from testlib import error_ratio, segment_attention

# The kernels' default tiles, in the interpreter.
INTERPRET = MosaicBwdConfig(register_operands=False, interpret=True)


def dense_forward(q, k, v, segment_ids, *, scale: float, causal: bool):
  """A caller's forward with `attention_gpu.tokamax_forward_lse`'s signature, from the segment ids
  alone: (out [B, T, H, Dv] in q.dtype, lse [B, H, T] fp32, +inf where a query sees nothing).
  out is `segment_attention`'s; lse masks the same way (query t sees key s iff their ids are
  equal and, when causal, s <= t), so a padding run is attended as a document of its own."""
  out = segment_attention(q, k, v, segment_ids, causal=causal, scale=scale)
  h, hk = q.shape[2], k.shape[2]
  seg = jnp.asarray(segment_ids)
  kh = jnp.repeat(k.astype(jnp.float32), h // hk, axis=2)
  logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kh,
                      precision=jax.lax.Precision.HIGHEST) * scale
  seen = seg[:, :, None] == seg[:, None, :]                                  # [B, T, S]
  if causal:
    t = seg.shape[1]
    seen = seen & (jnp.arange(t)[None, :, None] >= jnp.arange(t)[None, None, :])
  lse = jax.nn.logsumexp(jnp.where(seen[:, None], logits, -jnp.inf), axis=-1)
  return out.astype(q.dtype), jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def _inputs(b, t, h, hk, d, dv, seed=0, dtype=jnp.bfloat16):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  shapes = ((b, t, h, d), (b, t, hk, d), (b, t, hk, dv), (b, t, h, dv))
  return [jax.random.normal(key, shape, dtype) for key, shape in zip(ks, shapes)]


def _run(q, k, v, seg, cfg=INTERPRET, causal=True, forward=dense_forward):
  """(out, vjp) of `flash_attention` over the documents of `seg` with the caller's `forward`."""
  seg = jnp.asarray(seg)
  ranges = attention_gpu.key_ranges(seg, causal)
  scale = q.shape[-1] ** -0.5
  fwd = functools.partial(forward, scale=scale, causal=causal)
  run = lambda q, k, v: flash_attention(q, k, v, *ranges, scale=scale, forward=fwd,
                                        forward_aux=seg, backward=cfg)
  return jax.vjp(run, q, k, v)


def _reference_grads(q, k, v, do, seg, causal=True):
  """fp32 gradients of the dense attention masked by segment-id comparison (a padding run
  attends as a document of its own, as in the kernel-level `flash_attention`)."""
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: segment_attention(q, k, v, seg, causal=causal, scale=q.shape[-1] ** -0.5)
  return jax.vjp(ref, f32(q), f32(k), f32(v))[1](f32(do))


@pytest.mark.parametrize("hk, causal, cfg", [
    (2, True, INTERPRET),
    (1, False, MosaicBwdConfig(num_stages=3, register_operands=False, interpret=True)),
], ids=["causal", "gqa-noncausal-3stages"])
def test_matches_dense_reference(hk, causal, cfg):
  """A packed row (documents of 100 and 120 tokens, 36 of padding; T = 256 is two dq tiles and
  two dk/dv tiles, four key and query blocks), MLA's head dims (q/k 192, v 128), bf16; GQA with
  two query heads on one key head. Within the bf16 error ratio of the Triton backward that these
  kernels replaced (≈ 0.003 against the fp32 reference on the H200)."""
  seg = np.array([[1] * 100 + [2] * 120 + [0] * 36], np.int32)
  q, k, v, do = _inputs(1, 256, 2, hk, 192, 128)
  out, vjp = _run(q, k, v, seg, cfg, causal)
  assert out.dtype == jnp.bfloat16 and out.shape == (1, 256, 2, 128)
  for name, g, w in zip("qkv", vjp(do), _reference_grads(q, k, v, do, seg, causal)):
    assert g.dtype == jnp.bfloat16
    assert error_ratio(g.astype(jnp.float32), w) < 0.006, name


def test_unaligned_lengths_and_head_dims_are_padded():
  """T = 100 (no multiple of the 128-token tiles) and head dims 48 / 32 (no multiple of 64), two
  rows: padded to whole tiles and 64 columns by `ops.py`, cut back afterwards."""
  seg = np.array([[1] * 30 + [2] * 45 + [3] * 15 + [0] * 10, [1] * 100], np.int32)
  q, k, v, do = _inputs(2, 100, 2, 2, 48, 32, seed=2)
  _, vjp = _run(q, k, v, seg)
  for name, g, w in zip("qkv", vjp(do), _reference_grads(q, k, v, do, seg)):
    assert g.shape == w.shape
    assert error_ratio(g.astype(jnp.float32), w) < 0.006, name


def _nan_free_forward(q, k, v, segment_ids, *, scale, causal):
  """`dense_forward` on k and v with their NaNs zeroed: a forward that, like tokamax's, never
  loads the blocks outside a query's document (a dense one multiplies the NaN values by zero
  weights). Only the masked entries change, so each document's output stays its own."""
  clean = lambda x: jnp.where(jnp.isnan(x), jnp.zeros((), x.dtype), x)
  return dense_forward(q, clean(k), clean(v), segment_ids, scale=scale, causal=causal)


def test_skips_blocks_outside_the_documents():
  """NaN keys and values in the first document's blocks reach no gradient of the second
  document: no Mosaic kernel's loop (dq, dV, dK) loads them for the second document's tiles."""
  seg = np.array([[1] * 128 + [2] * 128], np.int32)
  q, k, v, do = _inputs(1, 256, 1, 1, 64, 64, seed=3)
  k_bad, v_bad = k.at[:, :64].set(jnp.nan), v.at[:, :64].set(jnp.nan)
  _, vjp = _run(q, k_bad, v_bad, seg, forward=_nan_free_forward)
  dq, dk, dv = vjp(do.at[:, :128].set(0))
  for x in (dq[:, 128:], dk[:, 128:], dv[:, 128:]):
    assert np.all(np.isfinite(np.asarray(x, np.float32)))
  want = _reference_grads(q, k, v, do.at[:, :128].set(0), seg)
  for name, g, w in zip("qkv", (dq, dk, dv), want):
    assert error_ratio(g[:, 128:].astype(jnp.float32), w[:, 128:]) < 0.006, name


def test_block_spans_cover_exactly_the_touched_blocks():
  """Per tile, the first and one-past-last block that its rows' ranges touch (brute force), and
  one block for a tile that sees nothing."""
  rng = np.random.default_rng(0)
  lo = rng.integers(0, 200, (3, 256))
  hi = lo + rng.integers(0, 56, (3, 256))
  lo[1, 128:], hi[1, 128:] = 256, 0                    # a tile of padding: an empty range
  first, last = mosaic_bwd._block_spans(jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32),
                                        128, 64, 4)
  for b in range(3):
    for tile in range(2):
      rows = slice(tile * 128, tile * 128 + 128)
      touched = {c // 64 for r_lo, r_hi in zip(lo[b, rows], hi[b, rows]) for c in range(r_lo, r_hi)}
      if touched:
        assert (first[b, tile], last[b, tile]) == (min(touched), max(touched) + 1)
      else:
        assert last[b, tile] - first[b, tile] == 1 and 0 <= first[b, tile] < 4


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="block_q_dkv must be a positive multiple of 64"):
    MosaicBwdConfig(block_q_dkv=32)
  with pytest.raises(ValueError, match="num_stages must be >= 1"):
    MosaicBwdConfig(num_stages=0)


def test_caller_forward_reads_segment_ids_as_an_argument():
  """A caller's forward gets its segment ids through `forward_aux`: a jitted gradient lowered and
  then called (two traces) gives the gradients of the dense attention over the documents. (On the
  H200 the forward closed over traced segment ids failed at 64K and 1M tokens, with 'compiled for
  656 inputs but called with 654' and an UnexpectedTracerError; that failure does not reproduce
  on CPU.) fp32, which the interpreter runs too."""
  q, k, v, do = _inputs(1, 64, 2, 2, 16, 16, seed=3, dtype=jnp.float32)
  seg = jnp.asarray(np.array([[1] * 20 + [2] * 44], np.int32))
  fwd = functools.partial(dense_forward, scale=0.25, causal=True)

  def loss(q, k, v, seg):
    ranges = attention_gpu.key_ranges(seg, True)
    out = flash_attention(q, k, v, *ranges, scale=0.25, forward=fwd, forward_aux=seg,
                          backward=INTERPRET)
    return jnp.sum(out * do)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  grad.lower(q, k, v, seg).compile()
  got = grad(q, k, v, seg)
  ref = jax.grad(lambda q, k, v: jnp.sum(segment_attention(q, k, v, seg, causal=True, scale=0.25)
                                         * do), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", got, ref):
    assert error_ratio(a, b) < 1e-5, name


def test_document_attention_through_attention_gpu():
  """`mosaic_backward_attention` (a dense forward, the Mosaic backward in the interpreter) on
  packed rows with padding: the segment-masked dense attention, zeros at padding queries, and its
  gradients; bf16 within the 0.01 error ratio."""
  b, t, h, d, dv = 2, 100, 2, 32, 16
  seg = np.array([[1] * 30 + [2] * 45 + [3] * 15 + [0] * 10, [1] * 100], np.int32)
  q, k, v, do = _inputs(b, t, h, h, d, dv, seed=2, dtype=jnp.float32)
  dense = lambda q, k, v: segment_attention(q, k, v, seg, causal=True, scale=d ** -0.5,
                                            zero_padding=True)
  bf = lambda *xs: [x.astype(jnp.bfloat16) for x in xs]
  run = lambda q, k, v: attention_gpu.mosaic_backward_attention(
      q, k, v, jnp.asarray(seg), scale=d ** -0.5, causal=True, backward=INTERPRET,
      forward=dense_forward)
  out, vjp = jax.vjp(run, *bf(q, k, v))
  want, vjp_ref = jax.vjp(dense, q, k, v)
  assert out.dtype == jnp.bfloat16
  assert np.all(np.asarray(out, np.float32)[seg == 0] == 0.0)
  assert error_ratio(out.astype(jnp.float32), want) < 0.01
  for name, got, exp in zip("qkv", vjp(*bf(do)), vjp_ref(do)):
    assert error_ratio(got.astype(jnp.float32), exp) < 0.01, name


def test_forward_is_required():
  q, k, v, _ = _inputs(1, 64, 1, 1, 64, 64)
  ranges = attention_gpu.key_ranges(jnp.ones((1, 64), jnp.int32), True)
  with pytest.raises(ValueError, match="forward must be a callable"):
    flash_attention(q, k, v, *ranges, scale=0.125, forward=None)
