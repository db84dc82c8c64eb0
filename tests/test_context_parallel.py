"""Context parallelism (k3jax/parallel/context.py) against the one-device computation.

Rows are packed so that documents cross slice boundaries: one starts inside a slice and runs
through the next three, one starts exactly at a boundary, and a row ends in padding. On 8 CPU
devices, every output and gradient of the split computation equals the unsplit one (fp32).
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.layers.conv import conv_silu
from k3jax.ops import kda
from k3jax.parallel import sharding
from testlib import error_ratio

T = 128           # 8 slices of 16 tokens, 4 of 32


def packed_segments() -> np.ndarray:
  """[2, T] segment ids. Row 0: documents [0, 20), [20, 75) (through slices 1-4 of 16 tokens and
  1-2 of 32), [75, 128). Row 1: [0, 32) and [32, 120) (both boundaries on slice boundaries), then
  padding."""
  seg = np.zeros((2, T), np.int32)
  seg[0, :20], seg[0, 20:75], seg[0, 75:] = 1, 2, 3
  seg[1, :32], seg[1, 32:120] = 1, 2
  return seg


def mesh_of(spec: str):
  sizes = [int(part.split(":")[1]) for part in spec.split(",")]
  return sharding.make_mesh(spec, jax.devices()[:int(np.prod(sizes))])


def on_mesh(spec: str, fn, *args):
  """fn(*args) jitted on the mesh `spec` (arrays [B, T, ...] placed batch x context), or on one
  device for spec ''."""
  if not spec:
    return jax.jit(fn)(*args)
  mesh = mesh_of(spec)
  with sharding.with_mesh(mesh):
    placed = [jax.device_put(a, sharding.batch_sharding(mesh)) if np.ndim(a) >= 2 else a
              for a in args]
    return jax.jit(fn)(*placed)


def assert_close(got, want, tol=1e-5):
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert error_ratio(a, b) <= tol, error_ratio(a, b)


# ------------------------------------------------------------------------------------------------
# The ops alone


def kda_inputs(seed=0, h=2, dk=16, dv=8):
  rng = np.random.default_rng(seed)
  seg = packed_segments()
  q, k = (rng.standard_normal((2, T, h, dk)).astype(np.float32) for _ in range(2))
  v = rng.standard_normal((2, T, h, dv)).astype(np.float32)
  gate_x = rng.standard_normal((2, T, h, dk)).astype(np.float32)
  beta = (1 / (1 + np.exp(-rng.standard_normal((2, T, h))))).astype(np.float32)
  a_log = rng.uniform(0, 1, (h,)).astype(np.float32)
  dt_bias = rng.standard_normal((h * dk,)).astype(np.float32)
  w = rng.standard_normal((2, T, h, dv)).astype(np.float32)
  return (q, k, v, gate_x, beta, seg), (a_log, dt_bias), w


def kda_loss_and_grads(backend):
  def fn(q, k, v, gate_x, beta, seg, w, a_log, dt_bias):
    def loss(q, k, v, gate_x, beta, a_log, dt_bias):
      o, _ = kda.chunk_kda(q, k, v, gate_x, beta, use_qk_l2norm=True, segment_ids=seg,
                           chunk_size=16, backend=backend, A_log=a_log, dt_bias=dt_bias,
                           lower_bound=-5.0)
      return jnp.sum(o * w), o
    (value, o), grads = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)(
        q, k, v, gate_x, beta, a_log, dt_bias)
    return value, o, grads
  return fn


@functools.lru_cache(maxsize=None)
def _one_device_kda_run():
  """The one-device output and gradients of test_kda_over_slices_equals_one_device (host arrays),
  computed once for its meshes."""
  (q, k, v, gate_x, beta, seg), (a_log, dt_bias), w = kda_inputs()
  return jax.device_get(on_mesh("", kda_loss_and_grads("xla"), q, k, v, gate_x, beta, seg, w,
                                a_log, dt_bias))


@pytest.mark.parametrize("spec", ["context:8", "data:2,context:4"])
def test_kda_over_slices_equals_one_device(spec):
  (q, k, v, gate_x, beta, seg), (a_log, dt_bias), w = kda_inputs()
  fn = kda_loss_and_grads("xla")
  want = _one_device_kda_run()
  got = on_mesh(spec, fn, q, k, v, gate_x, beta, seg, w, a_log, dt_bias)
  assert_close(got, want)


def test_kda_over_slices_with_the_pallas_kernels_equals_one_device():
  (q, k, v, gate_x, beta, seg), (a_log, dt_bias), w = kda_inputs(seed=1, dk=16, dv=16)
  want = on_mesh("", kda_loss_and_grads("xla"), q, k, v, gate_x, beta, seg, w, a_log, dt_bias)
  got = on_mesh("data:2,context:4", kda_loss_and_grads("pallas"), q, k, v, gate_x, beta, seg, w,
                a_log, dt_bias)
  assert_close(got, want)


def test_kda_state_passing_is_exact_without_segment_ids():
  """One document per row: every slice inherits the state of all before it."""
  (q, k, v, gate_x, beta, _), (a_log, dt_bias), w = kda_inputs(seed=2)

  def fn(q, k, v, gate_x, beta, a_log, dt_bias):
    return kda.chunk_kda(q, k, v, gate_x, beta, use_qk_l2norm=True, chunk_size=16, backend="xla",
                         A_log=a_log, dt_bias=dt_bias, lower_bound=-5.0)[0]
  want = on_mesh("", fn, q, k, v, gate_x, beta, a_log, dt_bias)
  got = on_mesh("context:8", fn, q, k, v, gate_x, beta, a_log, dt_bias)
  assert_close(got, want)
  # The state carried in: without it, the last slice's output would differ.
  local = fn(*(x[:, -16:] for x in (q, k, v, gate_x, beta)), a_log, dt_bias)
  assert error_ratio(local, want[:, -16:]) > 0.1


@pytest.mark.parametrize("kernel_choice", ["xla", "pallas"])
def test_conv_over_slices_equals_one_device(kernel_choice):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((2, T, 24)).astype(np.float32)
  kernel = rng.standard_normal((4, 24)).astype(np.float32)
  w = rng.standard_normal((2, T, 24)).astype(np.float32)
  seg = packed_segments()

  def fn(x, seg, w, kernel):
    def loss(x, kernel):
      y = conv_silu(x, kernel, seg, jnp.float32, kernel_choice)
      return jnp.sum(y * w), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, kernel)
    return y, grads
  want = on_mesh("", fn, x, seg, w, kernel)
  for spec in ("context:8", "data:2,context:4"):
    assert_close(on_mesh(spec, fn, x, seg, w, kernel), want)


def test_context_slices_refuse_what_they_cannot_split():
  (q, k, v, gate_x, beta, seg), (a_log, dt_bias), _ = kda_inputs()
  with sharding.with_mesh(mesh_of("context:8")):
    with pytest.raises(ValueError, match="initial_state"):
      jax.jit(lambda: kda.chunk_kda(q, k, v, gate_x, beta, segment_ids=seg, A_log=a_log,
                                    dt_bias=dt_bias, lower_bound=-5.0,
                                    output_final_state=True))()
    with pytest.raises(ValueError, match="not divisible by the mesh axes"):
      jax.jit(lambda: kda.chunk_kda(q[:, :60], k[:, :60], v[:, :60], gate_x[:, :60],
                                    beta[:, :60], segment_ids=seg[:, :60], A_log=a_log,
                                    dt_bias=dt_bias, lower_bound=-5.0))()


def test_make_run_mesh_names_a_stage_the_context_axis_cannot_split():
  from k3jax.cli import config_from_flags
  from k3jax.config import ConfigError
  from testlib import TINY_RUN_BINDINGS
  cfg = config_from_flags([], TINY_RUN_BINDINGS + [
      "MeshConfig.axes = 'context:8'", "StagesConfig.stages = ((16, 3), (36, 3))",
      "StagesConfig.tokens_per_step = 144"])
  with pytest.raises(ConfigError, match=r"stage 1 has seq_len 36.*8 equal slices"):
    sharding.make_run_mesh(cfg)


# ------------------------------------------------------------------------------------------------
# MLA and the whole model


def model_cfg(**overrides):
  from k3jax.cli import config_from_flags
  from testlib import TINY_RUN_BINDINGS
  cfg = config_from_flags([], TINY_RUN_BINDINGS + [
      "ModelConfig.num_layers = 4", "ModelConfig.mla_every = 2", "ModelConfig.moe_num_experts = 8",
      "ModelConfig.attnres_block_size = 2"] + [f"{k} = {v!r}" for k, v in overrides.items()])
  return cfg


def model_batch(rows=4, length=64, seed=0):
  """tokens and segment ids [rows, length]: documents across the 8-token slices of context:8."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((rows, length), np.int32)
  seg[0, :10], seg[0, 10:40], seg[0, 40:] = 1, 2, 3     # [10, 40) spans slices 1-4
  seg[1, :32], seg[1, 32:] = 1, 2
  seg[2, :] = 1
  seg[3, :50] = 1                                        # then padding
  tokens = rng.integers(1, 257, (rows, length)).astype(np.int32) * (seg != 0)
  return tokens, seg


def model_loss_and_grads(cfg):
  from k3jax.model import K3Model
  from k3jax.training.loss import token_cross_entropy
  model = K3Model(cfg.model, cfg.impl)

  def fn(tokens, seg, params, moe_state):
    def loss(params):
      logits, sown = model.apply({"params": params, "moe_state": moe_state}, tokens, seg,
                                 update_balance=True, mutable=["moe_balance"])
      mask = (seg[:, 1:] != 0) & (seg[:, 1:] == seg[:, :-1])
      total, count = token_cross_entropy(logits[:, :-1], tokens[:, 1:], mask)
      return total / count, sown["moe_balance"]
    (value, balance), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, grads, balance
  return fn


# Three layers: KDA + dense FFN, then MLA + MoE twice (the last layer is MLA), an AttnRes block
# boundary at layer 2. Every sublayer kind and their context splitting is in it; model_cfg's four
# layers would add a second KDA layer (KDA's chunked scan is the costly compile on CPU), whose
# slicing the first already checks.
MODEL_TEST_LAYERS = {"ModelConfig.num_layers": 3}


@functools.lru_cache(maxsize=None)
def _one_device_model_run():
  """The one-device loss, gradients and balance statistics of the model test (host arrays),
  computed once for its meshes."""
  from testlib import tiny_variables
  cfg = model_cfg(**MODEL_TEST_LAYERS)
  variables = tiny_variables(cfg.model, cfg.impl)
  tokens, seg = model_batch()
  return jax.device_get(on_mesh("", model_loss_and_grads(cfg), tokens, seg, variables["params"],
                                variables["moe_state"]))


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["context:8", "data:2,context:4", "context:2,expert:4"])
def test_model_loss_gradients_and_balance_statistics_equal_one_device(spec):
  """The tiny model (3 layers: KDA, MLA, MLA; MoE with QB after the first; AttnRes) on packed rows:
  the loss, every parameter's gradient and the MoE layers' QB histograms (pooled over the slices)
  equal one device's."""
  from testlib import tiny_variables
  cfg = model_cfg(**MODEL_TEST_LAYERS)
  assert [(cfg.model.layer_kind(i), cfg.model.layer_uses_moe(i)) for i in range(3)] == [
      ("kda", False), ("mla", True), ("mla", True)]
  variables = tiny_variables(cfg.model, cfg.impl)
  tokens, seg = model_batch()
  fn = model_loss_and_grads(cfg)
  want = _one_device_model_run()
  got = on_mesh(spec, fn, tokens, seg, variables["params"], variables["moe_state"])
  assert abs(float(got[0]) - float(want[0])) <= 1e-5 * abs(float(want[0]))
  assert_close(got[1], want[1])
  for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_array_equal(a, b)


def test_mla_gathers_the_latent_never_expanded_keys_or_values():
  """The compiled MLA layer (forward and backward) on context:8: every all-gather carries the
  latent c_kv [B, T, kv_lora_rank], the rope key [B, T, rope] or segment ids, never a per-head
  [B, T, H, D] key or value; the latent's gradient comes back by reduce-scatter."""
  from k3jax.layers.mla import GatedMLA
  cfg = model_cfg()
  m = cfg.model
  layer = GatedMLA(m, cfg.impl)
  rng = np.random.default_rng(4)
  x = rng.standard_normal((2, 64, m.d_model)).astype(np.float32)
  seg = model_batch()[1][:2]
  params = layer.init(jax.random.PRNGKey(0), x, seg)["params"]
  fn = jax.grad(lambda p, x, seg: jnp.sum(layer.apply({"params": p}, x, seg) ** 2), argnums=(0, 1))
  mesh = mesh_of("context:8")
  with sharding.with_mesh(mesh):
    xs, segs = (jax.device_put(a, sharding.batch_sharding(mesh)) for a in (x, seg))
    hlo = jax.jit(fn).lower(params, xs, segs).compile().as_text()
  gathers = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} all-gather", hlo)
  assert gathers, "no all-gather in the compiled layer"
  latent_dims = {m.mla_kv_lora_rank, m.mla_qk_rope_dim}
  for dtype, dims in gathers:
    shape = tuple(int(d) for d in dims.split(",") if d)
    assert len(shape) <= 3, f"all-gather of a per-head array {dtype}{list(shape)}"
    assert dtype.startswith("s") or shape[-1] in latent_dims, f"all-gather of {dtype}{list(shape)}"
  assert {int(d.split(",")[-1]) for t, d in gathers if t.startswith("f")} == latent_dims
  assert "reduce-scatter" in hlo or "all-reduce" in hlo


def test_mla_output_and_qk_clip_statistic_over_slices_equal_one_device():
  from k3jax.layers.mla import GatedMLA
  cfg = model_cfg()
  layer = GatedMLA(cfg.model, cfg.impl)
  x = np.random.default_rng(5).standard_normal((2, 64, cfg.model.d_model)).astype(np.float32)
  seg = model_batch()[1][:2]
  params = layer.init(jax.random.PRNGKey(0), x, seg)["params"]

  def fn(x, seg, params):
    y, sown = layer.apply({"params": params}, x, seg, mutable=["attn_stats"])
    return y, sown["attn_stats"]
  want = on_mesh("", fn, x, seg, params)
  got = on_mesh("data:2,context:4", fn, x, seg, params)
  assert_close(got, want)
  with sharding.with_mesh(mesh_of("context:8")):
    with pytest.raises(ValueError, match="attention_impl = 'tokamax'"):
      jax.jit(lambda: GatedMLA(cfg.model, dataclasses.replace(
          cfg.impl, attention_impl="tokamax")).apply({"params": params}, x, seg))()
