"""pallas_kernels.kda.chunk_kda (interpret mode on CPU) against k3jax's token-by-token recurrence."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.kda import recurrent_kda
from k3jax.ops.kda_inputs import kda_gate, l2_normalize
from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.config import Tuning
from testlib import error_ratio


def _inputs(B, T, H, K, V, seed=0, n_states=None):
  ks = jax.random.split(jax.random.PRNGKey(seed), 9)
  n = B if n_states is None else n_states
  return dict(
      q=jax.random.normal(ks[0], (B, T, H, K)), k=jax.random.normal(ks[1], (B, T, H, K)),
      v=jax.random.normal(ks[2], (B, T, H, V)), x=jax.random.normal(ks[3], (B, T, H, K)),
      beta=jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))),
      h0=jax.random.normal(ks[5], (n, H, K, V)), do=jax.random.normal(ks[6], (B, T, H, V)),
      dht=jax.random.normal(ks[7], (n, H, K, V)),
      A_log=0.5 * jax.random.normal(ks[8], (H,)),
      dt_bias=jax.random.normal(jax.random.fold_in(ks[8], 1), (H * K,)))


def _loss(o, ht, d):
  return jnp.sum(o.astype(jnp.float32) * d["do"]) + jnp.sum(ht * d["dht"])


def _compare_fused(d, *, lower_bound, chunk_size, dtype=jnp.float32, cu_seqlens=None,
                   segment_ids=None, tuning=None, qk_l2norm=True):
  """Loss/grads of the kernel with the fused gate against the recurrence on kda_gate(...); q and k
  L2-normalised inside the kernels (`qk_l2norm`) or not at all.

  With segment_ids, the kernel runs under jit with the ids traced."""
  names = ("q", "k", "v", "x", "beta", "h0", "A_log", "dt_bias")
  norm = l2_normalize if qk_l2norm else (lambda x: x)

  def ref(q, k, v, x, beta, h0, a_log, dt, seg):
    g = kda_gate(x, a_log, dt, lower_bound=lower_bound)
    o, ht = recurrent_kda(norm(q), norm(k), v, g, beta, initial_state=h0,
                          output_final_state=True, cu_seqlens=cu_seqlens, segment_ids=seg)
    return _loss(o, ht, d), (o, ht)

  def pal(q, k, v, x, beta, h0, a_log, dt, seg):
    c = lambda t: t.astype(dtype)
    o, ht = chunk_kda(c(q), c(k), c(v), c(x), c(beta), initial_state=h0, output_final_state=True,
                      use_qk_l2norm=qk_l2norm, cu_seqlens=cu_seqlens, segment_ids=seg,
                      chunk_size=chunk_size, A_log=a_log, dt_bias=dt, lower_bound=lower_bound,
                      tuning=tuning)
    return _loss(o, ht, d), (o, ht)

  args = [d[n] for n in names]
  if dtype != jnp.float32:  # the reference sees the same rounded inputs
    args = [a.astype(dtype).astype(jnp.float32) if i < 5 else a for i, a in enumerate(args)]
  args.append(segment_ids)
  g_ref, (o_ref, ht_ref) = jax.grad(ref, argnums=range(8), has_aux=True)(*args)
  grad_pal = jax.grad(pal, argnums=range(8), has_aux=True)
  if segment_ids is not None:
    grad_pal = jax.jit(grad_pal)
  g_pal, (o_pal, ht_pal) = grad_pal(*args)
  assert o_pal.dtype == dtype and o_pal.shape == o_ref.shape
  # Without a gradient the kernels write no residuals (another path through them): "o" and "ht"
  # are the worse of the two paths.
  _, (o_fwd, ht_fwd) = jax.jit(pal)(*args)
  errs = {"o": max(error_ratio(o_pal, o_ref), error_ratio(o_fwd, o_ref)),
          "ht": max(error_ratio(ht_pal, ht_ref), error_ratio(ht_fwd, ht_ref))}
  errs.update({"d" + n: error_ratio(a, b) for n, a, b in zip(names, g_pal, g_ref)})
  return errs  # error_ratio has failed on any NaN/inf in o, ht or a gradient


@pytest.mark.parametrize("qk_l2norm", [True, False])
def test_fp32_fused_bounded_gate_all_grads(qk_l2norm):
  # T = 50 is not a multiple of the chunk (32); two sub-tiles per chunk exercise the inverse merge.
  d = _inputs(B=2, T=50, H=2, K=32, V=16)
  if not qk_l2norm:  # unit-size rows, so that the delta rule stays contractive
    d["q"], d["k"] = d["q"] / math.sqrt(32), d["k"] / math.sqrt(32)
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=32, qk_l2norm=qk_l2norm)
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  assert max(v for n, v in errs.items() if n.startswith("d")) <= 1e-4, errs


def test_fp32_preactivated_gate_and_chunk64():
  """Pre-activated g (runtime bound check selects the factored path), C = 64 (4 sub-tiles)."""
  d = _inputs(B=1, T=100, H=2, K=32, V=32, seed=1)
  g = jax.nn.log_sigmoid(d["x"])

  def run(fn, q, k, v, g, beta, h0):
    o, ht = fn(q, k, v, g, beta, h0)
    return _loss(o, ht, d), (o, ht)

  ref = lambda q, k, v, g, beta, h0: recurrent_kda(
      l2_normalize(q), l2_normalize(k), v, g, beta, initial_state=h0, output_final_state=True)
  pal = lambda q, k, v, g, beta, h0: chunk_kda(
      q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
  args = (d["q"], d["k"], d["v"], g, d["beta"], d["h0"])
  gr, (o_r, ht_r) = jax.grad(lambda *a: run(ref, *a), argnums=range(6), has_aux=True)(*args)
  gp, (o_p, ht_p) = jax.grad(lambda *a: run(pal, *a), argnums=range(6), has_aux=True)(*args)
  assert error_ratio(o_p, o_r) <= 1e-5 and error_ratio(ht_p, ht_r) <= 1e-5
  for a, b in zip(gp, gr):
    assert error_ratio(a, b) <= 1e-4


def test_bf16_thresholds():
  d = _inputs(B=1, T=128, H=2, K=64, V=64, seed=2)
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=64, dtype=jnp.bfloat16)
  assert errs["o"] < 0.005 and errs["ht"] < 0.005, errs
  for n in ("dq", "dk", "dv", "dh0"):
    assert errs[n] < 0.008, errs
  for n in ("dx", "dbeta"):
    assert errs[n] < 0.02, errs


def test_cu_seqlens_with_states_and_empty_sequence():
  cu = jnp.array([0, 5, 5, 40, 41, 70], jnp.int32)  # includes an empty sequence
  d = _inputs(B=1, T=70, H=1, K=16, V=16, seed=3, n_states=5)
  # The empty sequence keeps its initial state through the buffer aliased in both forward scans
  # (the forward alone's, checked by _compare_fused too, has two more inputs before h0).
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=16, cu_seqlens=cu)
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  assert max(v for n, v in errs.items() if n.startswith("d")) <= 1e-4, errs


def _segments(rows, T):
  """[B, T] int32 segment ids from per-row lists of (id, length) runs, padded with 0 to T."""
  out = np.zeros((len(rows), T), np.int32)
  for b, runs in enumerate(rows):
    t = 0
    for sid, n in runs:
      out[b, t:t + n] = sid
      t += n
  return jnp.asarray(out)


SEGMENT_ROWS = [
    # Padding inside a document (no reset), a reset exactly at the chunk boundary t = 32, two
    # resets inside one chunk, an id that comes back after another (a new document), trailing
    # padding.
    [(1, 7), (0, 3), (1, 5), (2, 17), (3, 9), (4, 5), (3, 6), (0, 2), (5, 20), (0, 26)],
    # Leading padding (the first document still continues the initial state), no reset for 40
    # tokens, then short documents.
    [(0, 5), (7, 40), (2, 1), (9, 3), (0, 4), (9, 8), (1, 39)],
]


def test_segment_ids_fp32_all_grads():
  """segment_ids (traced, under jit) against the recurrence with the same ids; T = 100 is not a
  multiple of the chunk (32)."""
  d = _inputs(B=2, T=100, H=2, K=32, V=16, seed=6)
  seg = _segments(SEGMENT_ROWS, 100)
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=32, segment_ids=seg)
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  assert max(v for n, v in errs.items() if n.startswith("d")) <= 1e-4, errs


def test_kernels_in_k_and_v_blocks():
  """Blocks of 16: gate_fwd and the intra-chunk kernels work on 2 K blocks, dense_bwd on
  2 K × 3 V blocks and the scans on 3 V blocks, with resets inside chunks, against the
  recurrence."""
  d = _inputs(B=2, T=100, H=1, K=32, V=48, seed=9)
  seg = _segments(SEGMENT_ROWS, 100)
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=64, segment_ids=seg,
                        tuning=Tuning(gate_fwd_bk=16, intra_fwd_bk=16, intra_bwd_bk=16,
                                      dense_bwd_bv=16, dense_bwd_bk=16, bv_fwd=16, bv_bwd=16))
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  assert max(v for n, v in errs.items() if n.startswith("d")) <= 1e-4, errs


def test_exact_diagonal_in_k_blocks():
  """Unbounded softplus gate (exact diagonal tiles), chunk 32, 2 K blocks of 16. (The gate
  gradients dx, A_log, dt_bias cancel at this gate scale: 1e-4 to 5e-4 with one K block too.)"""
  d = _inputs(B=1, T=40, H=1, K=32, V=16, seed=10)
  d["A_log"] = jnp.full_like(d["A_log"], math.log(50.0))
  errs = _compare_fused(d, lower_bound=None, chunk_size=32,
                        tuning=Tuning(intra_fwd_bk=16, intra_bwd_bk=16))
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  for n in ("dq", "dk", "dv", "dbeta", "dh0"):
    assert errs[n] <= 1e-4, errs


def test_segment_ids_exact_path_and_padding_outputs():
  """Pre-activated g below -5 (exact diagonal tiles) with segments, chunk 16; outputs are zero at
  padding and each row's final state is that of its last document."""
  d = _inputs(B=2, T=100, H=1, K=16, V=16, seed=7)
  seg = _segments(SEGMENT_ROWS, 100)
  g = -8.0 * jax.nn.sigmoid(d["x"])
  kw = dict(initial_state=d["h0"], output_final_state=True, segment_ids=seg)
  o_p, ht_p = jax.jit(lambda s: chunk_kda(d["q"], d["k"], d["v"], g, d["beta"], chunk_size=16,
                                          **dict(kw, segment_ids=s)))(seg)
  o_r, ht_r = recurrent_kda(d["q"], d["k"], d["v"], g, d["beta"], **kw)
  assert error_ratio(o_p, o_r) <= 1e-5 and error_ratio(ht_p, ht_r) <= 1e-5
  assert np.all(np.asarray(o_p)[np.asarray(seg) == 0] == 0.0)
  # Row 1's last document (id 1, 39 tokens) starts from zeros: h0 must not reach its final state.
  _, ht_tail = recurrent_kda(d["q"][1:, 61:], d["k"][1:, 61:], d["v"][1:, 61:], g[1:, 61:],
                             d["beta"][1:, 61:], output_final_state=True)
  assert error_ratio(ht_p[1:], ht_tail) <= 1e-5


def test_saturated_bounded_gate():
  """x + dt_bias = +20 everywhere: g ≈ -5 every token, the factored tiles' worst case (e^75)."""
  d = _inputs(B=1, T=48, H=1, K=16, V=16, seed=4)
  d["x"] = jnp.full_like(d["x"], 20.0)
  d["dt_bias"] = jnp.zeros_like(d["dt_bias"])
  d["A_log"] = jnp.zeros_like(d["A_log"])
  errs = _compare_fused(d, lower_bound=-5.0, chunk_size=16)
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  # dx is ~0 (sigmoid saturated): compare the gradients that carry signal.
  for n in ("dq", "dk", "dv", "dbeta", "dh0"):
    assert errs[n] <= 1e-4, errs


def test_unbounded_gates_take_exact_path():
  """Softplus gate with exp(A_log) = 201 (|g| up to thousands) and pre-activated g < -5: finite and
  exact, where a factored diagonal tile would overflow to inf/NaN."""
  d = _inputs(B=1, T=40, H=1, K=16, V=16, seed=5)
  d["A_log"] = jnp.full_like(d["A_log"], math.log(201.0))
  errs = _compare_fused(d, lower_bound=None, chunk_size=16)
  assert errs["o"] <= 1e-5 and errs["ht"] <= 1e-5, errs
  for n in ("dq", "dk", "dv", "dbeta", "dh0"):
    assert errs[n] <= 1e-4, errs

  g = -30.0 * jax.nn.sigmoid(d["x"])  # per-token decay down to -30: a 15-token span of -450
  o_p, ht_p = chunk_kda(d["q"], d["k"], d["v"], g, d["beta"], initial_state=d["h0"],
                        output_final_state=True, chunk_size=16)
  o_r, ht_r = recurrent_kda(d["q"], d["k"], d["v"], g, d["beta"], initial_state=d["h0"],
                            output_final_state=True)
  assert np.isfinite(np.asarray(o_p)).all() and np.isfinite(np.asarray(ht_p)).all()
  assert error_ratio(o_p, o_r) <= 1e-5 and error_ratio(ht_p, ht_r) <= 1e-5


def test_bad_arguments():
  d = _inputs(B=1, T=16, H=1, K=16, V=16)
  q, k, v, x, beta = d["q"], d["k"], d["v"], d["x"], d["beta"]
  with pytest.raises(ValueError, match="segment_ids"):
    chunk_kda(q, k, v, x, beta, segment_ids=jnp.ones((1, 15), jnp.int32))
  with pytest.raises(ValueError, match="at most one"):
    chunk_kda(q, k, v, x, beta, segment_ids=jnp.ones((1, 16), jnp.int32),
              cu_seqlens=jnp.array([0, 16], jnp.int32))
  with pytest.raises(ValueError, match="A_log"):
    chunk_kda(q, k, v, x, beta, lower_bound=-5.0)
  with pytest.raises(ValueError, match="chunk_size"):
    chunk_kda(q, k, v, x, beta, chunk_size=24)
  with pytest.raises(ValueError, match="tuning.intra_fwd_bk"):
    chunk_kda(q, k, v, x, beta, tuning=Tuning(intra_fwd_bk=12))
  with pytest.raises(ValueError, match="tuning.gate_fwd_bk"):
    chunk_kda(q, k, v, x, beta, tuning=Tuning(gate_fwd_bk=12))
  with pytest.raises(ValueError, match="cu_seqlens requires B == 1"):
    chunk_kda(jnp.concatenate([q, q]), jnp.concatenate([k, k]), jnp.concatenate([v, v]),
              jnp.concatenate([x, x]), jnp.concatenate([beta, beta]),
              cu_seqlens=jnp.array([0, 16], jnp.int32))
