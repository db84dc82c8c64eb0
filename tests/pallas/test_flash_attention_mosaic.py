"""pallas_kernels.flash_attention's Mosaic GPU backward in Mosaic GPU's interpreter (CPU).

The interpreter runs the kernels' warpgroups, barriers, TMA copies and wgmma with P and dS staged
through shared memory (`register_operands=False`; the GPU feeds them from registers, checked on
the H200 by experiments/benchmarks/attention_bench.py's numerics rows). The references
(`testlib.segment_attention`) mask by comparing segment ids, not with the kernels' ranges.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import attention_gpu
from pallas_kernels.flash_attention import FlashConfig, MosaicBwdConfig, flash_attention
from pallas_kernels.flash_attention import mosaic_bwd
from testlib import error_ratio, segment_attention

# dk/dv in one Mosaic kernel, in two (the default), or in the Triton kernel.
MOSAIC = MosaicBwdConfig(dkv="mosaic", register_operands=False, interpret=True)
MOSAIC_SPLIT = MosaicBwdConfig(register_operands=False, interpret=True)
TRITON = FlashConfig(block_q=32, block_k=32, block_q_dkv=32, block_k_dkv=32, interpret=True)


def _inputs(b, t, h, hk, d, dv, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  shapes = ((b, t, h, d), (b, t, hk, d), (b, t, hk, dv), (b, t, h, dv))
  return [jax.random.normal(key, shape, jnp.bfloat16) for key, shape in zip(ks, shapes)]


def _grads(q, k, v, do, seg, mosaic, causal=True):
  ranges = attention_gpu.key_ranges(jnp.asarray(seg), causal)
  run = lambda q, k, v: flash_attention(q, k, v, *ranges, scale=q.shape[-1] ** -0.5,
                                        config=TRITON, mosaic_backward=mosaic)
  return jax.vjp(run, q, k, v)[1](do)


def _reference_grads(q, k, v, do, seg, causal=True):
  """fp32 gradients of the dense attention masked by segment-id comparison (a padding run
  attends as a document of its own, as in the kernel-level `flash_attention`)."""
  f32 = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: segment_attention(q, k, v, seg, causal=causal, scale=q.shape[-1] ** -0.5)
  return jax.vjp(ref, f32(q), f32(k), f32(v))[1](f32(do))


MOSAIC_DQ = MosaicBwdConfig(dkv="triton", num_stages=3, register_operands=False, interpret=True)


@pytest.mark.parametrize("hk, causal, cfg", [(2, True, MOSAIC), (1, False, MOSAIC),
                                             (2, True, MOSAIC_DQ), (2, True, MOSAIC_SPLIT)])
def test_matches_dense_reference(hk, causal, cfg):
  """A packed row (documents of 100 and 120 tokens, 36 of padding; T = 256 is two dq tiles and
  two dk/dv tiles, four key and query blocks), MLA's head dims (q/k 192, v 128), bf16; GQA with
  two query heads on one key head. Within the bf16 error ratio of the Triton backward (≈ 0.003
  against the fp32 reference on the H200)."""
  seg = np.array([[1] * 100 + [2] * 120 + [0] * 36], np.int32)
  q, k, v, do = _inputs(1, 256, 2, hk, 192, 128)
  got = _grads(q, k, v, do, seg, cfg, causal)
  for name, g, w in zip("qkv", got, _reference_grads(q, k, v, do, seg, causal)):
    assert g.dtype == jnp.bfloat16
    assert error_ratio(g.astype(jnp.float32), w) < 0.006, name


def test_unaligned_lengths_and_head_dims_are_padded():
  """T = 100 (no multiple of the 128-token tiles) and head dims 48 / 32 (no multiple of 64), two
  rows: padded to whole tiles and 64 columns by `ops.py`, cut back afterwards."""
  seg = np.array([[1] * 30 + [2] * 45 + [3] * 15 + [0] * 10, [1] * 100], np.int32)
  q, k, v, do = _inputs(2, 100, 2, 2, 48, 32, seed=2)
  got = _grads(q, k, v, do, seg, MOSAIC)
  for name, g, w in zip("qkv", got, _reference_grads(q, k, v, do, seg)):
    assert g.shape == w.shape
    assert error_ratio(g.astype(jnp.float32), w) < 0.006, name


@pytest.mark.parametrize("cfg", [MOSAIC, MOSAIC_SPLIT], ids=["dkv", "dk_and_dv"])
def test_skips_blocks_outside_the_documents(cfg):
  """NaN keys and values in the first document's blocks reach no gradient of the second
  document: no Mosaic kernel's loop loads them for the second document's tiles."""
  seg = np.array([[1] * 128 + [2] * 128], np.int32)
  q, k, v, do = _inputs(1, 256, 1, 1, 64, 64, seed=3)
  k_bad, v_bad = k.at[:, :64].set(jnp.nan), v.at[:, :64].set(jnp.nan)
  dq, dk, dv = _grads(q, k_bad, v_bad, do.at[:, :128].set(0), seg, cfg)
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
  with pytest.raises(ValueError, match="dkv must be one of"):
    MosaicBwdConfig(dkv="xla")
  with pytest.raises(ValueError, match="num_stages must be >= 1"):
    MosaicBwdConfig(num_stages=0)
