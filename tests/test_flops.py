"""k3jax.model.flops: a hand count term by term, the AttnRes wiring, and XLA's own count of a
forward."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from k3jax import config as config_lib
from k3jax import model as model_lib
from k3jax.model import flops
from k3jax.layers.attnres import DepthMix
from k3jax.ops import kda as kda_ops

# Every dimension distinct where it can be, so that a term using the wrong one is caught.
# Layers: KDA, KDA, KDA, MLA (mla_every 4); layer 0 dense, layers 1-3 MoE.
HAND = config_lib.ModelConfig(
    vocab_size=10, d_model=8, num_layers=4, mla_every=4,
    kda_num_heads=2, kda_head_dim=4, kda_value_dim=6, kda_conv_size=3, kda_gate_rank=5,
    kda_chunk_size=16,
    mla_num_heads=3, mla_q_lora_rank=7, mla_kv_lora_rank=6, mla_qk_nope_dim=4, mla_qk_rope_dim=2,
    mla_v_dim=5, mla_output_gate=True,
    dense_ffn_dim=12, first_k_dense=1, moe_num_experts=4, moe_top_k=2, moe_latent_dim=3,
    moe_expert_dim=5, moe_num_shared=2, moe_shared_dim=7,
    attnres=True, attnres_block_size=3)

# Forward FLOPs per token of HAND at seq_len 9, worked out by hand (FLOPs = 2 x multiply-adds).
HAND_COUNT_T9 = {
    "lm_head": 2 * 8 * 10,                                # 160
    "kda_qkv": 3 * 2 * 8 * 2 * (4 + 4 + 6),               # 3 layers x d -> H*(K+K+V): 1344
    "kda_gate": 3 * 2 * (8 * 5 + 5 * 2 * 4),              # low rank d -> 5 -> H*K: 480
    "kda_beta": 3 * 2 * 8 * 2,                            # d -> H: 96
    "kda_out_gate": 3 * 2 * 8 * 2 * 6,                    # d -> H*V: 576
    "kda_out": 3 * 2 * 2 * 6 * 8,                         # H*V -> d: 576
    "kda_conv": 3 * 2 * 3 * 2 * (4 + 4 + 6),              # width 3 per channel of q, k, v: 504
    "kda_chunk": 3 * 2 * (6 * 4 * 6 + 3 * 16 * 5 + 16 * 16),  # eq. 13, (K+V)/2 = 5: 3840
    "mla_q": 2 * (8 * 7 + 7 * 3 * 6),                     # d -> r_q -> H*(nope+rope): 364
    "mla_kv_down": 2 * 8 * 6,                             # 96
    "mla_k_rope": 2 * 8 * 2,                              # 32
    "mla_kv_up": 2 * 6 * 3 * (4 + 5),                     # r_kv -> H*(nope + v): 324
    "mla_out_gate": 2 * 8 * 3 * 5,                        # 240
    "mla_out": 2 * 3 * 5 * 8,                             # 240
    # 9 queries see 1..9 keys: 45 pairs, each H*(dqk + dv) = 3*11 multiply-adds; per token x2/9.
    "mla_attention": 2 * 45 * 3 * 11 // 9,                # 330
    "ffn": 1 * 2 * 3 * 8 * 12,                            # layer 0, gate/up/out: 576
    "moe_router": 3 * 2 * 8 * 4,                          # 192
    "moe_latent": 3 * 2 * (8 * 3 + 3 * 8),                # down and up: 288
    "moe_routed": 3 * 2 * 2 * 3 * 3 * 5,                  # top-2 of SiTU-GLU 3 -> 5 -> 3: 540
    "moe_shared": 3 * 2 * 3 * 8 * 14,                     # one GLU of width 2*7: 2016
    # block size 3: mixes over 1,2 | 2,2 | 2,2 | 2,3 sources, final 3: 19 sources x 4*d.
    "attnres_mix": 19 * 4 * 8,                            # 608
}


def test_hand_count_term_by_term():
  got = flops.forward_flops_breakdown(HAND, 9)
  assert set(got) == set(HAND_COUNT_T9)
  for term, want in HAND_COUNT_T9.items():
    assert got[term] == pytest.approx(want, rel=1e-12), term
  total = sum(HAND_COUNT_T9.values())
  assert flops.forward_flops_per_token(HAND, 9) == pytest.approx(total, rel=1e-12)
  assert flops.flops_per_token(HAND, 9) == pytest.approx(3 * total, rel=1e-12)


def test_options_that_remove_terms():
  plain = dataclasses.replace(HAND, kda_gate_rank=0, mla_q_lora_rank=0, mla_output_gate=False,
                              moe_latent_dim=0, attnres=False, mla_qk_rope_dim=0)
  got = flops.forward_flops_breakdown(plain, 9)
  assert got["kda_gate"] == 3 * 2 * 8 * 2 * 4            # full rank d -> H*K
  assert got["mla_q"] == 2 * 8 * 3 * 4                   # d -> H*nope
  assert got["mla_k_rope"] == 0 and got["mla_out_gate"] == 0 and got["attnres_mix"] == 0
  assert got["moe_latent"] == 0
  assert got["moe_routed"] == 3 * 2 * 2 * 3 * 8 * 5      # experts at d
  assert got["mla_attention"] == 3 * (4 + 5) * 10
  dense = dataclasses.replace(HAND, moe_num_experts=0)
  got = flops.forward_flops_breakdown(dense, 9)
  assert got["ffn"] == 4 * 2 * 3 * 8 * 12
  assert got["moe_router"] == got["moe_latent"] == got["moe_routed"] == got["moe_shared"] == 0


def test_attention_term_is_linear_in_seq_len():
  a, b = (flops.forward_flops_breakdown(HAND, t) for t in (1000, 2000))
  assert b["mla_attention"] - a["mla_attention"] == 1000 * 3 * (6 + 5)
  assert all(a[k] == b[k] for k in a if k != "mla_attention")


def test_accepts_the_run_config_and_rejects_other_input():
  run = config_lib.Config(model=HAND)
  assert flops.flops_per_token(run, 9) == flops.flops_per_token(HAND, 9)
  with pytest.raises(TypeError, match="ModelConfig or Config"):
    flops.flops_per_token({"d_model": 8}, 9)
  with pytest.raises(ValueError, match="seq_len"):
    flops.flops_per_token(HAND, 0)
  with pytest.raises(ValueError, match="head_dim"):
    flops.kda_chunk_flops(1, 8, 2, 0)


def test_kda_chunk_count_is_eq13():
  b, t, h, d, c = 8, 4096, 16, 128, 64
  assert flops.kda_chunk_flops(b, t, h, d, c) == b * h * (6 * t * d * d + 3 * t * c * d + t * c * c)
  assert flops.kda_chunk_flops(b, t, h, d, c, value_dim=d) == flops.kda_chunk_flops(b, t, h, d, c)


def test_model_package_exports_flops_per_token():
  assert model_lib.flops_per_token is flops.flops_per_token


def test_attnres_sources_match_the_model():
  """The DepthMix source counts of `attnres_mix_sources` are those the decoder really mixes."""
  seen = []

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, DepthMix) and context.method_name == "__call__":
      seen.append(len(args[0]))
    return next_fun(*args, **kwargs)

  # Unrolled: the scanned decoder mixes inside its scan over a fixed-size stack of block slots
  # (unwritten ones masked), work that is not counted.
  cfg = dataclasses.replace(HAND, num_layers=7, mla_every=4, attnres_block_size=3)
  impl = config_lib.ImplConfig(scan_layers=False)
  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model_lib.init_variables(cfg, jax.random.PRNGKey(0), 1, 16, impl=impl))
  assert seen == flops.attnres_mix_sources(cfg)


def _xla_flops(fn, *args) -> float:
  return float(jax.jit(fn).lower(*args).compile().cost_analysis()["flops"])


@pytest.mark.slow
def test_against_xla_cost_analysis():
  """XLA's FLOP count of a tiny fp32 forward on CPU against ours, term by term where XLA's
  implementation differs on purpose:

  * XLA's count includes the elementwise work we leave out (norms, activations, softmax, gates),
    so it must be at least ours and at most a few percent more: 1.0 <= XLA / ours <= 1.06 (at
    d_model 128 it is ~1.03; a missing or doubled matmul term here is >= 7% of the total, except
    kda_beta, kda_conv, moe_router and attnres_mix, which the hand count checks);
  * cost analysis counts a while loop's body once, not once per trip: the layers are unrolled
    (scan_layers=False), and the chunked KDA op (a scan over chunks and a loop in its triangular
    inverse) is taken out on both sides: XLA's count of `chunk_kda` alone at the layer's shapes
    is subtracted, and our eq. 13 term left out;
  * the XLA attention computes the whole T x T square and masks it (T = 128 is one of its
    key/query blocks, so no block is skipped): our causal term x 2T/(T+1);
  * XLA:CPU lowers `ragged_dot` densely, every assignment row against every expert: our routed
    term x moe_num_experts.
  """
  d = 128
  cfg = config_lib.ModelConfig(
      d_model=d, num_layers=4, mla_every=4, kda_num_heads=2, kda_head_dim=32, kda_value_dim=32,
      kda_chunk_size=16, kda_gate_rank=16, mla_num_heads=2, mla_q_lora_rank=32,
      mla_kv_lora_rank=32, mla_qk_nope_dim=32, mla_qk_rope_dim=16, mla_v_dim=32,
      dense_ffn_dim=4 * d, moe_num_experts=4, moe_top_k=2, moe_latent_dim=d // 2,
      moe_expert_dim=d, moe_shared_dim=d, attnres_block_size=2, dtype="float32",
      param_dtype="float32")
  impl = config_lib.ImplConfig(kda_backend="xla", attention_impl="xla",
                               moe_grouped_matmul="ragged_dot", scan_layers=False)
  batch, seq_len = 2, 128
  tokens = jnp.zeros((batch, seq_len), jnp.int32)
  # Shapes only: the cost analysis compiles, it does not run.
  variables = jax.eval_shape(
      lambda: nn.meta.unbox(model_lib.init_variables(cfg, jax.random.PRNGKey(0), 1, 8,
                                                     impl=impl)))
  model_xla = _xla_flops(lambda v, t: model_lib.K3Model(cfg, impl).apply(v, t), variables, tokens)
  h, k = cfg.kda_num_heads, cfg.kda_head_dim
  x = jnp.ones((batch, seq_len, h, k), jnp.float32)
  beta = jnp.ones((batch, seq_len, h), jnp.float32)
  chunk_xla = _xla_flops(
      lambda q, kk, v, g, b: kda_ops.chunk_kda(q, kk, v, g, b, use_qk_l2norm=True,
                                               chunk_size=cfg.kda_chunk_size, backend="xla")[0],
      x, x, x, x, beta)
  n_kda = sum(cfg.layer_kind(i) == "kda" for i in range(cfg.num_layers))
  xla_per_token = (model_xla - n_kda * chunk_xla) / (batch * seq_len)

  ours = flops.forward_flops_breakdown(cfg, seq_len)
  del ours["kda_chunk"]
  ours["mla_attention"] *= 2 * seq_len / (seq_len + 1)
  ours["moe_routed"] *= cfg.moe_num_experts
  ratio = xla_per_token / sum(ours.values())
  assert 1.0 <= ratio <= 1.06, (ratio, xla_per_token, ours)


def test_mfu_uses_the_flop_count():
  from k3jax.training import metrics
  fpt = flops.flops_per_token(HAND, 9)
  assert metrics.mfu(fpt, 1000.0, 2 * fpt * 1000.0) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="flops_per_token"):
    metrics.mfu(0.0, 1000.0, 1e12)


def test_medium_gin_counts_are_those_of_its_header():
  """gin_configs/medium.gin: the parameter and FLOP counts its header states, and its brief
  (1-2 B total, 0.3-0.5 B active, d_model >= 1536)."""
  import os
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin_configs",
                      "medium.gin")
  cfg = config_lib.from_gin([path])
  total, active = model_lib.count_params(cfg.model)
  assert (total, active) == (1_623_705_488, 455_064_464)
  assert 1e9 <= total <= 2e9 and 0.3e9 <= active <= 0.5e9 and cfg.model.d_model >= 1536
  header = "".join(line for line in open(path) if line.startswith("#"))
  assert f"{total:,}" in header and f"{active:,}" in header
  for seq_len, text in ((8192, "3.17 G"), (65536, "5.81 G"), (262144, "14.9 G"),
                        (1048576, "51.1 G")):
    assert text in header
    assert float(text[:-2]) == pytest.approx(flops.flops_per_token(cfg, seq_len) / 1e9, abs=0.05)
