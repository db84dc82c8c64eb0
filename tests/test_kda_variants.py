"""The linear-attention variants of ModelConfig.kda_variant (Gated DeltaNet, gated linear
attention), the all-MLA reference, and MQAR accuracy.

The ops run against a token-by-token loop written here (plain jax, fp32, packed rows with an
initial state), gradients included; the layer and the model check their parameters, decode and a
few training steps; the evaluation runs on an oracle whose accuracy is known.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax.config import ConfigError, ImplConfig, ModelConfig
from k3jax.data import synthetic
from k3jax.layers.kda import KDALayer
from k3jax.model import flops as flops_lib
from k3jax.model.params import count_params
from k3jax.ops import kda, kda_inputs, kda_variants
from k3jax.plan import activations
from k3jax.training import evaluation
from testlib import error_ratio

B, T, H, K, V = 2, 40, 2, 16, 8
# Row 0: documents [0, 13), [13, 36) (across the chunk boundaries at 16 and 32), then padding;
# row 1: one document from the initial state, padding inside it at 20-22.
SEG = np.ones((B, T), np.int32)
SEG[0, 13:36], SEG[0, 36:] = 2, 0
SEG[1, 20:23] = 0


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  return dict(q=f(B, T, H, K), k=f(B, T, H, K), v=f(B, T, H, V), x_head=f(B, T, H),
              x_chan=f(B, T, H, K), beta=jax.nn.sigmoid(f(B, T, H)), h0=f(B, H, K, V),
              a_log=0.5 * f(H), dt_head=f(H), dt_chan=f(H * K), w=f(B, T, H, V),
              w_state=f(B, H, K, V))


def naive(q, k, v, a, beta, h0, seg, scale):
  """The recurrence token by token (a `lax.scan` over t, every row and head at once): S ← a_t ⊙ S
  (a_t, one factor per head and key channel, decays the rows of S), then the delta rule
  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ, or
  without beta (None) S ← S + k_t v_tᵀ; o_t = Sᵀ(scale·q_t). seg (numpy, 0 = padding): a new id
  resets S to zeros, h0 is the state of each row's first document, padding leaves S and outputs
  zeros. q, k [B, T, H, K]; v [B, T, H, V]; a [B, T, H, K]; beta [B, T, H] or None;
  h0 [B, H, K, V]. Returns (o [B, T, H, V], final states [B, H, K, V])."""
  real = seg > 0
  reset = np.zeros_like(real)
  for b in range(seg.shape[0]):
    ids = seg[b][real[b]]
    starts = np.flatnonzero(real[b])[1:][ids[1:] != ids[:-1]]
    reset[b, starts] = True
  delta = beta is not None
  if not delta:
    beta = jnp.zeros(q.shape[:3])   # scanned over, never read

  def step(s, xs):
    q_t, k_t, v_t, a_t, b_t, reset_t, real_t = xs
    new = jnp.where(reset_t[:, None, None, None], 0.0, s) * a_t[..., None]
    if delta:
      pred = jnp.einsum("bhk,bhkv->bhv", k_t, new)
      new = new + b_t[..., None, None] * k_t[..., None] * (v_t - pred)[..., None, :]
    else:
      new = new + k_t[..., None] * v_t[..., None, :]
    o_t = jnp.einsum("bhk,bhkv->bhv", scale * q_t, new)
    keep = real_t[:, None, None, None]
    return jnp.where(keep, new, s), jnp.where(real_t[:, None, None], o_t, 0.0)

  time_major = lambda x: jnp.moveaxis(jnp.asarray(x), 1, 0)
  xs = tuple(time_major(x) for x in (q, k, v, a, beta, reset, real))
  final, o = jax.lax.scan(step, h0, xs)
  return jnp.moveaxis(o, 0, 1), final


def _normed(x):
  return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)


def _bounded_gate(x, a_log, dt):
  """The test's own bounded gate: −5·σ(exp(A_log)·(x + dt)), per head ([.., H]) or channel."""
  rate = jnp.exp(a_log) if x.ndim == 3 else jnp.exp(a_log)[:, None]
  return -5.0 * jax.nn.sigmoid(rate * (x + dt))


def _check(got, want, tol=2e-5):
  """Every entry of `want` (arrays by name) against `got`'s, by `error_ratio`."""
  for name in want:
    assert error_ratio(got[name], want[name]) <= tol, (name, error_ratio(got[name], want[name]))


def _loss_grads(fn, d, names):
  """(o, final state, grads by name) of Σ o·w + Σ state·w_state, differentiated w.r.t. names."""
  def loss(*args):
    o, ht = fn(**dict(zip(names, args)))
    return jnp.sum(o * d["w"]) + jnp.sum(ht * d["w_state"]), (o, ht)
  (_, (o, ht)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(names))),
                                                   has_aux=True))(*(d[n] for n in names))
  return dict(o=o, ht=ht, **{"d" + n: g for n, g in zip(names, grads)})


GDN_NAMES = ("q", "k", "v", "x_head", "beta", "h0", "a_log", "dt_head")
GLA_NAMES = ("q", "k", "v", "x_chan", "h0", "a_log", "dt_chan")


def gdn_chunked(backend):
  def fn(q, k, v, x_head, beta, h0, a_log, dt_head):
    return kda_variants.chunk_gdn(q, k, v, x_head, beta, A_log=a_log, dt_bias=dt_head,
                                  lower_bound=-5.0, use_qk_l2norm=True, initial_state=h0,
                                  output_final_state=True, segment_ids=SEG, chunk_size=16,
                                  backend=backend)
  return fn


def gdn_naive(q, k, v, x_head, beta, h0, a_log, dt_head):
  a = jnp.broadcast_to(jnp.exp(_bounded_gate(x_head, a_log, dt_head))[..., None], q.shape)
  return naive(_normed(q), _normed(k), v, a, beta, h0, SEG, K ** -0.5)


def gla_chunked(q, k, v, x_chan, h0, a_log, dt_chan):
  return kda_variants.chunk_gla(q, k, v, x_chan, A_log=a_log, dt_bias=dt_chan, lower_bound=-5.0,
                                use_qk_l2norm=True, initial_state=h0, output_final_state=True,
                                segment_ids=SEG, chunk_size=16)


def gla_naive(q, k, v, x_chan, h0, a_log, dt_chan):
  a = jnp.exp(_bounded_gate(x_chan, a_log, dt_chan.reshape(H, K)))
  return naive(_normed(q), _normed(k), v, a, None, h0, SEG, K ** -0.5)


# ------------------------------------------------------------------------------------------------
# The ops against the loop


def test_gdn_equals_the_loop_with_its_gradients():
  d = _inputs(0)
  _check(_loss_grads(gdn_chunked("xla"), d, GDN_NAMES), _loss_grads(gdn_naive, d, GDN_NAMES))


def test_gla_equals_the_loop_with_its_gradients():
  d = _inputs(1)
  want = _loss_grads(gla_naive, d, GLA_NAMES)
  _check(_loss_grads(gla_chunked, d, GLA_NAMES), want)
  # The recurrence that decoding steps (q, k normalised and the gate formed by the caller).
  g = kda_inputs.kda_gate(d["x_chan"], d["a_log"], d["dt_chan"], lower_bound=-5.0)
  o, ht = kda_variants.recurrent_gla(_normed(d["q"]), _normed(d["k"]), d["v"], g,
                                     initial_state=d["h0"], output_final_state=True,
                                     segment_ids=SEG)
  _check({"o": o, "ht": ht}, {"o": want["o"], "ht": want["ht"]})


def test_gla_is_exact_for_decays_far_below_the_bound():
  """Per-token log decays in [−50, 0] (a quarter near 0): no factor overflows, nothing cancels."""
  d = _inputs(2)
  rng = np.random.default_rng(3)
  g = -50.0 * rng.random((B, T, H, K)).astype(np.float32)
  g = jnp.asarray(np.where(rng.random(g.shape) < 0.25, g / 1000.0, g))
  q, k = _normed(d["q"]), _normed(d["k"])
  o, ht = kda_variants.chunk_gla(q, k, d["v"], g, initial_state=d["h0"], output_final_state=True,
                                 segment_ids=SEG, chunk_size=32)
  o_ref, ht_ref = naive(q, k, d["v"], jnp.exp(g), None, d["h0"], SEG, K ** -0.5)
  _check({"o": o, "ht": ht}, {"o": o_ref, "ht": ht_ref})


def test_gla_packed_sequences_equal_the_recurrence():
  """cu_seqlens: each sequence from its own initial state, its own final state."""
  d = _inputs(4)
  cu = np.array([0, 7, 30, 30, 40])       # an empty third sequence
  h0 = jnp.concatenate([d["h0"], d["h0"]])
  g = kda_inputs.kda_gate(d["x_chan"][:1], d["a_log"], d["dt_chan"], lower_bound=-5.0)
  args = (_normed(d["q"][:1]), _normed(d["k"][:1]), d["v"][:1], g)
  got = kda_variants.chunk_gla(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                               chunk_size=16)
  want = kda_variants.recurrent_gla(*args, initial_state=h0, output_final_state=True, cu_seqlens=cu)
  _check({"o": got[0], "ht": got[1]}, {"o": want[0], "ht": want[1]})
  assert np.array_equal(got[1][2], h0[2])   # the empty sequence keeps its initial state


@pytest.mark.slow
def test_gdn_on_the_pallas_kernels_equals_its_xla_path():
  """The per-head gate fused into the unchanged KDA kernels (interpreted on CPU)."""
  d = _inputs(5)
  want = _loss_grads(gdn_chunked("xla"), d, GDN_NAMES)
  _check(_loss_grads(gdn_chunked("pallas"), d, GDN_NAMES), want, tol=1e-4)


def test_gla_over_context_slices_equals_one_device():
  """A context:4 mesh (slices of 10 tokens, documents across them): KDA's state passing
  (k3jax.parallel.context) holds for GLA, outputs and gradients. (GDN is the KDA op itself, whose
  context path tests/test_context_parallel.py checks.)"""
  from k3jax.parallel import sharding
  d = _inputs(6)
  seg = np.ones((B, T), np.int32)
  seg[0, 13:], seg[1, 30:] = 2, 0

  def fn(q, k, v, x_chan, a_log, dt_chan):
    def loss(q, k, v, x_chan, a_log, dt_chan):
      o, _ = kda_variants.chunk_gla(q, k, v, x_chan, A_log=a_log, dt_bias=dt_chan, lower_bound=-5.0,
                                    use_qk_l2norm=True, segment_ids=seg, chunk_size=16)
      return jnp.sum(o * d["w"])
    return jax.value_and_grad(loss, argnums=tuple(range(6)))(q, k, v, x_chan, a_log, dt_chan)

  args = [d[n] for n in ("q", "k", "v", "x_chan", "a_log", "dt_chan")]
  want = jax.jit(fn)(*args)
  mesh = sharding.make_mesh("context:4", jax.devices()[:4])
  with sharding.with_mesh(mesh):
    placed = [jax.device_put(a, sharding.batch_sharding(mesh)) if a.ndim >= 2 else a
              for a in args]
    got = jax.jit(fn)(*placed)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert error_ratio(a, b) <= 1e-5, error_ratio(a, b)


def test_op_arguments_are_checked():
  d = _inputs(7)
  q, k, v = d["q"], d["k"], d["v"]
  with pytest.raises(ValueError, match="backend='pallas' is not available"):
    kda_variants.chunk_gla(q, k, v, d["x_chan"], backend="pallas")
  with pytest.raises(ValueError, match=r"g must have shape \[B,T,H\]"):
    kda_variants.chunk_gdn(q, k, v, d["x_chan"], d["beta"])
  with pytest.raises(ValueError, match=r"dt_bias must have shape \[H\]"):
    kda_variants.chunk_gdn(q, k, v, d["x_head"], d["beta"], A_log=d["a_log"], dt_bias=d["dt_chan"])
  with pytest.raises(ValueError, match="beta is required"):
    kda.chunk_kda(q, k, v, d["x_chan"], None)
  with pytest.raises(ValueError, match="log decay <= 0"):
    kda_variants.chunk_gla(q, k, v, jnp.abs(d["x_chan"]))


# ------------------------------------------------------------------------------------------------
# The layer


LAYER = ModelConfig(d_model=16, kda_num_heads=2, kda_head_dim=8, kda_value_dim=6, kda_conv_size=4,
                    kda_chunk_size=16, init_std=0.3)
XLA = ImplConfig(kda_backend="xla", kda_conv_kernel="xla")
# KDALayer's parameters before kda_variant existed, at LAYER's shapes (d 16, H 2, K 8, V 6, W 4):
# a checkpoint of a 'kda' model must keep restoring.
KDA_TREE = {"q_proj": (16, 2, 8), "k_proj": (16, 2, 8), "v_proj": (16, 2, 6),
            "q_conv/kernel": (4, 16), "k_conv/kernel": (4, 16), "v_conv/kernel": (4, 12),
            "f_proj": (16, 2, 8), "A_log": (2,), "dt_bias": (16,), "b_proj": (16, 2),
            "o_norm": (6,), "g_proj": (16, 2, 6), "o_proj": (2, 6, 16)}


def _init(layer, key, shape, decode=False):
  """layer.init on zeros of `shape`, as one jitted program: its forward pass, unused, is pruned
  instead of run op by op (each op compiled on its own)."""
  return jax.jit(lambda key: layer.init(key, jnp.zeros(shape), decode=decode))(key)


def _shapes(params) -> dict:
  flat = jax.tree_util.tree_flatten_with_path(flax.core.meta.unbox(params))[0]
  return {"/".join(p.key for p in path): tuple(x.shape) for path, x in flat}


@pytest.mark.parametrize("variant,gate_rank,changed", [
    ("kda", 0, {}),
    ("kda", 3, {"f_proj": None, "f_a_proj": (16, 3), "f_b_proj": (3, 2, 8)}),
    ("gdn", 0, {"f_proj": (16, 2), "dt_bias": (2,)}),
    ("gdn", 3, {"f_proj": None, "f_a_proj": (16, 3), "f_b_proj": (3, 2), "dt_bias": (2,)}),
    ("gla", 0, {"b_proj": None}),
])
def test_layer_parameters(variant, gate_rank, changed):
  cfg = dataclasses.replace(LAYER, kda_variant=variant, kda_gate_rank=gate_rank)
  params = jax.eval_shape(lambda: KDALayer(cfg, XLA).init(
      jax.random.PRNGKey(0), jnp.zeros((1, 8, 16))))["params"]
  want = {**KDA_TREE, **changed}
  assert _shapes(params) == {n: s for n, s in want.items() if s is not None}


@pytest.mark.parametrize("variant", ["gdn", "gla"])
def test_layer_decode_equals_its_full_forward(variant):
  """Prefill of 5 tokens, then one token at a time: the recurrent step of each variant."""
  cfg = dataclasses.replace(LAYER, kda_variant=variant)
  layer = KDALayer(cfg, XLA)
  x = jax.random.normal(jax.random.PRNGKey(4), (2, 12, 16))
  variables = _init(layer, jax.random.PRNGKey(5), (2, 12, 16), decode=True)
  full = jax.jit(layer.apply)({"params": variables["params"]}, x)
  step = jax.jit(lambda c, xt: layer.apply({"params": variables["params"], "cache": c}, xt,
                                           decode=True, mutable=["cache"]))
  cache, outs = variables["cache"], []
  for lo, hi in [(0, 5)] + [(i, i + 1) for i in range(5, 12)]:
    y, upd = step(cache, x[:, lo:hi])
    outs.append(y)
    cache = upd["cache"]
  assert error_ratio(jnp.concatenate(outs, 1), full) <= 1e-5


def test_the_config_refuses_a_bad_variant_and_gla_on_pallas_and_conversion():
  with pytest.raises(ConfigError, match=r"ModelConfig.kda_variant = 'mamba'.*'kda', 'gdn', 'gla'"):
    ModelConfig(kda_variant="mamba").validate()
  with pytest.raises(ConfigError, match="ImplConfig.kda_backend = 'pallas'.*kda_variant = 'gla'"):
    config_lib.from_gin([], ["ModelConfig.kda_variant = 'gla'",
                             "ImplConfig.kda_backend = 'pallas'"])
  config_lib.from_gin([], ["ModelConfig.kda_variant = 'gla'", "ImplConfig.kda_backend = 'auto'"])
  # Checkpoint conversion writes KDA models only.
  from k3jax.convert import kimi_k3, kimi_linear
  for fmt in (kimi_k3, kimi_linear):
    with pytest.raises(ValueError, match="ModelConfig.kda_variant = 'gdn'"):
      fmt.check_expressible(dataclasses.replace(LAYER, kda_variant="gdn"))
  gla = dataclasses.replace(LAYER, kda_variant="gla")
  with pytest.raises(ValueError, match="kda_backend = 'pallas' cannot run"):
    KDALayer(gla, ImplConfig(kda_backend="pallas")).init(jax.random.PRNGKey(0),
                                                          jnp.zeros((1, 8, 16)))


# ------------------------------------------------------------------------------------------------
# The model: parameter and FLOP counts, training


TINY = ["ModelConfig.vocab_size = 64", "ModelConfig.d_model = 32", "ModelConfig.num_layers = 2",
        "ModelConfig.mla_every = 2", "ModelConfig.kda_num_heads = 2",
        "ModelConfig.kda_head_dim = 16", "ModelConfig.kda_value_dim = 16",
        "ModelConfig.kda_chunk_size = 16", "ModelConfig.mla_num_heads = 2",
        "ModelConfig.mla_kv_lora_rank = 16", "ModelConfig.mla_qk_nope_dim = 16",
        "ModelConfig.mla_qk_rope_dim = 8", "ModelConfig.mla_v_dim = 16",
        "ModelConfig.dense_ffn_dim = 32", "ModelConfig.moe_num_experts = 0",
        "ImplConfig.kda_backend = 'xla'", "ImplConfig.kda_conv_kernel = 'xla'",
        "DataConfig.source = 'mqar'", "DataConfig.mqar_num_kv_pairs = 4",
        "StagesConfig.stages = ((32, 6),)", "StagesConfig.tokens_per_step = 256",
        "OptimizerConfig.learning_rate = 0.01", "OptimizerConfig.warmup_fraction = 0.0",
        "EvalConfig.mqar_samples = 8"]


def test_parameter_and_flop_counts_follow_the_variant():
  d, h, k, v, c = 32, 2, 16, 16, 16
  m = {name: config_lib.from_gin([], TINY + [f"ModelConfig.kda_variant = '{name}'"]).model
       for name in ("kda", "gdn", "gla")}
  totals = {name: count_params(cfg)[0] for name, cfg in m.items()}
  assert totals["kda"] - totals["gdn"] == d * h * (k - 1) + h * (k - 1)   # W_f and dt_bias
  assert totals["kda"] - totals["gla"] == d * h                           # W_b
  fl = {name: flops_lib.forward_flops_breakdown(cfg, 32) for name, cfg in m.items()}
  assert fl["gdn"]["kda_gate"] == 2 * d * h and fl["kda"]["kda_gate"] == 2 * d * h * k
  assert fl["gla"]["kda_beta"] == 0 and fl["gdn"]["kda_beta"] == 2 * d * h
  assert fl["gdn"]["kda_chunk"] == fl["kda"]["kda_chunk"]
  assert fl["gla"]["kda_chunk"] == h * (4 * k * v + c * (k + v))
  # The memory plan: a smaller gate for GDN, no β and the XLA path for GLA even on the GPU.
  assert activations.resolve_kernels(ImplConfig(), "gpu", m["gla"]).kda == "xla"
  assert activations.resolve_kernels(ImplConfig(), "gpu", m["gdn"]).kda == "pallas"
  kda_saved = activations.kda_bytes(m["kda"], "xla", 1)[0]
  assert kda_saved - activations.kda_bytes(m["gdn"], "xla", 1)[0] == 4 * h * (k - 1)
  assert activations.kda_bytes(m["gla"], "xla", 1)[0] < kda_saved


@pytest.mark.parametrize("variant", ["gla"])
def test_training_steps_reduce_the_mqar_loss(variant):
  """A one-layer language model around the variant's KDALayer (embedding, layer, LM head), six
  Adam steps on one MQAR batch: the loss computes and falls. (gdn is the KDA op with a broadcast
  decay: its op gradients and decoding are checked above; gla has an op of its own.)"""
  import optax
  cfg = dataclasses.replace(LAYER, kda_variant=variant, vocab_size=64)
  layer = KDALayer(cfg, XLA)
  batch = synthetic.mqar_batch(0, 8, 32, 64, 4)
  tokens, mask = jnp.asarray(batch["inputs"]), jnp.asarray(batch["loss_mask"])
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"embed": jax.random.normal(keys[0], (64, 16)),
            "layer": _init(layer, keys[1], (1, 32, 16))["params"],
            "head": 0.25 * jax.random.normal(keys[2], (16, 64))}

  def loss_fn(p):
    x = p["embed"][tokens]
    y = x + layer.apply({"params": p["layer"]}, x, jnp.asarray(batch["segment_ids"]))
    ce = optax.softmax_cross_entropy_with_integer_labels(y @ p["head"],
                                                          jnp.asarray(batch["targets"]))
    return jnp.sum(ce * mask) / jnp.sum(mask)

  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(p, opt_state):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(p, updates), opt_state, loss

  opt_state, losses = optimizer.init(params), []
  for _ in range(6):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
def test_all_mla_model_trains():
  """mla_every = 1, the full-attention reference: every layer MLA, and the run's own training
  step (init, AdamW, the MoE-free decoder) reduces the loss of one MQAR batch in six steps."""
  from k3jax.training.run_data import make_data
  from k3jax.training.state import init_train_state
  from testlib import mesh_train_step
  cfg = config_lib.from_gin([], TINY + ["ModelConfig.mla_every = 1"])
  assert {cfg.model.layer_kind(i) for i in range(cfg.model.num_layers)} == {"mla"}
  state, optimizer, schedule = init_train_state(cfg, 6)
  assert not any("kda" in jax.tree_util.keystr(path)
                 for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0])
  step = mesh_train_step(cfg, state, optimizer, schedule, None, total_steps=6)
  batch = next(make_data(cfg).train_iterator(0))
  batch = {n: batch[n] for n in ("inputs", "targets", "segment_ids", "loss_mask")}
  losses = []
  for _ in range(6):
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  assert np.all(np.isfinite(losses)) and losses[-1] < 0.8 * losses[0], losses


# ------------------------------------------------------------------------------------------------
# MQAR accuracy


class Oracle:
  """A stand-in for K3Model whose greedy prediction at each token is the token that followed its
  first earlier occurrence: MQAR's answer at every query. With `wrong_odd_rows`, rows 1, 3, ...
  answer that value + 1 instead (wrong at every query)."""

  def __init__(self, config, wrong_odd_rows=False):
    self.config, self.impl, self.wrong = config, ImplConfig(), wrong_odd_rows

  def apply(self, variables, inputs, segment_ids, *, return_hidden, mutable):
    del variables, segment_ids, return_hidden, mutable
    b, t = inputs.shape
    pos = jnp.arange(t)
    earlier = (inputs[:, :, None] == inputs[:, None, :]) & (pos[None, :] < pos[:, None])[None]
    after_first = jnp.minimum(jnp.argmax(earlier, axis=-1) + 1, t - 1)
    answer = jnp.where(earlier.any(-1), jnp.take_along_axis(inputs, after_first, axis=1), 0)
    if self.wrong:
      answer = jnp.where((jnp.arange(b) % 2 == 1)[:, None], answer + 1, answer)
    vocab = self.config.vocab_size
    h = jax.nn.one_hot(answer % vocab, vocab)
    return (h, jnp.eye(vocab)), {}


def test_mqar_accuracy_of_known_predictions():
  batch = synthetic.mqar_batch(0, 4, 40, 64, 5)
  right = jax.nn.one_hot(batch["targets"], 64)
  assert synthetic.mqar_accuracy(right, batch) == 1.0
  # Off by one at the first 3 of the 5 queries of rows 0 and 1: 6 of the 20 queries wrong.
  wrong = batch["targets"].copy()
  for row in (0, 1):
    first3 = np.flatnonzero(batch["loss_mask"][row])[:3]
    wrong[row, first3] += 1
  assert synthetic.mqar_accuracy(jax.nn.one_hot(wrong, 64), batch) == pytest.approx(14 / 20)
  with pytest.raises(ValueError, match="expected"):
    synthetic.mqar_accuracy(right[:, 1:], batch)


def test_mqar_evaluation_of_an_oracle():
  """`evaluate_mqar` at any length and pairs, and `mqar/<len>` in the stage-end evaluation of an
  MQAR run (whose batches have DataConfig.mqar_num_kv_pairs queries)."""
  from k3jax.training.run_data import make_data
  cfg = config_lib.from_gin([], TINY + ["EvalConfig.passkey_multipliers = (1,)"])
  model = cfg.model
  assert evaluation.evaluate_mqar(Oracle(model), None, None, 48, 6, samples=8) == 1.0
  assert evaluation.evaluate_mqar(Oracle(model, True), None, None, 48, 6, samples=8) == 0.5
  data = make_data(cfg)
  for batch in (next(data.train_iterator(0)), data.validation_batches(32, 2, 1)[0]):
    assert np.all(batch["loss_mask"].sum(axis=1) == 4)
  results = evaluation.Evaluator(cfg, Oracle(model, True), data)(None, None, 32)
  assert results["mqar/32"] == 0.5 and results["passkey/32"] is None
  assert "mqar/32" not in evaluation.Evaluator(cfg, Oracle(model), data)(None, None, 32,
                                                                          passkey=False)
