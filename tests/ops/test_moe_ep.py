"""Expert parallelism and histogram Quantile Balancing on 8 CPU devices (tests/conftest.py)."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from k3jax.parallel import sharding
from k3jax.layers.moe import quantile_balance_update
from k3jax.ops import moe_ep
from k3jax.ops.grouped_matmul import default_ragged_dot
from k3jax.ops.moe import routed_experts
from testlib import error_ratio as _error_ratio
from testlib import np_qb_bias_from_histogram, np_qb_histogram

BETAS = dict(beta1=4.0, beta2=25.0)
N, LATENT, HIDDEN, E, K = 64, 16, 24, 8, 2


def _problem(seed=0, n=N, skew=0.0, valid_frac=0.8, experts=E):
  """Random tokens, top-k routing and expert weights (numpy, so that no test compiles for it)."""
  rng = np.random.default_rng(seed)
  z = rng.standard_normal((n, LATENT)).astype(np.float32)
  # skew > 0 favours low expert ids, so that some (source, destination) pairs overflow.
  scores = 1 / (1 + np.exp(-(rng.standard_normal((n, experts)) - skew * np.arange(experts))))
  idx = np.argsort(-scores, axis=1, kind="stable")[:, :K].astype(np.int32)
  w = np.take_along_axis(scores, idx, axis=1)
  w = (w / w.sum(axis=1, keepdims=True)).astype(np.float32)
  w_gate, w_up = (0.3 * rng.standard_normal((2, experts, LATENT, HIDDEN))).astype(np.float32)
  w_out = (0.3 * rng.standard_normal((experts, HIDDEN, LATENT))).astype(np.float32)
  valid = rng.random(n) < valid_frac
  return z, idx, w, w_gate, w_up, w_out, valid


def _mesh(spec):
  """`sharding.make_mesh(spec)` on the first devices that the spec's sizes multiply to (all 8, or
  a sub-mesh such as 'expert:4' on four)."""
  count = math.prod(int(entry.split(":")[1]) for entry in spec.split(","))
  return sharding.make_mesh(spec, devices=jax.devices()[:count])


# Experts per device: 1 (8 on expert:8), 2 (8 on data:2,expert:4; 16 on expert:8) and 4 (16 on
# expert:4, a four-device sub-mesh): a wrong local expert id inside a device shows only with > 1.
@pytest.mark.parametrize("spec,grouped,experts", [("expert:8", "ragged_dot", 8),
                                                  ("data:2,expert:4", "ragged_dot", 8),
                                                  ("data:2,expert:4", "tokamax", 8),
                                                  ("expert:4", "ragged_dot", 16),
                                                  ("expert:8", "ragged_dot", 16)])
def test_ep_dropless_matches_single_device(spec, grouped, experts):
  """EP (with the grouped matmul `grouped` inside the shard_map) against the single-device path
  with jax.lax.ragged_dot: values, the gradients of z, router weights and expert weights; the
  loads, and the rows each device receives (a numpy count of the valid assignments routed to
  its experts)."""
  z, idx, w, wg, wu, wo, valid = _problem(experts=experts)
  mesh = _mesh(spec)
  num_ep = sharding.axis_size(mesh, "expert")

  def loss(fn, z, w, wg, wu, wo):
    y, stats = fn(z, idx, w, wg, wu, wo, valid=valid, **BETAS)
    return jnp.sum(jnp.sin(y)), (y, stats)

  ep = lambda *a, **kw: moe_ep.routed_experts_ep(*a, mesh=mesh,
                                                 ragged_dot_fn=default_ragged_dot(grouped), **kw)
  grad = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2, 3, 4),
                                               has_aux=True))
  (_, (y_ref, st_ref)), g_ref = grad(routed_experts)(z, w, wg, wu, wo)
  (_, (y_ep, st_ep)), g_ep = grad(ep)(z, w, wg, wu, wo)
  assert _error_ratio(y_ep, y_ref) <= 1e-5
  for a, b in zip(g_ep, g_ref):
    assert _error_ratio(a, b) <= 1e-5
  np.testing.assert_array_equal(st_ep["load"], st_ref["load"])
  # Rows received per device: its E/n consecutive experts' loads, against a count of the valid
  # assignments whose expert lives there (all devices of the 'data' axis together).
  per_device = np.asarray(st_ep["load"]).reshape(num_ep, experts // num_ep).sum(axis=1)
  device_of = idx // (experts // num_ep)
  want_rows = [int(np.sum((device_of == d) & valid[:, None])) for d in range(num_ep)]
  np.testing.assert_array_equal(per_device, want_rows)
  assert int(st_ep["dropped"]) == 0
  # Padding rows produce zero.
  assert np.all(np.asarray(y_ep)[~np.asarray(valid)] == 0)


def test_ep_pallas_activation_on_cpu_is_refused_by_name():
  """The SiTU-GLU kernels run in the Pallas interpreter on CPU, which shard_map's varying-axes
  check refuses: a clear error naming the field, not JAX's internal one."""
  z, idx, w, wg, wu, wo, valid = _problem()
  mesh = sharding.make_mesh("expert:8")
  # Under jit, as the model calls it: the refusal comes from tracing (eagerly, shard_map would
  # first dispatch the dispatch's ops one by one).
  run = jax.jit(lambda *args: moe_ep.routed_experts_ep(
      *args, valid=valid, mesh=mesh, ragged_dot_fn=default_ragged_dot("ragged_dot"),
      activation="pallas", **BETAS))
  with pytest.raises(ValueError, match=r"ImplConfig\.moe_situ_glu = 'pallas' on CPU"):
    run(z, idx, w, wg, wu, wo)


def _capacity_reference(z, idx, w, wg, wu, wo, valid, devices, num_ep, capacity):
  """Independent numpy model of the EP drop policy: per sending shard and destination device,
  the first `capacity` valid assignments in (token, slot) order are kept."""
  z, idx, w, wg, wu, wo, valid = (np.asarray(a, np.float64) if a.dtype.kind == "f" else
                                  np.asarray(a) for a in (z, idx, w, wg, wu, wo, valid))
  n = z.shape[0]
  n_loc = n // devices
  local = E // num_ep
  y = np.zeros_like(z)
  dropped = 0
  for shard in range(devices):
    used = np.zeros(num_ep, int)
    for i in range(shard * n_loc, (shard + 1) * n_loc):
      if not valid[i]:
        continue
      for j in range(K):
        e = idx[i, j]
        d = e // local
        used[d] += 1
        if used[d] > capacity:
          dropped += 1
          continue
        gate, up = z[i] @ wg[e], z[i] @ wu[e]
        b1, b2 = BETAS["beta1"], BETAS["beta2"]
        h = b1 * np.tanh(gate / b1) / (1 + np.exp(-gate)) * b2 * np.tanh(up / b2)
        y[i] += w[i, j] * (h @ wo[e])
  return y, dropped


@pytest.mark.parametrize("spec,factor", [("expert:8", 1.0), ("data:2,expert:4", 1.25)])
def test_ep_capacity_drops_and_output(spec, factor):
  z, idx, w, wg, wu, wo, valid = _problem(seed=1, skew=0.4, valid_frac=0.9)
  mesh = sharding.make_mesh(spec)
  num_ep = sharding.axis_size(mesh, "expert")
  capacity = moe_ep.ep_capacity(N // 8, K, E, num_ep, factor)
  assert capacity == min(math.ceil(factor * (N // 8) * K / num_ep), (N // 8) * min(K, E // num_ep))
  y, stats = jax.jit(lambda *a: moe_ep.routed_experts_ep(
      *a, valid=valid, capacity_factor=factor, mesh=mesh, **BETAS))(z, idx, w, wg, wu, wo)
  y_ref, dropped_ref = _capacity_reference(z, idx, w, wg, wu, wo, valid, 8, num_ep, capacity)
  assert dropped_ref > 0, "the skewed routing must overflow some buffers for this test to bite"
  assert int(stats["dropped"]) == dropped_ref
  assert _error_ratio(y, y_ref) <= 1e-5
  # The load counts every valid assignment, dropped or not.
  load_ref = np.bincount(np.asarray(idx)[np.asarray(valid)].reshape(-1), minlength=E)
  np.testing.assert_array_equal(stats["load"], load_ref)


def test_routed_experts_auto_dispatch(monkeypatch):
  z, idx, w, wg, wu, wo, valid = _problem(seed=2)
  calls = []
  real = moe_ep.routed_experts_ep
  monkeypatch.setattr(moe_ep, "routed_experts_ep",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))
  f = jax.jit(lambda *a: moe_ep.routed_experts_auto(*a, valid=valid, **BETAS)[0])
  y_plain = f(z, idx, w, wg, wu, wo)
  assert not calls                       # no mesh: the single-device path
  with sharding.with_mesh(sharding.make_mesh("data:8")):
    y_dp = jax.jit(lambda *a: moe_ep.routed_experts_auto(*a, valid=valid, **BETAS)[0])(
        z, idx, w, wg, wu, wo)
  assert not calls                       # expert axis 1: still the single-device path
  with sharding.with_mesh(sharding.make_mesh("data:2,expert:4")):
    y_ep = jax.jit(lambda *a: moe_ep.routed_experts_auto(*a, valid=valid, **BETAS)[0])(
        z, idx, w, wg, wu, wo)
  assert calls
  assert _error_ratio(y_dp, y_plain) <= 1e-5
  assert _error_ratio(y_ep, y_plain) <= 1e-5


def test_ep_shape_errors():
  z, idx, w, wg, wu, wo, valid = _problem(n=60)
  with pytest.raises(ValueError, match="60 tokens"):
    moe_ep.routed_experts_ep(z, idx, w, wg, wu, wo, mesh=sharding.make_mesh("expert:8"), **BETAS)
  z, idx, w, wg, wu, wo, valid = _problem()
  with pytest.raises(ValueError, match="6 experts"):
    moe_ep.routed_experts_ep(z, np.minimum(idx, 5), w, wg[:6], wu[:6], wo[:6],
                             mesh=sharding.make_mesh("data:2,expert:4"), **BETAS)
  with pytest.raises(ValueError, match="no mesh"):
    moe_ep.routed_experts_ep(z, idx, w, wg, wu, wo, **BETAS)


# ------------------------------------------------------------------------------------------------
# Histogram QB


def _sigmoid(x):
  return (1 / (1 + np.exp(-x))).astype(np.float32)


def _hist_problem(seed, tokens=512, experts=16, valid_frac=0.85):
  rng = np.random.default_rng(seed)
  scores = _sigmoid(rng.standard_normal((tokens, experts)) + 0.6 * np.arange(experts) / experts)
  bias = (0.05 * rng.standard_normal(experts)).astype(np.float32)
  mask = rng.random(tokens) < valid_frac
  return scores, bias, mask


@pytest.mark.parametrize("cutoff", ["token", "per_expert"])
@pytest.mark.parametrize("bins", [16, 1000])
def test_histogram_qb_equals_numpy(bins, cutoff):
  """`qb_histogram`'s counts equal numpy's exactly, and the bias read from them numpy's."""
  scores, bias, mask = _hist_problem(3)
  k = 4

  @jax.jit
  def run(scores, bias, mask):
    counts, tokens = moe_ep.qb_histogram(scores, bias, k, mask, bins=bins, cutoff=cutoff)
    return counts, tokens, moe_ep.qb_bias_from_histogram(counts, tokens, bias, k, rate=0.7)

  counts, tokens, new_bias = run(scores, bias, mask)
  ref_counts, lo, width = np_qb_histogram(scores, bias, k, mask, bins, cutoff)
  assert counts.dtype == jnp.int32 and int(tokens) == int(mask.sum())
  np.testing.assert_array_equal(np.asarray(counts), ref_counts)
  np.testing.assert_allclose(np.asarray(new_bias),
                             np_qb_bias_from_histogram(ref_counts, int(mask.sum()), bias, k, lo,
                                                       width, rate=0.7), rtol=0, atol=2e-6)
  assert abs(float(np.mean(np.asarray(new_bias)))) < 1e-6


@pytest.mark.parametrize("cutoff", ["token", "per_expert"])
def test_histogram_qb_within_a_bin_of_the_exact_update(cutoff):
  """With an integer q (all 512 tokens valid, k = 4, E = 16: q = 128) the histogram's one-shot
  bias is within two bin widths of the exact update's (a bin for the quantile, a bin for the
  centring), and 1000 bins resolve it to ~2e-3."""
  scores, bias, _ = _hist_problem(4)
  k = 4
  hist = moe_ep.quantile_balance_update_histogram(scores, bias, k, bins=1000, cutoff=cutoff)
  exact = quantile_balance_update(scores, bias, k, cutoff=cutoff)
  _, _, width = np_qb_histogram(scores, bias, k, np.ones(512, bool), 1000, cutoff)
  assert width < 2.5e-3
  assert float(np.max(np.abs(np.asarray(hist) - np.asarray(exact)))) <= 2 * width


def test_histogram_qb_counts_add_over_splits_and_devices():
  """The counts of any split of the tokens (four chunks; the shards of a data:2,expert:4
  shard_map) sum to those of all tokens, bit for bit, and so give the same bias."""
  mesh = sharding.make_mesh("data:2,expert:4")
  scores, bias, mask = _hist_problem(5, tokens=256, experts=8, valid_frac=0.7)
  k, bins, axes = 2, 1000, sharding.BATCH_AXES
  local = jax.shard_map(
      lambda s, b, m: moe_ep.qb_histogram(s, b, k, m, bins=bins, axis_name=axes),
      mesh=mesh, in_specs=(P(axes), P(), P(axes)), out_specs=(P(), P()))

  @jax.jit
  def run(scores, bias, mask):
    whole = moe_ep.qb_histogram(scores, bias, k, mask, bins=bins)
    chunks = [moe_ep.qb_histogram(scores[i::4], bias, k, mask[i::4], bins=bins) for i in range(4)]
    summed = jax.tree.map(lambda *x: sum(x), *chunks)
    return whole, summed, local(scores, bias, mask)

  whole, summed, sharded = run(scores, bias, mask)
  for other in (summed, sharded):
    for a, b in zip(other, whole):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  to_bias = lambda c: np.asarray(moe_ep.qb_bias_from_histogram(c[0], c[1], bias, k))
  np.testing.assert_array_equal(to_bias(sharded), to_bias(whole))


def test_histogram_qb_no_valid_token_keeps_bias():
  scores = _sigmoid(np.random.default_rng(5).standard_normal((32, 8)))
  bias = np.linspace(-0.1, 0.1, 8).astype(np.float32)
  out = jax.jit(lambda s, b, m: moe_ep.quantile_balance_update_histogram(s, b, 2, m))(
      scores, bias, np.zeros((32,), bool))
  np.testing.assert_array_equal(out, bias)
  with pytest.raises(ValueError, match="bins"):
    moe_ep.quantile_balance_update_histogram(scores, bias, 2, bins=1)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.25])
def test_ep_compiled_gradient_has_no_scatter(capacity_factor):
  """Packing, the sort by local expert, its undoing and the return to the tokens are gathers in
  both passes: no scatter of rows in the compiled HLO of the EP gradient (8 devices, tokamax)."""
  z, idx, w, wg, wu, wo, valid = _problem(3)
  mesh = sharding.make_mesh("data:2,expert:4")

  def loss(z, w, wg, wu, wo):
    y, _ = moe_ep.routed_experts_ep(z, idx, w, wg, wu, wo, valid=valid, mesh=mesh,
                                    capacity_factor=capacity_factor,
                                    ragged_dot_fn=default_ragged_dot("tokamax"), **BETAS)
    return jnp.sum(jnp.sin(y))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
  text = grad.lower(z, w, wg, wu, wo).compile().as_text()
  ops = lambda op: [ln for ln in text.splitlines() if re.search(rf"\s{op}\(", ln)]
  assert ops("gather") and ops("all-to-all")
  # XLA may compute an inverse permutation (argsort of an argsort) as an int32 scatter with unique
  # indices, an index computation off the gradient path; no scatter may move float rows.
  float_scatters = [ln for ln in ops("scatter") if not re.search(r"=\s*s32\[", ln)]
  assert not float_scatters, float_scatters[:3]
  assert all("unique_indices=true" in ln for ln in ops("scatter")), ops("scatter")[:3]
