"""The decoder's Block AttnRes wiring against an explicit reference written from its definition.

The reference below is a plain Python loop over the layers, written from the definition of Block
Attention Residuals, not from the decoder's code:

  * the sources of every mix are the frozen blocks b_0, b_1, ... and, when the current block has
    any output yet, its partial sum p (the running sum of the block's sublayer outputs);
  * b_0 is the token embedding; layer i starts a new block when i > 0 and i is a multiple of the
    block size: the partial sum so far is frozen as the next b, and the new block starts empty;
  * each layer has two sublayers (attention, then FFN/MoE); each reads RMSNorm(mix(sources)) with
    its own pseudo-query w, and adds its output to the partial sum;
  * mix(sources) = sum_i softmax_i(w . RMSNorm(s_i)) s_i in fp32 (keys RMS-normalised without a
    gain, values the raw sources, no 1/sqrt(d));
  * a final mix over every block and the last partial sum feeds the final norm and the LM head.

The sublayers themselves (KDA, gated MLA, the SiTU-GLU FFN and the LatentMoE) are the model's own
modules applied to the model's parameters: what is under test is how the decoder wires them, the
depth mix and its hand-written VJP. Queries and norm gains are random (non-zero queries make each
mix a non-uniform blend, so a source missing, repeated or in the wrong block shows). Logits and
the gradients of every parameter agree to 1e-5 (fp32), in the per-layer decoder and in the scanned
one, for block layouts with a boundary at the last layer and with a short tail block.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax import config as config_lib
from k3jax.config import ImplConfig
from k3jax.layers.ffn import SiTUGLU
from k3jax.layers.kda import KDALayer
from k3jax.layers.mla import GatedMLA
from k3jax.layers.moe import LatentMoE
from k3jax.model import K3Model, layer_plan
from testlib import error_ratio

B, T = 2, 24
# Small widths: every layer kind, a dense first layer and MoE after it.
BASE = config_lib.ModelConfig(
    vocab_size=64, d_model=32, kda_num_heads=2, kda_head_dim=16, kda_value_dim=16,
    kda_chunk_size=16, mla_num_heads=2, mla_kv_lora_rank=16, mla_qk_nope_dim=16,
    mla_qk_rope_dim=8, mla_v_dim=16, dense_ffn_dim=32, first_k_dense=1, moe_num_experts=4,
    moe_top_k=2, moe_latent_dim=16, moe_expert_dim=16, moe_shared_dim=16, norm_eps=1e-5)


def _cfg(num_layers: int, block_size: int, mla_every: int, experts: int
         ) -> config_lib.ModelConfig:
  cfg = dataclasses.replace(BASE, num_layers=num_layers, attnres_block_size=block_size,
                            mla_every=mla_every, moe_num_experts=experts)
  cfg.validate()
  return cfg


# ------------------------------------------------------------------------------------------------
# The reference
# ------------------------------------------------------------------------------------------------

def _rms_norm(x, eps, gain=None):
  x32 = x.astype(jnp.float32)
  y = x32 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return y if gain is None else y * gain.astype(jnp.float32)


def _mix(query, sources, eps):
  """sum_i softmax_i(<RMSNorm(s_i), w>) s_i over the sources' depth, by plain autodiff."""
  values = jnp.stack([s.astype(jnp.float32) for s in sources])          # [S, B, T, d]
  logits = jnp.einsum("sbtd,d->sbt", _rms_norm(values, eps), query.astype(jnp.float32))
  weights = jax.nn.softmax(logits, axis=0)
  return jnp.einsum("sbt,sbtd->btd", weights, values)


def reference_logits(cfg, impl, params, moe_state, tokens, segment_ids):
  """Logits [B, T, vocab] fp32 of the decoder with per-layer `params` (module docstring); the
  sublayers computed as `impl` says."""
  eps = cfg.norm_eps
  mask = segment_ids != 0
  blocks = [jnp.take(params["embedding"], tokens, axis=0)]              # b_0: the embedding
  partial = None
  for i in range(cfg.num_layers):
    layer = params[f"layer_{i}"]
    if i > 0 and i % cfg.attnres_block_size == 0:
      blocks.append(partial)
      partial = None
    if cfg.layer_kind(i) == "mla":
      attention = lambda x, p=layer["mla"]: GatedMLA(cfg, impl).apply({"params": p}, x,
                                                                       segment_ids)
    else:
      attention = lambda x, p=layer["kda"]: KDALayer(cfg, impl).apply({"params": p}, x,
                                                                       segment_ids)
    if cfg.layer_uses_moe(i):
      state = moe_state[f"layer_{i}"]["moe"]
      ffn = lambda x, p=layer["moe"], s=state: LatentMoE(cfg, impl).apply(
          {"params": p, "moe_state": s}, x, mask)
    else:
      ffn = lambda x, p=layer["ffn"]: SiTUGLU(
          cfg, hidden_dim=cfg.dense_ffn_dim, chunk_tokens=impl.position_chunk_tokens).apply(
              {"params": p}, x)
    for mix, norm, sublayer in (("attn_mix", "attn_norm", attention),
                                ("ffn_mix", "ffn_norm", ffn)):
      sources = blocks + ([] if partial is None else [partial])
      h = _mix(layer[mix]["query"], sources, eps)
      out = sublayer(_rms_norm(h, eps, layer[norm]["scale"])).astype(jnp.float32)
      partial = out if partial is None else partial + out
  h = _mix(params["final_mix"]["query"], blocks + [partial], eps)
  h = _rms_norm(h, eps, params["final_norm"]["scale"])
  return jnp.dot(h, params["lm_head"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


# ------------------------------------------------------------------------------------------------
# Model against reference
# ------------------------------------------------------------------------------------------------

def _random_variables(cfg, seed):
  """Random values for every variable of the per-layer decoder of `cfg` (no init compiled):
  depth-mix queries N(0, 0.5²) (init: 0), norm gains 1 + N(0, 0.2²) (init: 1), the balance bias
  N(0, 0.1²), the embedding N(0, 1) and every other weight N(0, 0.05²)."""
  loop = ImplConfig(scan_layers=False)
  shapes = nn.meta.unbox(jax.eval_shape(
      lambda: K3Model(cfg, loop).init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))))
  rng = np.random.default_rng(seed)

  def value(path, x):
    name = jax.tree_util.keystr(path)
    std, mean = 0.05, 0.0
    if name.endswith("['query']"):
      std = 0.5
    elif name.endswith("['scale']"):
      mean = 1.0
    elif name.endswith("['bias']"):
      std = 0.1
    elif name.endswith("['embedding']"):
      std = 1.0
    return np.asarray(mean + std * rng.standard_normal(x.shape), x.dtype)

  return jax.tree_util.tree_map_with_path(value, shapes)


def _inputs(cfg, seed):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
  segment_ids = np.ones((B, T), np.int32)
  segment_ids[0, 10:] = 2                                              # two documents
  segment_ids[1, -4:] = 0                                              # padding
  cotangent = jnp.asarray(rng.standard_normal((B, T, cfg.vocab_size)), jnp.float32)
  return tokens, jnp.asarray(segment_ids), cotangent


def _stacked(tree, plan):
  """A per-layer tree ('params' or 'moe_state') in the scanned layout, written out by hand:
  entry g of scanned_period_{p}/layer_{j} is layer j + g*p."""
  out = {k: v for k, v in tree.items()
         if not (k.startswith("layer_") and int(k[len("layer_"):]) in plan.scanned_layers)}
  out[plan.scan_name] = {
      # On host for the variables (numpy): eagerly, each leaf shape would compile a stack.
      f"layer_{j}": jax.tree.map(lambda *xs: (np.stack if isinstance(xs[0], np.ndarray)
                                              else jnp.stack)(xs),
                                 *[tree[f"layer_{j + g * plan.period}"]
                                   for g in range(plan.num_groups)])
      for j in plan.group_layers if f"layer_{j}" in tree}
  return out


def _check(cfg, impls, loop_variables, tokens, segment_ids, cotangent):
  """The models of `cfg` and each of `impls` (their variables: `loop_variables`, stacked by hand
  where the decoder is scanned) against the reference, computed once for them all: logits, and the
  gradients of <logits, cotangent> for every parameter."""
  layouts, all_variables = [], []
  for impl in impls:
    plan = layer_plan(cfg, impl.scan_layers)
    layout = (lambda tree, plan=plan: _stacked(tree, plan)) if plan.num_groups else (
        lambda tree: tree)
    variables = {name: layout(tree) for name, tree in loop_variables.items()}
    shapes = jax.eval_shape(lambda impl=impl: K3Model(cfg, impl).init(
        jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32)))
    assert jax.tree.structure(nn.meta.unbox(shapes)) == jax.tree.structure(variables)
    layouts.append(layout)
    all_variables.append(variables)

  def model_logits(impl, variables):
    return lambda params: K3Model(cfg, impl).apply({**variables, "params": params}, tokens,
                                                   segment_ids)

  def ref_logits(params):
    # The sublayers do not depend on the decoder's layout: the first impl's serve every model.
    return reference_logits(cfg, impls[0], params, loop_variables.get("moe_state", {}), tokens,
                            segment_ids)

  def value_and_grads(fn, params):
    logits, vjp = jax.vjp(fn, params)
    return logits, vjp(cotangent)[0]

  def run(ps, loop_p):
    ref, ref_grads = value_and_grads(ref_logits, loop_p)
    return ref, [(*value_and_grads(model_logits(impl, v), p), layout(ref_grads))
                 for impl, v, p, layout in zip(impls, all_variables, ps, layouts)]
  # One program: the reference's compile is shared by the models, and its gradients are stacked
  # into each model's layout without an eager program per leaf shape.
  ref, results = jax.jit(run)([v["params"] for v in all_variables], loop_variables["params"])
  for logits, grads, ref_grads in results:
    _compare(logits, grads, ref, ref_grads)


def _compare(logits, grads, ref, ref_grads):
  """Logits against the reference's, and gradients against `ref_grads` (in the model's layout)."""
  assert error_ratio(logits, ref) < 1e-5
  want = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
  got = dict(jax.tree_util.tree_leaves_with_path(grads))
  assert set(got) == set(want)
  queries = []
  for path, g in got.items():
    name = jax.tree_util.keystr(path)
    if name == "['layer_0']['attn_mix']['query']":
      # The first mix has one source, the embedding: a softmax over one item is constant.
      np.testing.assert_array_equal(g, 0.0)
      np.testing.assert_array_equal(want[path], 0.0)
      continue
    assert np.any(np.asarray(want[path]) != 0), name
    if name.endswith("_mix']['query']"):
      # A query's gradient sums softmax derivatives with cancellation over every token: a single
      # one shows the fp32 rounding of the whole network most (up to ~2e-5); together they are
      # held to 1e-5. A wiring or VJP error is orders of magnitude larger.
      assert error_ratio(g, want[path]) < 5e-5, name
      queries.append((g, want[path]))
    else:
      assert error_ratio(g, want[path]) < 1e-5, name
  assert error_ratio(np.concatenate([np.ravel(g) for g, _ in queries]),
                     np.concatenate([np.ravel(w) for _, w in queries])) < 1e-5


# (num_layers, attnres_block_size, mla_every, experts): a block boundary at every layer i > 0 with
# i % attnres_block_size == 0. All-MLA decoders where the layer kind does not matter (KDA's chunked
# scan is the costly compile on CPU); experts 0: the dense FFN in every layer.
# The per-layer decoder of blocks {0,1} {2,3} {4} (a boundary at the last layer, MoE) is checked by
# the scanned test's boundary_at_last_layer, against the reference that the scanned one shares.
UNROLLED = [
    pytest.param(5, 3, 1, 0, id="tail_block"),               # {0,1,2} {3,4}
    pytest.param(3, 1, 1, 0, id="one_layer_blocks"),         # a block per layer
    pytest.param(3, 8, 1, 0, id="one_block"),                # no boundary after the embedding
    pytest.param(4, 2, 4, 4, id="tiny_gin_layout"),          # KDA, KDA, KDA, MLA; MoE from 1
]


@pytest.mark.parametrize("num_layers,block_size,mla_every,experts", UNROLLED)
def test_per_layer_decoder_matches_reference(num_layers, block_size, mla_every, experts):
  cfg = _cfg(num_layers, block_size, mla_every, experts)
  impl = ImplConfig(scan_layers=False)
  assert layer_plan(cfg, impl.scan_layers).num_groups == 0
  _check(cfg, [impl], _random_variables(cfg, seed=num_layers), *_inputs(cfg, seed=num_layers))


# Scanned decoders: dense layer 0, two groups of `period` layers, then the suffix. per_layer: the
# per-layer decoder of the same config too.
SCANNED = [
    pytest.param(5, 2, 1, 4, True, id="boundary_at_last_layer"),  # scan 1-4; blocks {0,1} {2,3} {4}
    pytest.param(6, 2, 1, 4, False, id="suffix_in_last_block"),   # scan 1-4, suffix 5 in {4,5}
]


@pytest.mark.parametrize("num_layers,block_size,mla_every,experts,per_layer", SCANNED)
def test_scanned_decoder_matches_reference(num_layers, block_size, mla_every, experts, per_layer):
  """The scanned decoder against the reference; with `per_layer` the per-layer decoder of the same
  config as well, in the same program against the same reference."""
  cfg = _cfg(num_layers, block_size, mla_every, experts)
  impl = ImplConfig(scan_layers=True)
  plan = layer_plan(cfg, impl.scan_layers)
  assert plan.num_groups == 2 and plan.prefix == (0,)
  impls = [impl]
  if per_layer:
    impls.append(ImplConfig(scan_layers=False))
    assert layer_plan(cfg, False).num_groups == 0
  _check(cfg, impls, _random_variables(cfg, seed=num_layers), *_inputs(cfg, seed=num_layers))
