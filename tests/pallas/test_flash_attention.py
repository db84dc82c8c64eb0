"""pallas_kernels.flash_attention (interpret mode on CPU) against dense fp32 references.

The references (`testlib.segment_attention`) mask by comparing segment ids, not with the ranges
of `attention_gpu.key_ranges` that the kernels are given: a wrong range fails here."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attention_gpu
from pallas_kernels.flash_attention import FlashConfig, flash_attention, reference_attention
from pallas_kernels.flash_attention.kernels import head_pieces
from testlib import error_ratio, segment_attention

# Small tiles so that short rows span several blocks of both kernels' loops.
CFG = FlashConfig(block_q=16, block_k=32, block_q_dkv=32, block_k_dkv=16, interpret=True)


def _inputs(b, t, h, hk, d, dv, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  return (jax.random.normal(ks[0], (b, t, h, d)), jax.random.normal(ks[1], (b, t, hk, d)),
          jax.random.normal(ks[2], (b, t, hk, dv)), jax.random.normal(ks[3], (b, t, h, dv)))


SEG = np.array([[1] * 30 + [2] * 45 + [3] * 15 + [0] * 10, [1] * 100], np.int32)


@pytest.mark.parametrize("hk, causal", [(2, True), (4, False)])
def test_matches_reference_with_grads(hk, causal):
  """Documents of a packed row as ranges; T = 100 is no multiple of any block, head dims 24 / 12
  are no powers of two (padded inside), GQA (4 query heads on 2 key heads)."""
  q, k, v, do = _inputs(2, 100, 4, hk, 24, 12)
  ranges = attention_gpu.key_ranges(jnp.asarray(SEG), causal)
  run = lambda q, k, v: flash_attention(q, k, v, *ranges, scale=0.3, config=CFG)
  ref = lambda q, k, v: segment_attention(q, k, v, SEG, causal=causal, scale=0.3)
  out, vjp = jax.vjp(run, q, k, v)
  want, vjp_ref = jax.vjp(ref, q, k, v)
  assert error_ratio(out, want) < 1e-5
  for name, got, exp in zip("qkv", vjp(do), vjp_ref(do)):
    assert error_ratio(got, exp) < 1e-5, name


def test_head_pieces_are_powers_of_two_that_tile_the_head_dim():
  assert head_pieces(192) == ((0, 128), (128, 64))
  assert head_pieces(128) == ((0, 128),)
  assert head_pieces(112) == ((0, 64), (64, 32), (96, 16))
  with pytest.raises(ValueError, match="multiple of 16"):
    head_pieces(24)


@pytest.mark.parametrize("d", [48, 112])
def test_head_dim_in_pieces_matches_reference(d):
  """q/k head dims that are no power of two (MLA's is 192 = 128 + 64) are read in power-of-two
  pieces, not padded: two and three pieces, GQA, a causal packed row with padding."""
  q, k, v, do = _inputs(2, 100, 4, 2, d, 16, seed=4)
  ranges = attention_gpu.key_ranges(jnp.asarray(SEG), True)
  run = lambda q, k, v: flash_attention(q, k, v, *ranges, scale=d ** -0.5, config=CFG)
  ref = lambda q, k, v: segment_attention(q, k, v, SEG, causal=True, scale=d ** -0.5)
  out, vjp = jax.vjp(run, q, k, v)
  want, vjp_ref = jax.vjp(ref, q, k, v)
  assert error_ratio(out, want) < 1e-5
  for name, got, exp in zip("qkv", vjp(do), vjp_ref(do)):
    assert error_ratio(got, exp) < 1e-5, name


def test_skips_blocks_outside_the_ranges():
  """NaN keys/values of the first document's blocks reach neither the outputs nor the gradients
  of the last document: its programs never load those blocks (forward, dq and dk/dv loops)."""
  q, k, v, do = _inputs(1, 128, 2, 2, 16, 16, seed=1)
  seg = jnp.asarray(np.array([[1] * 64 + [2] * 64], np.int32))
  ranges = attention_gpu.key_ranges(seg, True)
  k_bad, v_bad = k.at[:, :32].set(jnp.nan), v.at[:, :32].set(jnp.nan)
  run = lambda q, k, v: flash_attention(q, k, v, *ranges, scale=0.25, config=CFG)
  out, vjp = jax.vjp(run, q, k_bad, v_bad)
  dq, dk, dv = vjp(do.at[:, :64].set(0.0))
  want = segment_attention(q, k, v, seg, causal=True, scale=0.25)
  assert error_ratio(out[:, 64:], want[:, 64:]) < 1e-5
  for x in (dq[:, 64:], dk[:, 64:], dv[:, 64:]):
    assert np.all(np.isfinite(np.asarray(x)))


def test_document_attention_through_attention_gpu():
  """`pallas_attention` (own forward) on a packed row with padding: the segment-masked dense
  attention, zeros at padding queries, and its gradients; bf16 within the 0.01 error ratio."""
  b, t, h, d, dv = 2, 100, 2, 32, 16
  q, k, v, do = _inputs(b, t, h, h, d, dv, seed=2)
  seg = jnp.asarray(SEG)
  dense = lambda q, k, v: segment_attention(q, k, v, SEG, causal=True, scale=d ** -0.5,
                                            zero_padding=True)
  bf = lambda *xs: [x.astype(jnp.bfloat16) for x in xs]
  run = lambda q, k, v: attention_gpu.pallas_attention(q, k, v, seg, scale=d ** -0.5, causal=True,
                                                       forward="pallas", config=CFG)
  out, vjp = jax.vjp(run, *bf(q, k, v))
  want, vjp_ref = jax.vjp(dense, q, k, v)
  assert out.dtype == jnp.bfloat16
  assert np.all(np.asarray(out, np.float32)[np.asarray(SEG) == 0] == 0.0)
  assert error_ratio(out, want) < 0.01
  for name, got, exp in zip("qkv", vjp(*bf(do)), vjp_ref(do)):
    assert error_ratio(got, exp) < 0.01, name


def test_config_rejects_non_power_of_two():
  with pytest.raises(ValueError, match="block_k"):
    FlashConfig(block_k=48)


def _ranges_forward(q, k, v, seg, *, scale):
  """A caller's forward that reads the segment ids it is given (as tokamax's does): the dense
  reference over the document ranges, with its log-sum-exp."""
  k_lo, k_hi = attention_gpu.key_ranges(seg, True)[:2]
  out = reference_attention(q, k, v, k_lo, k_hi, scale=scale).astype(q.dtype)
  cols = jnp.arange(k.shape[1])
  seen = (cols >= k_lo[:, :, None]) & (cols < k_hi[:, :, None])
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  lse = jax.nn.logsumexp(jnp.where(seen[:, None], logits, -jnp.inf), axis=-1)
  return out, jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def test_caller_forward_reads_segment_ids_as_an_argument():
  """A caller's forward gets its segment ids through `forward_aux`: a jitted gradient lowered and
  then called (two traces) equals the one with the own forward. (On the H200 the forward closed
  over traced segment ids failed at 64K and 1M tokens, with 'compiled for 656 inputs but called
  with 654' and an UnexpectedTracerError; that failure does not reproduce on CPU.)"""
  q, k, v, do = _inputs(1, 64, 2, 2, 16, 16, seed=3)
  seg = jnp.asarray(np.array([[1] * 20 + [2] * 44], np.int32))
  fwd = functools.partial(_ranges_forward, scale=0.25)

  def loss(q, k, v, seg, forward):
    ranges = attention_gpu.key_ranges(seg, True)
    out = flash_attention(q, k, v, *ranges, scale=0.25, config=CFG, forward=forward,
                          forward_aux=seg if forward else None)
    return jnp.sum(out * do)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)
  grad.lower(q, k, v, seg, fwd).compile()
  got = grad(q, k, v, seg, fwd)
  want = grad(q, k, v, seg, None)
  for name, a, b in zip("qkv", got, want):
    assert error_ratio(a, b) < 1e-5, name
  # ... and both are the gradients of the dense attention over the documents.
  ref = jax.grad(lambda q, k, v: jnp.sum(segment_attention(q, k, v, seg, causal=True, scale=0.25)
                                         * do), argnums=(0, 1, 2))(q, k, v)
  for name, a, b in zip("qkv", want, ref):
    assert error_ratio(a, b) < 1e-5, name
