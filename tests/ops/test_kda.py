"""Tests of the pure-JAX KDA ops: gate, l2norm, recurrent reference, chunked WY algorithm, packing."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import kda, kda_chunk_xla, kda_inputs
from testlib import error_ratio

GRAD_NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(seed, B, T, H, K, V, gate="logsigmoid", n_states=None):
  """fla's recipe: normalised q, k; log-sigmoid gates; sigmoid beta; random initial state."""
  rng = np.random.default_rng(seed)
  q = kda_inputs.l2_normalize(rng.standard_normal((B, T, H, K)).astype(np.float32))
  k = kda_inputs.l2_normalize(rng.standard_normal((B, T, H, K)).astype(np.float32))
  v = jnp.asarray(rng.standard_normal((B, T, H, V)).astype(np.float32))
  if gate == "logsigmoid":
    g = jax.nn.log_sigmoid(jnp.asarray(rng.standard_normal((B, T, H, K)).astype(np.float32)))
  elif gate == "unbounded":  # per-step log decays anywhere in [−50, 0], a quarter of them near 0
    g = -50.0 * rng.random((B, T, H, K)).astype(np.float32)
    g = jnp.asarray(np.where(rng.random(g.shape) < 0.25, g / 1000.0, g))
  else:
    raise ValueError(gate)
  beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((B, T, H)).astype(np.float32)))
  h0 = jnp.asarray(rng.standard_normal((n_states or B, H, K, V)).astype(np.float32))
  return q, k, v, g, beta, h0


def loss_and_grads(fn, inputs, cotangent_seed=1, **kwargs):
  """(o, final_state, grads of Σ o·do + Σ ht·dht w.r.t. q, k, v, g, beta, initial_state)."""
  o_shape, ht_shape = jax.eval_shape(
      lambda *a: fn(*a[:5], initial_state=a[5], output_final_state=True, **kwargs), *inputs)
  rng = np.random.default_rng(cotangent_seed)
  do = jnp.asarray(rng.standard_normal(o_shape.shape).astype(np.float32))
  dht = jnp.asarray(rng.standard_normal(ht_shape.shape).astype(np.float32))

  def loss(*a):
    o, ht = fn(*a[:5], initial_state=a[5], output_final_state=True, **kwargs)
    return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(ht * dht), (o, ht)

  (_, (o, ht)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
      *inputs)
  return o, ht, grads


def assert_matches(chunk_out, ref_out, tol_fwd=1e-5, tol_grad=1e-4):
  o, ht, grads = chunk_out
  o_ref, ht_ref, grads_ref = ref_out
  ratios = {"o": error_ratio(o, o_ref), "ht": error_ratio(ht, ht_ref)}
  ratios.update({f"d{n}": error_ratio(a, b) for n, a, b in zip(GRAD_NAMES, grads, grads_ref)})
  print(ratios)
  for name, r in ratios.items():
    assert r <= (tol_fwd if name in ("o", "ht") else tol_grad), (name, r)
  return ratios


# --------------------------------------------------------------------------------------------------
# Gate and l2norm against closed forms.
# --------------------------------------------------------------------------------------------------


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_gate_bounded_matches_closed_form():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 3, 4)).astype(np.float32) * 3
  a_log = rng.standard_normal(3).astype(np.float32)
  dt_bias = rng.standard_normal(12).astype(np.float32)
  g = kda_inputs.kda_gate(x, a_log, dt_bias, lower_bound=-4.0)
  want = -4.0 * _np_sigmoid(np.exp(a_log)[:, None] * (x + dt_bias.reshape(3, 4)))
  assert g.dtype == jnp.float32
  np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-6)
  assert float(g.min()) > -4.0 and float(g.max()) < 0.0
  # A_log None means rate 1; dt_bias None means zero bias.
  np.testing.assert_allclose(kda_inputs.kda_gate(x, None), -5.0 * _np_sigmoid(x), rtol=1e-6,
                             atol=1e-6)


def test_gate_unbounded_matches_closed_form():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((7, 2, 8)).astype(np.float32) * 4
  a_log = np.log(rng.uniform(1, 16, 2)).astype(np.float32)
  dt_bias = rng.standard_normal(16).astype(np.float32)
  g = kda_inputs.kda_gate(jnp.asarray(x, jnp.bfloat16), a_log, dt_bias, lower_bound=None)
  xb = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  want = -np.exp(a_log)[:, None] * np.logaddexp(0.0, xb + dt_bias.reshape(2, 8))
  assert g.dtype == jnp.float32
  np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lower_bound", [-5.5, 0.0, 1.0, "x"])
def test_gate_rejects_bad_lower_bound(lower_bound):
  with pytest.raises(ValueError, match="lower_bound"):
    kda_inputs.kda_gate(jnp.zeros((2, 3, 4)), jnp.zeros(3), jnp.zeros(12),
                        lower_bound=lower_bound)


def test_gate_rejects_bad_shapes():
  with pytest.raises(ValueError, match="A_log"):
    kda_inputs.kda_gate(jnp.zeros((2, 3, 4)), jnp.zeros(4))
  with pytest.raises(ValueError, match="dt_bias"):
    kda_inputs.kda_gate(jnp.zeros((2, 3, 4)), jnp.zeros(3), jnp.zeros((3, 4)))


def test_l2_normalize_matches_closed_form():
  x = np.random.default_rng(2).standard_normal((3, 4, 16)).astype(np.float32)
  want = x / np.sqrt(np.sum(x.astype(np.float64) ** 2, -1, keepdims=True) + 1e-6)
  got = kda_inputs.l2_normalize(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_allclose(kda_inputs.l2_normalize(x), want, rtol=1e-6, atol=1e-7)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(kda_inputs.l2_normalize(np.zeros((2, 4))), 0.0)


# --------------------------------------------------------------------------------------------------
# Recurrent reference against a plain numpy loop of the definition.
# --------------------------------------------------------------------------------------------------


def numpy_kda(q, k, v, g, beta, scale, h0):
  """The three-step definition, one token and one head at a time, in float64."""
  q, k, v, g, beta, h0 = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, h0))
  B, T, H, _ = q.shape
  o = np.zeros(v.shape)
  states = h0.copy()
  for b in range(B):
    for h in range(H):
      s = states[b, h]
      for t in range(T):
        s = np.exp(g[b, t, h])[:, None] * s
        s = s + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h] - s.T @ k[b, t, h])
        o[b, t, h] = s.T @ (scale * q[b, t, h])
      states[b, h] = s
  return o, states


def test_recurrent_matches_numpy_loop():
  q, k, v, g, beta, h0 = make_inputs(3, B=2, T=9, H=2, K=3, V=4)
  o, ht = kda.recurrent_kda(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True)
  o_ref, ht_ref = numpy_kda(q, k, v, g, beta, 0.7, h0)
  np.testing.assert_allclose(o, o_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ht, ht_ref, rtol=1e-5, atol=1e-5)
  o_default, none = kda.recurrent_kda(q, k, v, g, beta)
  assert none is None
  np.testing.assert_allclose(o_default, numpy_kda(q, k, v, g, beta, 3 ** -0.5, 0 * h0)[0],
                             rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# Chunked vs recurrent.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,chunk_size,K,V", [(100, 16, 16, 24), (77, 32, 8, 12), (130, 64, 16, 16)])
def test_chunk_matches_recurrent(T, chunk_size, K, V):
  inputs = make_inputs(4, B=2, T=T, H=2, K=K, V=V)
  got = loss_and_grads(kda.chunk_kda, inputs, chunk_size=chunk_size, backend="xla")
  want = loss_and_grads(kda.recurrent_kda, inputs)
  assert got[0].shape == (2, T, 2, V) and got[1].shape == (2, 2, K, V)
  assert_matches(got, want)


def test_chunk_qk_l2norm_and_dtypes():
  q, k, v, g, beta, _ = make_inputs(5, B=1, T=40, H=2, K=8, V=8)
  rng = np.random.default_rng(6)
  q_raw = jnp.asarray(rng.standard_normal(q.shape).astype(np.float32)) * 3
  k_raw = jnp.asarray(rng.standard_normal(k.shape).astype(np.float32)) * 3
  o, ht = kda.chunk_kda(q_raw, k_raw, v.astype(jnp.bfloat16), g, beta, use_qk_l2norm=True,
                        chunk_size=16, output_final_state=True)
  o_ref, ht_ref = kda.recurrent_kda(kda_inputs.l2_normalize(q_raw),
                                    kda_inputs.l2_normalize(k_raw),
                                    v.astype(jnp.bfloat16).astype(jnp.float32), g, beta,
                                    output_final_state=True)
  assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
  assert error_ratio(o, o_ref) < 5e-3  # bf16 rounding of the output only
  assert error_ratio(ht, ht_ref) < 1e-5


def test_chunk_is_exactly_causal():
  T, P = 80, 37
  inputs = make_inputs(7, B=1, T=T, H=2, K=8, V=8)
  rng = np.random.default_rng(8)
  perturbed = []
  for x in inputs[:5]:
    noise = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    after = (jnp.arange(T) >= P).reshape((1, T) + (1,) * (x.ndim - 2))
    perturbed.append(jnp.where(after, jnp.minimum(x + noise, 0.0) if x is inputs[3] else x + noise,
                               x))
  run = jax.jit(lambda *a: kda.chunk_kda(*a, chunk_size=16)[0])
  o, o_pert = run(*inputs[:5]), run(*perturbed)
  assert float(jnp.max(jnp.abs(o[:, P:] - o_pert[:, P:]))) > 1e-3  # the perturbation matters
  assert float(jnp.max(jnp.abs(o[:, :P] - o_pert[:, :P]))) <= 1e-7
  # A loss on the prefix has exactly zero gradient on the suffix inputs.
  grads = jax.jit(jax.grad(lambda *a: jnp.sum(kda.chunk_kda(*a, chunk_size=16)[0][:, :P] ** 2),
                           argnums=(0, 1, 2, 3, 4)))(*inputs[:5])
  for name, gr in zip(GRAD_NAMES, grads):
    assert float(jnp.max(jnp.abs(gr[:, P:]))) == 0.0, name
    assert float(jnp.max(jnp.abs(gr[:, :P]))) > 0.0, name


def test_state_carry_equals_one_pass():
  T, split = 80, 40
  q, k, v, g, beta, h0 = make_inputs(9, B=2, T=T, H=2, K=8, V=12)
  run = lambda sl, state: kda.chunk_kda(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                        initial_state=state, output_final_state=True, chunk_size=32)
  o_full, ht_full = run(slice(0, T), h0)
  o_a, ht_a = run(slice(0, split), h0)
  o_b, ht_b = run(slice(split, T), ht_a)
  assert error_ratio(jnp.concatenate([o_a, o_b], axis=1), o_full) <= 1e-5
  assert error_ratio(ht_b, ht_full) <= 1e-5


# --------------------------------------------------------------------------------------------------
# Packing: cu_seqlens and segment ids.
# --------------------------------------------------------------------------------------------------


def separate_runs(inputs, docs, states):
  """Reference for packed inputs: the numpy loop run on each document alone.

  docs: per row, a list of token-index arrays (one per document); states: per row, per document, the
  initial state or None. Returns (o with zeros elsewhere, per-row list of per-document final states).
  """
  q, k, v, g, beta, _ = inputs
  o = np.zeros(v.shape, np.float32)
  finals = []
  for b, row_docs in enumerate(docs):
    row_finals = []
    for idx, state in zip(row_docs, states[b]):
      if len(idx) == 0:
        row_finals.append(np.asarray(state))
        continue
      take = lambda x: np.asarray(x)[b:b + 1, idx]
      h0 = np.zeros((1,) + v.shape[2:3] + (q.shape[3], v.shape[3])) if state is None else state[None]
      o_doc, ht = numpy_kda(take(q), take(k), take(v), take(g), take(beta), q.shape[3] ** -0.5, h0)
      o[b, idx] = o_doc[0]
      row_finals.append(ht[0])
    finals.append(row_finals)
  return o, finals


def test_cu_seqlens_equals_separate_runs():
  T = 100
  cu = np.array([0, 15, 15, 70, 100], np.int32)  # includes an empty sequence
  inputs = make_inputs(10, B=1, T=T, H=2, K=8, V=12, n_states=4)
  h0 = inputs[5]
  docs = [[np.arange(cu[n], cu[n + 1]) for n in range(4)]]
  o_ref, finals = separate_runs(inputs, docs, [list(h0)])
  ht_ref = np.stack(finals[0])
  got = loss_and_grads(kda.chunk_kda, inputs, chunk_size=16, cu_seqlens=jnp.asarray(cu))
  want = loss_and_grads(kda.recurrent_kda, inputs, cu_seqlens=jnp.asarray(cu))
  for o, ht in (got[:2], want[:2]):
    assert ht.shape == (4, 2, 8, 12)
    assert error_ratio(o, o_ref) <= 1e-5
    assert error_ratio(ht, ht_ref) <= 1e-5
  # Gradients through the packed path (per-sequence states included), chunked vs recurrent.
  assert_matches(got, want)


def test_cu_seqlens_traced_under_jit():
  T = 90
  inputs = make_inputs(11, B=1, T=T, H=1, K=8, V=8, n_states=3)
  q, k, v, g, beta, _ = inputs
  run = jax.jit(lambda cu: kda.chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                         chunk_size=32))
  for cu in ([0, 40, 41, 90], [0, 3, 64, 80]):  # the second leaves tokens 80.. as padding
    cu = np.asarray(cu, np.int32)
    o, ht = run(jnp.asarray(cu))
    docs = [[np.arange(cu[n], cu[n + 1]) for n in range(3)]]
    o_ref, finals = separate_runs(inputs, docs, [[None] * 3])
    assert error_ratio(o, o_ref) <= 1e-5
    assert error_ratio(ht, np.stack(finals[0])) <= 1e-5
    if cu[-1] < T:
      assert float(jnp.max(jnp.abs(o[:, cu[-1]:]))) == 0.0


def test_segment_ids_equal_separate_runs():
  T = 100
  seg = np.zeros((2, T), np.int32)
  seg[0, :20], seg[0, 20:50], seg[0, 60:90] = 1, 2, 3     # padding between docs and at the end
  seg[1, 5:45], seg[1, 48:68], seg[1, 68:] = 1, 1, 2       # doc 1 continues across padding
  inputs = make_inputs(12, B=2, T=T, H=2, K=8, V=8)
  h0 = inputs[5]
  docs = [[np.arange(0, 20), np.arange(20, 50), np.arange(60, 90)],
          [np.concatenate([np.arange(5, 45), np.arange(48, 68)]), np.arange(68, T)]]
  o_ref, finals = separate_runs(inputs, docs, [[h0[0], None, None], [h0[1], None]])
  ht_ref = np.stack([finals[0][-1], finals[1][-1]])
  for fn in (kda.chunk_kda, kda.recurrent_kda):
    kwargs = {"chunk_size": 16} if fn is kda.chunk_kda else {}
    o, ht = fn(*inputs[:5], initial_state=h0, output_final_state=True,
               segment_ids=jnp.asarray(seg), **kwargs)
    assert error_ratio(o, o_ref) <= 1e-5, fn.__name__
    assert error_ratio(ht, ht_ref) <= 1e-5, fn.__name__
    assert float(jnp.max(jnp.abs(o[0, 90:]))) == 0.0


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_qkv_zero_at_padding_skips_only_redundant_masking(backend):
  """With q, k, v already zero at padding (as the KDA layer's short convolutions make them),
  qkv_zero_at_padding=True gives the same outputs, final states and gradients of g and beta as
  the masking path, and the same q, k, v gradients at real tokens (packed rows with padding
  between documents, inside one and at the end; Pallas interpreted)."""
  T = 100
  seg = np.zeros((2, T), np.int32)
  seg[0, :20], seg[0, 20:50], seg[0, 60:90] = 1, 2, 3
  seg[1, 5:45], seg[1, 48:68], seg[1, 68:] = 1, 1, 2
  real = jnp.asarray(seg > 0)[:, :, None, None]
  q, k, v, g, beta, h0 = make_inputs(13, B=2, T=T, H=2, K=16, V=16)
  q, k, v = (jnp.where(real, x, 0.0) for x in (q, k, v))
  cot = jax.random.normal(jax.random.PRNGKey(3), v.shape)

  def run(zero, q, k, v, g, beta):
    o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          segment_ids=jnp.asarray(seg), chunk_size=16, backend=backend,
                          use_qk_l2norm=True, qkv_zero_at_padding=zero)
    return jnp.sum(o * cot) + jnp.sum(ht), (o, ht)

  grads = {}
  for zero in (False, True):
    grads[zero] = jax.grad(run, argnums=(1, 2, 3, 4, 5), has_aux=True)(zero, q, k, v, g, beta)
  (g_masked, (o_masked, ht_masked)), (g_unmasked, (o, ht)) = grads[False], grads[True]
  assert error_ratio(o, o_masked) <= 1e-6 and error_ratio(ht, ht_masked) <= 1e-6
  for name, a, b in zip("qkvgb", g_unmasked, g_masked):
    if name in "qkv":
      a, b = jnp.where(real, a, 0.0), jnp.where(real, b, 0.0)
    assert error_ratio(a, b) <= 1e-6, name


# --------------------------------------------------------------------------------------------------
# Gate extremes.
# --------------------------------------------------------------------------------------------------


def test_saturated_bounded_gate_long_sequence():
  T = 4096
  q, k, v, _, beta, h0 = make_inputs(13, B=1, T=T, H=1, K=8, V=8)
  g = kda_inputs.kda_gate(jnp.full((1, T, 1, 8), 30.0), jnp.zeros(1), jnp.zeros(8))
  assert float(jnp.min(g)) == -5.0
  o_ref, ht_ref = kda.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
  for dtype in (jnp.float32, jnp.bfloat16):
    args = tuple(x.astype(dtype) for x in (q, k, v)) + (g, beta, h0)

    def loss(*a):
      o, ht = kda.chunk_kda(*a[:5], initial_state=a[5], output_final_state=True)
      return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht ** 2), (o, ht)

    (_, (o, ht)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)),
                                                     has_aux=True))(*args)
    assert o.dtype == dtype and bool(jnp.all(jnp.isfinite(o.astype(jnp.float32))))
    for name, gr in zip(GRAD_NAMES, grads):
      assert bool(jnp.all(jnp.isfinite(gr.astype(jnp.float32)))), (dtype, name)
    if dtype == jnp.float32:
      assert error_ratio(o, o_ref) <= 1e-5 and error_ratio(ht, ht_ref) <= 1e-5
    else:  # bf16 inputs: only rounding of q, k, v (and of o) separates it from the fp32 run
      assert error_ratio(o, o_ref) < 2e-2 and error_ratio(ht, ht_ref) < 2e-2


def test_unbounded_gate_is_exact():
  inputs = make_inputs(14, B=1, T=150, H=2, K=8, V=8, gate="unbounded")
  assert float(jnp.min(inputs[3])) < -45.0
  got = loss_and_grads(kda.chunk_kda, inputs, chunk_size=64)
  want = loss_and_grads(kda.recurrent_kda, inputs)
  for x in jax.tree_util.tree_leaves(got):
    assert bool(jnp.all(jnp.isfinite(x)))
  assert_matches(got, want)
  # The unbounded softplus gate of a real checkpoint (exp(A_log) up to 201).
  x = jnp.asarray(np.random.default_rng(15).standard_normal((1, 150, 2, 8)).astype(np.float32)) * 3
  g = kda_inputs.kda_gate(x, jnp.log(jnp.array([201.0, 8.0])), None, lower_bound=None)
  o, ht = kda.chunk_kda(*inputs[:3], g, inputs[4], output_final_state=True)
  o_ref, ht_ref = kda.recurrent_kda(*inputs[:3], g, inputs[4], output_final_state=True)
  assert error_ratio(o, o_ref) <= 1e-5 and error_ratio(ht, ht_ref) <= 1e-5


# --------------------------------------------------------------------------------------------------
# Argument validation and backend dispatch.
# --------------------------------------------------------------------------------------------------


def _args(B=1, T=8, H=2, K=4, V=6):
  return dict(q=jnp.zeros((B, T, H, K)), k=jnp.zeros((B, T, H, K)), v=jnp.zeros((B, T, H, V)),
              g=jnp.zeros((B, T, H, K)), beta=jnp.zeros((B, T, H)))


# Bad arguments that both chunk_kda and recurrent_kda take ...
_BAD_SHARED = [
    ({"q": jnp.zeros((8, 2, 4))}, "q"),
    ({"k": jnp.zeros((1, 8, 2, 5))}, "k"),
    ({"v": jnp.zeros((1, 7, 2, 6))}, "v"),
    ({"g": jnp.zeros((1, 8, 2, 3))}, "g"),
    ({"beta": jnp.zeros((1, 8, 2, 1))}, "beta"),
    ({"q": jnp.zeros((1, 8, 2, 4), jnp.int32)}, "q"),
    ({"initial_state": jnp.zeros((1, 2, 6, 4))}, "initial_state"),
    ({"initial_state": jnp.zeros((1, 2, 4, 6), jnp.int32)}, "initial_state"),
    ({"cu_seqlens": jnp.array([0, 8], jnp.float32)}, "cu_seqlens"),
    ({"cu_seqlens": jnp.array([0, 9], jnp.int32)}, "cu_seqlens"),
    ({"cu_seqlens": jnp.array([0, 4, 8]), "initial_state": jnp.zeros((1, 2, 4, 6))},
     "initial_state"),
    ({"segment_ids": jnp.zeros((1, 7), jnp.int32)}, "segment_ids"),
    ({"scale": -1.0}, "scale"),
]
# ... and those of the arguments that only chunk_kda has.
_BAD_CHUNK_ONLY = [
    ({"chunk_size": 24}, "chunk_size"),
    ({"backend": "cuda"}, "backend"),
]


@pytest.mark.parametrize("fn,override,name", [
    pytest.param(fn, override, name, id=f"{fn.__name__}-{name}-{i}")
    for fn, cases in ((kda.chunk_kda, _BAD_SHARED + _BAD_CHUNK_ONLY),
                      (kda.recurrent_kda, _BAD_SHARED))
    for i, (override, name) in enumerate(cases)])
def test_bad_arguments_raise(fn, override, name):
  kwargs = {**_args(), **override}
  with pytest.raises(ValueError, match=name):
    fn(**kwargs)


def test_growing_gate_is_rejected_when_concrete():
  """g > 0 (a state that grows) is refused for concrete inputs; g == 0 (no decay) is allowed."""
  a = _args(T=16)
  kda.chunk_kda(**a, chunk_size=16)
  grown = a["g"].at[0, 5, 1, 2].set(0.25)
  with pytest.raises(ValueError, match=r"g must be a log decay <= 0 .* largest entry is 0.25"):
    kda.chunk_kda(**dict(a, g=grown), chunk_size=16)


@pytest.mark.parametrize("lower_bound", [-5.0, -0.5, None])
def test_gate_never_grows(lower_bound):
  """What the KDA layer feeds chunk_kda (kda_gate's output) is <= 0 even for extreme inputs, so
  the layer needs no check under jit."""
  x = jnp.asarray(np.linspace(-1e4, 1e4, 2 * 3 * 2 * 4, dtype=np.float32).reshape(2, 3, 2, 4))
  A_log = jnp.asarray(np.array([-3.0, 3.0], np.float32))
  dt_bias = jnp.asarray(np.full((2 * 4,), 5.0, np.float32))
  g = kda_inputs.kda_gate(x, A_log, dt_bias, lower_bound=lower_bound)
  assert float(jnp.max(g)) <= 0.0


def test_cu_seqlens_requires_batch_one():
  with pytest.raises(ValueError, match="cu_seqlens.*B == 1"):
    kda.chunk_kda(**_args(B=2), cu_seqlens=jnp.array([0, 8], jnp.int32))


def test_backends(monkeypatch):
  a = _args(T=20)
  a = {n: x - 0.1 if n == "g" else x + 0.1 for n, x in a.items()}
  o_xla, _ = kda.chunk_kda(**a, chunk_size=16, backend="xla")
  if jax.default_backend() != "gpu":
    o_auto, _ = kda.chunk_kda(**a, chunk_size=16, backend="auto")
    np.testing.assert_array_equal(o_auto, o_xla)
  monkeypatch.setitem(sys.modules, "pallas_kernels.kda", None)  # makes the import fail
  with pytest.raises(ImportError, match="backend='pallas'"):
    kda.chunk_kda(**a, chunk_size=16, backend="pallas")
  np.testing.assert_array_equal(kda.chunk_kda(**a, chunk_size=16, backend="auto")[0], o_xla)


def test_chunk_is_finite_and_exact_when_all_keys_align():
  """Identical keys with beta ~ 1 make the in-chunk L entries ~1: the (I + L)^-1 must stay stable
  (power-series inverses overflow here)."""
  L = np.tril(np.full((64, 64), 0.99, np.float32), -1)
  np.testing.assert_allclose(np.asarray(kda_chunk_xla._unit_lower_inverse(jnp.asarray(L))),
                             np.linalg.inv(np.eye(64) + L.astype(np.float64)), atol=1e-5)
  rng = np.random.default_rng(11)
  B, T, H, K, V = 1, 128, 1, 16, 16
  k = np.broadcast_to(rng.normal(size=(1, 1, 1, K)), (B, T, H, K)).astype(np.float32)
  q = rng.normal(size=(B, T, H, K)).astype(np.float32)
  v = rng.normal(size=(B, T, H, V)).astype(np.float32)
  g = np.full((B, T, H, K), -0.01, np.float32)
  beta = np.full((B, T, H), 0.99, np.float32)
  args = [jnp.asarray(x) for x in (q, k, v, g, beta)]
  o_chunk, _ = kda.chunk_kda(*args, use_qk_l2norm=True, backend="xla")
  qn, kn = kda_inputs.l2_normalize(args[0]), kda_inputs.l2_normalize(args[1])
  o_ref, _ = kda.recurrent_kda(qn, kn, *args[2:])
  assert np.all(np.isfinite(np.asarray(o_chunk)))
  np.testing.assert_allclose(np.asarray(o_chunk), np.asarray(o_ref), atol=1e-4)


# --------------------------------------------------------------------------------------------------
# The fused gate: chunk_kda(x, A_log=, dt_bias=, lower_bound=) against chunk_kda(kda_gate(x, ...)).
# --------------------------------------------------------------------------------------------------


def _fused_inputs(B=2, T=40, H=2, K=16, V=16, seed=3):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  seg = jnp.asarray([[1] * 15 + [2] * 20 + [0] * 5, [3] * 40], jnp.int32)
  return dict(q=jax.random.normal(ks[0], (B, T, H, K)), k=jax.random.normal(ks[1], (B, T, H, K)),
              v=jax.random.normal(ks[2], (B, T, H, V)), x=jax.random.normal(ks[3], (B, T, H, K)),
              beta=jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, H))),
              A_log=0.5 * jax.random.normal(ks[5], (H,)),
              dt_bias=jax.random.normal(ks[6], (H * K,)), seg=seg)


def _fused_grads(d, lower_bound, fused, backend):
  names = ("q", "k", "v", "x", "beta", "A_log", "dt_bias")
  do = jax.random.normal(jax.random.PRNGKey(9), d["v"].shape)

  def loss(q, k, v, x, beta, a_log, dt):
    if fused:
      o, _ = kda.chunk_kda(q, k, v, x, beta, use_qk_l2norm=True, segment_ids=d["seg"],
                           chunk_size=16, backend=backend, A_log=a_log, dt_bias=dt,
                           lower_bound=lower_bound)
    else:
      g = kda_inputs.kda_gate(x, a_log, dt, lower_bound=lower_bound)
      o, _ = kda.chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, segment_ids=d["seg"],
                           chunk_size=16, backend=backend)
    return jnp.sum(o * do), o

  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True))(
      *[d[n] for n in names])
  return o, dict(zip(names, grads))


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_fused_gate_equals_the_gate_then_the_chunks(backend, lower_bound):
  """The KDA layer passes the gate's pre-activation and its parameters (the Pallas kernels form the
  decay themselves): outputs and every gradient, A_log's and dt_bias's included, equal those of
  kda_gate followed by chunk_kda on the XLA path (packed rows with padding; Pallas interpreted)."""
  d = _fused_inputs()
  o_ref, g_ref = _fused_grads(d, lower_bound, fused=False, backend="xla")
  o, g = _fused_grads(d, lower_bound, fused=True, backend=backend)
  tol = 1e-6 if backend == "xla" else 2e-4
  assert error_ratio(o, o_ref) <= tol
  for name in g_ref:
    assert error_ratio(g[name], g_ref[name]) <= tol, (name, error_ratio(g[name], g_ref[name]))


def test_fused_gate_under_a_batch_mesh_equals_one_device():
  """Under a mesh the Pallas kernel runs per device on its rows (shard_map): the fused gate's
  parameters enter it as inputs, and their gradients sum over the devices' rows."""
  d = _fused_inputs(B=8)
  d["seg"] = jnp.tile(d["seg"][:1], (8, 1))
  o_one, g_one = _fused_grads(d, -5.0, fused=True, backend="pallas")
  from k3jax.parallel import sharding
  with jax.set_mesh(sharding.make_mesh("data:8")):   # as the training step runs under a mesh
    o_mesh, g_mesh = _fused_grads(d, -5.0, fused=True, backend="pallas")
  assert error_ratio(o_mesh, o_one) <= 1e-6
  for name in g_one:
    assert error_ratio(g_mesh[name], g_one[name]) <= 1e-6, name


def test_fused_gate_arguments_are_checked():
  d = _fused_inputs()
  a = dict(q=d["q"], k=d["k"], v=d["v"], g=d["x"], beta=d["beta"], chunk_size=16)
  with pytest.raises(ValueError, match="pass A_log too"):
    kda.chunk_kda(**a, dt_bias=d["dt_bias"])
  with pytest.raises(ValueError, match="lower_bound"):
    kda.chunk_kda(**a, A_log=d["A_log"], lower_bound=-6.0)
  with pytest.raises(ValueError, match="A_log must have shape"):
    kda.chunk_kda(**a, A_log=d["A_log"][:1], lower_bound=-5.0)
