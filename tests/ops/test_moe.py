"""routed_experts against a naive per-token loop and a dense every-expert reference, in dropless
and capacity modes; the grouped matmuls (tiled, tokamax) against jax.lax.ragged_dot; the
gather-only dispatch (no scatter in the compiled gradient)."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops import grouped_matmul, moe, moe_rows
from k3jax.ops.grouped_matmul import (default_ragged_dot, takes_zero_outside, tiled_ragged_dot,
                                     tokamax_ragged_dot)
from k3jax.ops.moe import expert_capacity, routed_experts
from k3jax.ops.moe_rows import gather_rows, sort_with_inverse, sorted_group_sizes
from k3jax.ops.moe_reference import dense_routed_experts

B1, B2 = 4.0, 25.0


def _np_expert(x, wg, wu, wo):
  a, b = x @ wg, x @ wu
  h = B1 * np.tanh(a / B1) / (1 + np.exp(-a)) * B2 * np.tanh(b / B2)
  return h @ wo


def _problem(seed, n=40, latent=8, hidden=12, experts=6, k=2, skew=False, unused=None):
  rng = np.random.default_rng(seed)
  z = rng.normal(size=(n, latent)).astype(np.float32)
  logits = rng.normal(size=(n, experts)) + (np.linspace(2, -2, experts) if skew else 0)
  if unused is not None:
    logits[:, unused] = -np.inf
  idx = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
  w = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
  wg = rng.normal(0, 0.4, (experts, latent, hidden)).astype(np.float32)
  wu = rng.normal(0, 0.4, (experts, latent, hidden)).astype(np.float32)
  wo = rng.normal(0, 0.4, (experts, hidden, latent)).astype(np.float32)
  return z, idx, w, wg, wu, wo


def _naive(z, idx, w, wg, wu, wo, valid=None, kept=None):
  """Per-token loop over its k experts; `kept[i, j]` False drops an assignment."""
  n, k = idx.shape
  y = np.zeros(z.shape, np.float64)
  for i in range(n):
    if valid is not None and not valid[i]:
      continue
    for j in range(k):
      if kept is not None and not kept[i, j]:
        continue
      e = idx[i, j]
      y[i] += w[i, j] * _np_expert(z[i].astype(np.float64), wg[e], wu[e], wo[e])
  return y


def _run(args, capacity_factor=0.0, valid=None):
  z, idx, w, wg, wu, wo = (jnp.asarray(a) for a in args)
  f = jax.jit(lambda *a, valid: routed_experts(*a, beta1=B1, beta2=B2, valid=valid,
                                               capacity_factor=capacity_factor))
  return f(z, idx, w, wg, wu, wo, valid=valid)


def test_dropless_matches_naive_loop():
  args = _problem(0)
  y, stats = _run(args)
  np.testing.assert_allclose(np.asarray(y), _naive(*args), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(stats["load"]),
                                np.bincount(args[1].ravel(), minlength=6))
  assert int(stats["dropped"]) == 0


def test_dropless_with_padding_and_unused_expert():
  z, idx, w, wg, wu, wo = _problem(1, experts=7, unused=3)  # expert 3: an empty group
  valid = np.random.default_rng(2).uniform(size=40) > 0.3
  y, stats = _run((z, idx, w, wg, wu, wo), valid=jnp.asarray(valid))
  np.testing.assert_allclose(np.asarray(y), _naive(z, idx, w, wg, wu, wo, valid=valid),
                             rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(y)[~valid] == 0)
  expected_load = np.bincount(idx[valid].ravel(), minlength=7)
  np.testing.assert_array_equal(np.asarray(stats["load"]), expected_load)
  assert expected_load[3] == 0


def test_gradients_match_dense_reference():
  z, idx, w, wg, wu, wo = (jnp.asarray(a) for a in _problem(3, n=16))
  experts = wg.shape[0]

  def dense(z, w, wg, wu, wo):
    # Every expert on every token, weighted by a dense [N, E] combine matrix.
    gate = jnp.einsum("nl,elm->enm", z, wg)
    up = jnp.einsum("nl,elm->enm", z, wu)
    h = B1 * jnp.tanh(gate / B1) * jax.nn.sigmoid(gate) * B2 * jnp.tanh(up / B2)
    out = jnp.einsum("enm,eml->enl", h, wo)
    combine = jnp.sum(jax.nn.one_hot(idx, experts) * w[..., None], axis=1)  # [N, E]
    return jnp.einsum("enl,ne->nl", out, combine)

  def ragged(z, w, wg, wu, wo):
    return routed_experts(z, idx, w, wg, wu, wo, beta1=B1, beta2=B2)[0]

  cot = jax.random.normal(jax.random.PRNGKey(0), z.shape)
  g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * cot), argnums=tuple(range(5))))(
      z, w, wg, wu, wo)
  g = jax.jit(jax.grad(lambda *a: jnp.sum(ragged(*a) * cot), argnums=tuple(range(5))))(
      z, w, wg, wu, wo)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_capacity_drops_exactly_the_overflow():
  args = _problem(4, n=48, experts=6, k=2, skew=True)
  z, idx, w, wg, wu, wo = args
  valid = np.ones(48, bool)
  valid[[5, 17, 30]] = False
  factor = 1.0
  cap = expert_capacity(48, 2, 6, factor)
  assert cap == math.ceil(48 * 2 / 6)
  y, stats = _run(args, capacity_factor=factor, valid=jnp.asarray(valid))
  # Keep the first `cap` valid assignments of each expert in (token, slot) order.
  kept = np.zeros(idx.shape, bool)
  seen = np.zeros(6, int)
  for i in range(48):
    for j in range(2):
      if valid[i]:
        e = idx[i, j]
        kept[i, j] = seen[e] < cap
        seen[e] += 1
  load = np.bincount(idx[valid].ravel(), minlength=6)
  overflow = np.maximum(load - cap, 0).sum()
  assert overflow > 0, "the skewed routing should overflow some expert"
  assert int(stats["dropped"]) == overflow == (~kept & valid[:, None]).sum()
  np.testing.assert_array_equal(np.asarray(stats["load"]), load)
  np.testing.assert_allclose(np.asarray(y), _naive(z, idx, w, wg, wu, wo, valid, kept),
                             rtol=1e-5, atol=1e-5)


def test_capacity_large_enough_equals_dropless():
  args = _problem(5)
  y0, _ = _run(args)
  y1, stats = _run(args, capacity_factor=6.0)  # C = N·k: nothing can overflow
  assert int(stats["dropped"]) == 0
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)


def test_jit_and_bad_input():
  args = [jnp.asarray(a) for a in _problem(6)]
  f = jax.jit(lambda *a: routed_experts(*a, beta1=B1, beta2=B2, capacity_factor=2.0))
  y, _ = f(*args)
  assert y.shape == args[0].shape
  with pytest.raises(ValueError, match="expert_weight"):
    routed_experts(args[0], args[1], args[2][:, :1], *args[3:], beta1=B1, beta2=B2)
  with pytest.raises(ValueError, match="w_out"):
    routed_experts(*args[:5], args[5][:, :3], beta1=B1, beta2=B2)
  with pytest.raises(ValueError, match="capacity_factor"):
    routed_experts(*args, beta1=B1, beta2=B2, capacity_factor=-1.0)


# ------------------------------------------------------------------------------------------------
# tiled_ragged_dot: the GPU grouped matmul, against jax.lax.ragged_dot (values and gradients).
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,tile", [
    ((5, 0, 17, 3), 4),        # an empty group, groups not multiples of the tile
    ((8, 8, 8, 8), 8),         # exact multiples
    ((1, 2, 0, 0), 16),        # rows past Σ group_sizes (M = 12 > 3) must come out zero
    ((0, 0, 12, 0), 5),        # everything in one group
])
def test_tiled_ragged_dot_matches_ragged_dot(sizes, tile):
  rng = np.random.default_rng(len(sizes) + tile)
  M, L, F = 12 if sum(sizes) <= 12 else sum(sizes), 6, 7
  lhs = jnp.asarray(rng.standard_normal((M, L)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), L, F)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  cot = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)

  def loss(fn, a, b):
    return jnp.sum(fn(a, b, gs, preferred_element_type=jnp.float32) * cot)

  want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
  got = tiled_ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32, tile=tile,
                         tiles_per_step=3)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(got)[sum(sizes):], 0.0)
  tiled = lambda a, b, g, **kw: tiled_ragged_dot(a, b, g, tile=tile, tiles_per_step=2, **kw)
  for gw, gg in zip(jax.grad(lambda a, b: loss(jax.lax.ragged_dot, a, b), (0, 1))(lhs, rhs),
                    jax.grad(lambda a, b: loss(tiled, a, b), (0, 1))(lhs, rhs)):
    np.testing.assert_allclose(gg, gw, rtol=1e-5, atol=1e-5)


def test_tiled_ragged_dot_bf16_accumulates_in_fp32():
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((3, 64, 8)), jnp.bfloat16)
  gs = jnp.asarray([10, 25, 5], jnp.int32)
  got = tiled_ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32, tile=16)
  want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_grouped_situ_glu_rejects_an_unknown_activation():
  z = jnp.zeros((4, 2))
  with pytest.raises(ValueError, match="activation='triton'"):
    moe.grouped_situ_glu(z, jnp.zeros((1, 2, 3)), jnp.zeros((1, 2, 3)), jnp.zeros((1, 3, 2)),
                         jnp.array([4]), jnp.ones((4,), bool), beta1=B1, beta2=B2,
                         ragged_dot_fn=jax.lax.ragged_dot, activation="triton")


def test_default_ragged_dot_choices():
  assert default_ragged_dot("tiled") is tiled_ragged_dot
  assert default_ragged_dot("ragged_dot") is jax.lax.ragged_dot
  tk = default_ragged_dot("tokamax")
  assert tk.func is tokamax_ragged_dot
  # This machine (CI, CPU) has no Mosaic GPU: tokamax's XLA implementation.
  assert jax.default_backend() != "cpu" or tk.keywords == {"implementation": "xla"}
  if jax.default_backend() == "cpu":  # XLA:CPU's dense ragged_dot is 2x slower than tiled here
    assert default_ragged_dot("auto") is tiled_ragged_dot
  with pytest.raises(ValueError, match="moe_grouped_matmul"):
    default_ragged_dot("dense")


def test_routed_experts_with_tiled_matches_ragged_dot():
  rng = np.random.default_rng(1)
  N, D, E, k, F = 24, 8, 4, 2, 6
  z = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  idx = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(N)]), jnp.int32)
  wts = jnp.asarray(rng.random((N, k)), jnp.float32)
  wg, wu = (jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32) for _ in range(2))
  wo = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
  valid = jnp.asarray(rng.random(N) > 0.2)
  kw = dict(beta1=4.0, beta2=25.0, valid=valid)
  a, _ = routed_experts(z, idx, wts, wg, wu, wo, **kw)
  b, _ = routed_experts(z, idx, wts, wg, wu, wo,
                        ragged_dot_fn=lambda *x, **y: tiled_ragged_dot(*x, tile=4, **y), **kw)
  np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# tokamax_ragged_dot ('xla' here; the same call sites run tokamax's Mosaic kernels on the GPU).
# ------------------------------------------------------------------------------------------------

TOKAMAX_XLA = functools.partial(tokamax_ragged_dot, implementation="xla")


@pytest.mark.parametrize("sizes", [(5, 0, 17, 3), (1, 2, 0, 0), (0, 0, 12, 0)])
def test_tokamax_ragged_dot_matches_ragged_dot(sizes):
  rng = np.random.default_rng(sum(sizes))
  M, L, F = max(12, sum(sizes)), 6, 7
  lhs = jnp.asarray(rng.standard_normal((M, L)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((len(sizes), L, F)), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  cot = jnp.asarray(rng.standard_normal((M, F)), jnp.float32)

  def loss(fn, a, b):
    return jnp.sum(fn(a, b, gs, preferred_element_type=jnp.float32) * cot)

  want = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
  got = jax.jit(TOKAMAX_XLA, static_argnames="preferred_element_type")(
      lhs, rhs, gs, preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(got)[sum(sizes):], 0.0)
  g_want = jax.grad(lambda a, b: loss(jax.lax.ragged_dot, a, b), (0, 1))(lhs, rhs)
  g_got = jax.jit(jax.grad(lambda a, b: loss(TOKAMAX_XLA, a, b), (0, 1)))(lhs, rhs)
  for gg, gw in zip(g_got, g_want):
    np.testing.assert_allclose(gg, gw, rtol=1e-6, atol=1e-6)
  # Rows past the groups get a zero gradient (the GPU kernels leave them unwritten).
  np.testing.assert_array_equal(np.asarray(g_got[0])[sum(sizes):], 0.0)


def test_tokamax_ragged_dot_bf16_weights_cast_and_gradient_dtypes():
  """bf16 activations with fp32 weights: the weights are multiplied in bf16 (as Mosaic requires),
  the output accumulates in fp32, and each gradient comes back in its input's dtype."""
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((40, 64)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((3, 64, 8)), jnp.float32)
  gs = jnp.asarray([10, 25, 5], jnp.int32)
  got = TOKAMAX_XLA(lhs, rhs, gs, preferred_element_type=jnp.float32)
  want = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.bfloat16).astype(jnp.float32),
                            gs)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  dl, dr = jax.grad(lambda a, b: jnp.sum(TOKAMAX_XLA(a, b, gs, preferred_element_type=jnp.float32)),
                    (0, 1))(lhs, rhs)
  assert dl.dtype == jnp.bfloat16 and dr.dtype == jnp.float32
  # d/drhs[g] of Σ lhs·rhs[g] is the column sum of group g's rows (exact in fp32 of bf16 values).
  row_sums = np.add.reduceat(np.asarray(lhs, np.float32), [0, 10, 35], axis=0)
  np.testing.assert_allclose(np.asarray(dr)[:, :, 0], row_sums, rtol=1e-2, atol=1e-1)


def test_tokamax_errors_name_the_config_field():
  def unsupported(*args, implementation):
    raise NotImplementedError("Only bfloat16/float16 inputs are supported")
  with pytest.raises(ValueError, match="moe_grouped_matmul.*'mosaic'.*bfloat16"):
    grouped_matmul._call_tokamax(unsupported, jnp.zeros((4, 2)), implementation="mosaic",
                                 kernel="fwd")
  with pytest.raises(ValueError, match="implementation"):
    tokamax_ragged_dot(jnp.zeros((4, 2)), jnp.zeros((1, 2, 3)), jnp.ones((1,), jnp.int32),
                       implementation="triton")


def test_mosaic_tiles_apply_on_sm90_only(monkeypatch):
  """SM90_TILES reach tokamax's op on compute capability 9.x; elsewhere (and for a kernel whose
  entry is None or missing) tokamax chooses ('mosaic')."""
  assert grouped_matmul._mosaic_implementation("fwd") == "mosaic"  # CPU: no compute capability
  monkeypatch.setattr(grouped_matmul, "_gpu_compute_capability", lambda: 9.0)
  monkeypatch.setattr(grouped_matmul, "SM90_TILES", {"fwd": (128, 64, 256, 4), "dlhs": None})
  (op,) = grouped_matmul._mosaic_implementation("fwd")
  cfg = op.config
  assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages) == (128, 64, 256, 4)
  assert not cfg.persistent and cfg.split_k == 1
  assert grouped_matmul._mosaic_implementation("dlhs") == "mosaic"
  monkeypatch.setattr(grouped_matmul, "_gpu_compute_capability", lambda: 10.0)
  assert grouped_matmul._mosaic_implementation("fwd") == "mosaic"


# ------------------------------------------------------------------------------------------------
# Gather-only dispatch and combine.
# ------------------------------------------------------------------------------------------------


def test_sort_helpers():
  keys = jnp.asarray([3, 1, 4, 1, 5, 0, 2, 6, 5, 3], jnp.int32)   # 6 = a sentinel past 6 groups
  order, inverse = sort_with_inverse(keys)
  np.testing.assert_array_equal(order, np.argsort(np.asarray(keys), kind="stable"))
  np.testing.assert_array_equal(np.asarray(inverse)[np.asarray(order)], np.arange(10))
  np.testing.assert_array_equal(sorted_group_sizes(keys[order], 6),
                                np.bincount(np.asarray(keys), minlength=7)[:6])


def test_gather_rows_gradient_equals_autodiff_of_the_gather():
  """A partial many-to-one map (a row read by 0, 1 or 2 outputs, masked outputs): the gather-only
  VJP equals autodiff's (scatter-add) transpose of `where(ok, x[src], 0)`."""
  rng = np.random.default_rng(0)
  n, m, fan = 6, 9, 2
  src = rng.integers(0, n, m).astype(np.int32)
  ok = rng.random(m) > 0.3
  back = np.zeros((n, fan), np.int32)
  back_ok = np.zeros((n, fan), bool)
  used = np.zeros(n, int)
  for r in range(m):
    if ok[r] and used[src[r]] < fan:
      back[src[r], used[src[r]]], back_ok[src[r], used[src[r]]] = r, True
      used[src[r]] += 1
    else:
      ok[r] = False                                     # keep the two maps the same relation
  x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((m, 3)), jnp.float32)
  naive = lambda x: jnp.where(jnp.asarray(ok)[:, None], x[src], 0.0)
  ours = lambda x: gather_rows(x, jnp.asarray(src), jnp.asarray(ok), jnp.asarray(back),
                               jnp.asarray(back_ok))
  np.testing.assert_array_equal(ours(x), naive(x))
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(ours(x) * cot))(x),
                             jax.grad(lambda x: jnp.sum(naive(x) * cot))(x), rtol=1e-6, atol=1e-6)


# activation 'pallas': the SiTU-GLU kernels of pallas_kernels/situ_glu, in the Pallas interpreter.
@pytest.mark.parametrize("grouped,activation", [("tokamax", "xla"), ("ragged_dot", "xla"),
                                                ("ragged_dot", "pallas")])
def test_dropless_values_and_gradients_match_dense_reference(grouped, activation):
  problem = _problem(7, n=24, experts=5, unused=2)
  valid = jnp.asarray(np.random.default_rng(8).random(24) > 0.25)
  _check_against_dense(problem, valid, default_ragged_dot(grouped), activation, seed=1)


def _check_against_dense(problem, valid, ragged_dot_fn, activation, seed):
  """routed_experts' values and gradients (all five float inputs, a random cotangent) equal
  `dense_routed_experts`'."""
  z, idx, w, wg, wu, wo = (jnp.asarray(a) for a in problem)
  cot = jax.random.normal(jax.random.PRNGKey(seed), z.shape)

  def ours(z, w, wg, wu, wo):
    return routed_experts(z, idx, w, wg, wu, wo, beta1=B1, beta2=B2, valid=valid,
                          ragged_dot_fn=ragged_dot_fn, activation=activation)[0]

  def dense(z, w, wg, wu, wo):
    return dense_routed_experts(z, idx, w, wg, wu, wo, valid, B1, B2)

  args = (z, w, wg, wu, wo)
  np.testing.assert_allclose(jax.jit(ours)(*args), dense(*args), rtol=1e-5, atol=1e-5)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=tuple(range(5))))
  g_ref = grad(dense)(*args)
  for name, a, b in zip(("z", "expert_weight", "w_gate", "w_up", "w_out"), grad(ours)(*args),
                        g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("activation", ["pallas", "xla"])
def test_tokamax_rows_past_the_groups_never_reach_the_result(monkeypatch, activation):
  """On the GPU tokamax's kernels leave the rows past Σ group_sizes unwritten; emulated here by
  NaN there (forward and dlhs), and by kernels that read every row of their two operands (a NaN
  anywhere in them makes the whole result NaN). The routed experts' values and gradients still
  equal the dense reference: with the Pallas activation, which zeroes those rows of h and of
  d gate_up itself (the grouped matmuls then skip their selects, forward and dlhs), and with
  XLA's, which keeps them."""
  call_tokamax = grouped_matmul._call_tokamax

  def unwritten_rows_nan(fn, *args, kernel, **kw):
    out = call_tokamax(fn, *args, kernel=kernel, **kw)
    out = out + 0 * sum(jnp.sum(a).astype(out.dtype) for a in args[:2])   # reads every row
    if kernel == "drhs":
      return out
    in_groups = jnp.arange(out.shape[0]) < jnp.sum(args[2])
    return jnp.where(in_groups[:, None], out, jnp.nan)

  monkeypatch.setattr(grouped_matmul, "_call_tokamax", unwritten_rows_nan)
  # A trace cached by another test would skip the patch.
  grouped_matmul._tokamax_grouped_shared.clear_cache()
  valid = jnp.asarray(np.arange(20) % 3 != 0)   # invalid tokens' rows sort past the groups
  _check_against_dense(_problem(11, n=20, experts=4), valid, default_ragged_dot("tokamax"),
                       activation, seed=3)
  grouped_matmul._tokamax_grouped_shared.clear_cache()    # nor may this test's traces reach another


@pytest.mark.parametrize("capacity_factor", [0.0, 1.5])
def test_compiled_gradient_has_no_scatter(capacity_factor):
  """The backward of dispatch and combine are gathers: no scatter(-add) in the compiled HLO of
  jax.jit(jax.grad(...)) of routed_experts (forward included)."""
  z, idx, w, wg, wu, wo = (jnp.asarray(a) for a in _problem(9, n=32))
  valid = jnp.asarray(np.random.default_rng(1).random(32) > 0.2)

  def loss(z, w, wg, wu, wo):
    y, _ = routed_experts(z, idx, w, wg, wu, wo, beta1=B1, beta2=B2, valid=valid,
                          capacity_factor=capacity_factor,
                          ragged_dot_fn=default_ragged_dot("tokamax"))
    return jnp.sum(jnp.sin(y))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  text = grad.lower(z, w, wg, wu, wo).compile().as_text()
  assert _hlo_ops(text, "gather")               # the dispatch is there, as gathers
  assert not _hlo_ops(text, "scatter"), _hlo_ops(text, "scatter")[:3]


def _hlo_ops(text: str, op: str) -> list[str]:
  """The instructions of HLO `text` that apply `op` (not names or metadata that mention it)."""
  return [ln for ln in text.splitlines() if re.search(rf"\s{op}\(", ln)]


def test_hlo_ops_finds_the_scatter_of_autodiffs_gather():
  """The check above can fail: autodiff's transpose of a plain gather is found as a scatter."""
  z = jnp.ones((5, 3))
  idx = jnp.asarray([4, 0, 0, 2])
  text = jax.jit(jax.grad(lambda z: jnp.sum(z[idx] ** 2))).lower(z).compile().as_text()
  assert _hlo_ops(text, "scatter")


def test_tokamax_grouped_matmul_is_lowered_once_per_shape():
  # Four MoE layers of one shape (as in the scanned group and the suffix) share one lowering of
  # the grouped matmul and of its two backward matmuls: on the GPU each lowering of a Mosaic
  # kernel is about a second of start-up.
  def layers(n):
    def f(lhs, w, gs):
      x = lhs
      for _ in range(n):
        x = jnp.tanh(tokamax_ragged_dot(x, w, gs, implementation="xla"))
      return jnp.sum(x)
    return f
  lhs, w = jnp.ones((16, 8)), jnp.ones((4, 8, 8))
  gs = jnp.array([4, 4, 4, 4], jnp.int32)
  dots = lambda n: jax.jit(jax.grad(layers(n), argnums=(0, 1))).lower(lhs, w, gs).as_text() \
      .count("stablehlo.dot_general")
  assert dots(4) == dots(1) == 3      # forward, dlhs, drhs: once each


def test_zero_rows_values_gradient_and_what_it_keeps():
  """zero_rows: the where's values and gradient; its backward keeps only the row mask. The dropless
  routed experts with bf16 activations keep no fp32 [N·k, ℓ] array and no row mask of that shape:
  two bf16 ones, the dispatched tokens (for the weight gradient) and the expert outputs (for the
  router weights' gradient)."""
  from jax._src import ad_checkpoint
  x = jax.random.normal(jax.random.PRNGKey(0), (6, 4))
  keep = jnp.array([True, False, True, True, False, True])
  ref = lambda x: jnp.where(keep[:, None], x, 0.0)
  np.testing.assert_array_equal(moe_rows.zero_rows(x, keep), ref(x))
  cot = jax.random.normal(jax.random.PRNGKey(1), (6, 4))
  np.testing.assert_array_equal(
      jax.grad(lambda x: jnp.sum(moe_rows.zero_rows(x, keep) * cot))(x),
      jax.grad(lambda x: jnp.sum(ref(x) * cot))(x))
  np.testing.assert_array_equal(moe_rows.zero_rows(jnp.full((6, 4), jnp.nan), keep)[1], 0.0)

  n, latent, e, m, k = 16, 8, 4, 12, 2
  ks = jax.random.split(jax.random.PRNGKey(2), 6)
  z = jax.random.normal(ks[0], (n, latent), jnp.bfloat16)
  idx = jax.random.randint(ks[1], (n, k), 0, e)
  w = jax.nn.softmax(jax.random.normal(ks[2], (n, k)))
  wg, wu = jax.random.normal(ks[3], (e, latent, m)), jax.random.normal(ks[4], (e, latent, m))
  wo = jax.random.normal(ks[5], (e, m, latent))
  rd = functools.partial(tokamax_ragged_dot, implementation="xla")
  f = lambda z, w: routed_experts(z, idx, w, wg, wu, wo, beta1=1.0, beta2=1.0,
                                  ragged_dot_fn=rd)[0]
  kept = [a for a, _ in ad_checkpoint.saved_residuals(f, z, w)]
  big = [a for a in kept if a.size == n * k * latent]
  assert [a.dtype for a in big] == [jnp.bfloat16] * 2, big
  assert not [a for a in kept if a.dtype == jnp.bool_ and a.size == n * k * latent]


def test_takes_zero_outside_reads_the_declaration():
  """Which grouped matmuls `grouped_situ_glu` may ask to leave the rows past the groups unwritten:
  those that declare `takes_zero_outside` (through functools.partial too), and no other."""
  assert takes_zero_outside(default_ragged_dot("tokamax"))
  assert takes_zero_outside(functools.partial(tokamax_ragged_dot, implementation="xla"))
  assert not takes_zero_outside(default_ragged_dot("tiled"))
  assert not takes_zero_outside(jax.lax.ragged_dot)

  def hook(lhs, rhs, group_sizes, preferred_element_type=None, *, zero_outside=True):
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

  assert not takes_zero_outside(hook)
  hook.takes_zero_outside = True
  assert takes_zero_outside(functools.partial(functools.partial(hook), zero_outside=True))
