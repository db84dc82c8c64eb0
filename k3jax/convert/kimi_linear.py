"""Kimi-Linear (`model_type = "kimi_linear"`) checkpoints: the config and every tensor, both ways.

Two spellings of the same model are read:
  * the release's (moonshotai/Kimi-Linear-48B-A3B-*, what vLLM's and SGLang's loaders read):
    `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}` directly under the attention,
    `self_attn.{q,k,v}_conv1d.weight` [C, 1, W] one per projection, MoE layers under
    `block_sparse_moe.` with one `experts.{e}.w1/w2/w3.weight` (gate, down, up) per expert, and the
    config's `linear_attn_config` {kda_layers, full_attn_layers, head_dim, num_heads,
    short_conv_kernel_size}, `num_experts`, `num_experts_per_token`, `moe_renormalize`, ...;
  * transformers' (`KimiLinearForCausalLM`'s own module names): `self_attn.forget_gate.*`, one fused
    `self_attn.conv1d.weight` [3C, 1, W] (q, k, v), `mlp.experts.gate_up_proj` [E, 2I, d] (gate
    rows first) and `mlp.experts.down_proj` [E, d, I], and the config's `layer_types`,
    `num_local_experts`, `norm_topk_prob`, ...
transformers 5.23's `save_pretrained` writes the release's tensor names (its load-time
conversions are reversed on save), except that the dense layers come out under
`block_sparse_moe.` too; `save_hf` writes exactly what it writes, with its config.json, or the
release's names with spelling='release'.

The k3jax side is a ModelConfig without AttnRes or a latent MoE, with SwiGLU, the softplus decay
gate, a low-rank KDA output gate and no MLA output gate (`gin_configs/kimi_linear_48b.gin`), and
its parameters in the per-layer layout ('params'/'layer_<i>'/...; the router's
`e_score_correction_bias` is the balance bias 'moe_state'/'layer_<i>'/'moe'/'bias'). PyTorch
stores a linear layer's weight as [out, in]; k3jax as [in, out] with the head axes split out.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from k3jax.config import ConfigError, ModelConfig

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
Path = tuple[str, ...]


class ConvertError(ConfigError):
  """A checkpoint or config that k3jax cannot import as asked: one line naming the field or
  tensor and what is expected."""


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ------------------------------------------------------------------------------------------------

def _get(hf: dict, *names, default=None):
  """The first of `names` present in hf (or in hf['linear_attn_config'] for 'lac.<name>')."""
  lac = hf.get("linear_attn_config") or {}
  for name in names:
    if name.startswith("lac."):
      if name[4:] in lac:
        return lac[name[4:]]
    elif name in hf:
      return hf[name]
  return default


def _require(hf: dict, *names):
  value = _get(hf, *names)
  if value is None:
    shown = " or ".join(n.replace("lac.", "linear_attn_config.") for n in names)
    raise ConvertError(f"config.json: {shown} is missing")
  return value


def _expect(hf: dict, names: tuple, allowed, why: str, default=None) -> None:
  """ConvertError naming the key the config holds (the first of `names` present) unless its
  value is one of `allowed`."""
  value = _get(hf, *names, default=default)
  if value not in allowed:
    name = next((n for n in names if n in hf), names[0])
    raise ConvertError(f"config.json: {name} = {value!r} cannot be expressed in k3jax: "
                       f"{why} (expected {' or '.join(repr(a) for a in allowed)})")


def full_attention_layers(hf: dict, num_layers: int) -> list[int]:
  """The 1-based indices of the full-attention (MLA) layers the config asks for: its
  `layer_types`, else `linear_attn_config.full_attn_layers`, else transformers' default (every
  4th layer counting from the 5th, 0-based i > 0 with i % 4 == 0)."""
  layer_types = hf.get("layer_types")
  if layer_types is not None:
    if len(layer_types) != num_layers:
      raise ConvertError(f"config.json: layer_types has {len(layer_types)} entries for "
                         f"num_hidden_layers = {num_layers}")
    unknown = sorted(set(layer_types) - {"full_attention", "linear_attention"})
    if unknown:
      raise ConvertError(f"config.json: layer_types holds {unknown}: expected 'full_attention' or "
                         "'linear_attention'")
    return [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"]
  full = _get(hf, "lac.full_attn_layers")
  if full is not None:
    kda = _get(hf, "lac.kda_layers")
    if kda is not None and sorted(list(full) + list(kda)) != list(range(1, num_layers + 1)):
      raise ConvertError("config.json: linear_attn_config.full_attn_layers and kda_layers do not "
                         f"cover layers 1..{num_layers} once each")
    return sorted(int(i) for i in full)
  return [i + 1 for i in range(num_layers) if i and i % 4 == 0]


def _mla_every(full: list[int], num_layers: int) -> int:
  """k3jax's rule: layer n (1-based) is MLA when n % mla_every == 0 or n == num_layers."""
  for every in range(1, num_layers + 1):
    if [n for n in range(1, num_layers + 1) if n % every == 0 or n == num_layers] == full:
      return every
  raise ConvertError(f"config.json: full attention at layers {full} (1-based) cannot be expressed "
                     "in k3jax, which puts MLA at the layers n with n % mla_every == 0 and at the "
                     "last layer")


def _first_dense(hf: dict, num_layers: int) -> int:
  mlp_types = hf.get("mlp_layer_types")
  if mlp_types is not None:
    k = 0
    while k < len(mlp_types) and mlp_types[k] == "dense":
      k += 1
    if any(t != "sparse" for t in mlp_types[k:]) or len(mlp_types) != num_layers:
      raise ConvertError(f"config.json: mlp_layer_types = {mlp_types} cannot be expressed in "
                         "k3jax: dense layers first, then MoE layers")
    return k
  freq = hf.get("moe_layer_freq", 1)
  if freq != 1:
    raise ConvertError(f"config.json: moe_layer_freq = {freq!r} cannot be expressed in k3jax "
                       "(expected 1: every layer after the first_k_dense_replace is MoE)")
  return int(hf.get("first_k_dense_replace", 1))


def config_from_hf(hf: dict, dtype: Optional[str] = None,
                   param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a Kimi-Linear config.json (either spelling). `dtype`: the activations'
  dtype (default: the config's `dtype`/`torch_dtype` if float32 or bfloat16, else bfloat16).
  Raises ConvertError naming the first field k3jax cannot express."""
  model_type = hf.get("model_type")
  if model_type != MODEL_TYPE:
    raise ConvertError(f"config.json: model_type = {model_type!r}: expected {MODEL_TYPE!r}")
  _expect(hf, ("q_lora_rank",), (None, 0), "the Kimi-Linear importer reads MLA without query "
          "compression, as released")
  _expect(hf, ("attention_bias",), (False,), "k3jax's projections have no bias", default=False)
  _expect(hf, ("n_group", "num_expert_group"), (1, None), "grouped routing is not implemented")
  _expect(hf, ("topk_group",), (1, None), "grouped routing is not implemented")
  _expect(hf, ("norm_topk_prob", "moe_renormalize"), (True,), "k3jax renormalises the chosen "
          "experts' scores", default=True)
  _expect(hf, ("hidden_act",), ("silu",), "k3jax's GLU activations are SwiGLU and SiTU-GLU",
          default="silu")
  _expect(hf, ("moe_router_activation_func",), ("sigmoid",), "k3jax's router is a sigmoid",
          default="sigmoid")
  _expect(hf, ("mla_use_nope",), (True,), "k3jax's MLA has no rotary embedding", default=True)
  heads, kv_heads = _require(hf, "num_attention_heads"), hf.get("num_key_value_heads")
  if kv_heads not in (None, heads):
    raise ConvertError(f"config.json: num_key_value_heads = {kv_heads} cannot be expressed in "
                       f"k3jax: MLA has one key-value head per query head ({heads})")
  num_layers = int(_require(hf, "num_hidden_layers"))
  head_dim = int(_require(hf, "linear_head_dim", "lac.head_dim"))
  experts = int(_require(hf, "num_local_experts", "num_experts"))
  if dtype is None:
    stored = hf.get("dtype", hf.get("torch_dtype"))
    dtype = stored if stored in ("float32", "bfloat16") else "bfloat16"
  cfg = ModelConfig(
      vocab_size=int(_require(hf, "vocab_size")), d_model=int(_require(hf, "hidden_size")),
      num_layers=num_layers,
      mla_every=_mla_every(full_attention_layers(hf, num_layers), num_layers),
      norm_eps=float(hf.get("rms_norm_eps", 1e-5)), dtype=dtype, param_dtype=param_dtype,
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      init_std=float(hf.get("initializer_range", 0.02)),
      kda_num_heads=int(_require(hf, "linear_num_heads", "lac.num_heads")),
      kda_head_dim=head_dim, kda_value_dim=head_dim,
      kda_conv_size=int(_get(hf, "linear_conv_kernel_dim", "lac.short_conv_kernel_size",
                             default=4)),
      kda_gate_rank=head_dim, kda_gate_lower_bound=None, kda_a_log_init="log_uniform",
      kda_output_gate_rank=head_dim,
      mla_num_heads=int(heads), mla_q_lora_rank=0,
      mla_kv_lora_rank=int(_require(hf, "kv_lora_rank")),
      mla_qk_nope_dim=int(_require(hf, "qk_nope_head_dim")),
      mla_qk_rope_dim=int(_require(hf, "qk_rope_head_dim")),
      mla_v_dim=int(_require(hf, "v_head_dim")), mla_output_gate=False,
      ffn_activation="swiglu", dense_ffn_dim=int(_require(hf, "intermediate_size")),
      first_k_dense=_first_dense(hf, num_layers), moe_num_experts=experts,
      moe_top_k=int(_require(hf, "num_experts_per_tok", "num_experts_per_token")),
      moe_latent_dim=0, moe_latent_norm=False,
      moe_expert_dim=int(_require(hf, "moe_intermediate_size")),
      moe_num_shared=int(_get(hf, "n_shared_experts", "num_shared_experts", default=1)),
      moe_shared_dim=int(_require(hf, "moe_intermediate_size")),
      moe_routed_scale=float(_get(hf, "routed_scaling_factor", default=1.0)),
      attnres=False)
  return validated(cfg)


def validated(cfg: ModelConfig) -> ModelConfig:
  """cfg, once `ModelConfig.validate` accepts it; else ConvertError (the config.json asks for a
  model k3jax refuses). Every format's `config_from_hf` ends with it."""
  try:
    cfg.validate()
  except ConfigError as e:
    raise ConvertError(f"config.json gives a model k3jax refuses: {e}") from None
  return cfg


def check_expressible(cfg: ModelConfig) -> None:
  """Raises ConvertError unless cfg is a Kimi-Linear-shaped model (what `save_hf` can write)."""
  wanted = dict(kda_variant="kda", attnres=False, moe_latent_dim=0, moe_latent_norm=False,
                mla_output_gate=False, ffn_activation="swiglu", kda_gate_lower_bound=None,
                mla_q_lora_rank=0, kda_gate_rank=cfg.kda_head_dim,
                kda_output_gate_rank=cfg.kda_head_dim,
                kda_value_dim=cfg.kda_head_dim, moe_shared_dim=cfg.moe_expert_dim)
  for field, value in wanted.items():
    if getattr(cfg, field) != value:
      raise ConvertError(f"ModelConfig.{field} = {getattr(cfg, field)!r}: a Kimi-Linear checkpoint "
                         f"needs {value!r}")
  if cfg.moe_num_experts == 0:
    raise ConvertError("ModelConfig.moe_num_experts = 0: a Kimi-Linear checkpoint has MoE layers")


SPELLINGS = ("transformers", "release")
# The keys a source config.json may hold that a ModelConfig does not: kept from an import and
# written back on export (token ids matter to generation).
PASSED_THROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "model_max_length")


def config_to_hf(cfg: ModelConfig, dtype: str, spelling: str = "transformers",
                 source: Optional[dict] = None) -> dict:
  """config.json for a Kimi-Linear-shaped ModelConfig (`check_expressible`): the keys
  transformers 5.23's `save_pretrained` writes ('transformers'), or the release's
  ('release': `linear_attn_config`, `first_k_dense_replace`, ...). `source`: the config.json the
  model was imported from, whose PASSED_THROUGH keys are kept."""
  check_expressible(cfg)
  source = source or {}
  layers = range(1, cfg.num_layers + 1)
  full = [n for n in layers if cfg.layer_kind(n - 1) == "mla"]
  out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "dtype": dtype,
         "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
         "num_hidden_layers": cfg.num_layers, "rms_norm_eps": cfg.norm_eps,
         "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
         "hidden_act": "silu", "num_attention_heads": cfg.mla_num_heads,
         "num_key_value_heads": cfg.mla_num_heads, "q_lora_rank": None,
         "kv_lora_rank": cfg.mla_kv_lora_rank, "qk_nope_head_dim": cfg.mla_qk_nope_dim,
         "qk_rope_head_dim": cfg.mla_qk_rope_dim, "v_head_dim": cfg.mla_v_dim,
         "intermediate_size": cfg.dense_ffn_dim, "moe_intermediate_size": cfg.moe_expert_dim,
         "num_experts": cfg.moe_num_experts, "num_experts_per_token": cfg.moe_top_k,
         "num_shared_experts": cfg.moe_num_shared, "routed_scaling_factor": cfg.moe_routed_scale,
         "moe_renormalize": True, "num_expert_group": 1, "topk_group": 1, "use_cache": True,
         "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
         "model_max_length": 1048576}
  if spelling == "transformers":
    out.update({
        "attention_bias": False, "attention_dropout": 0.0, "output_router_logits": False,
        "pretraining_tp": 1, "head_dim": cfg.mla_qk_rope_dim,
        "qk_head_dim": cfg.mla_qk_nope_dim + cfg.mla_qk_rope_dim,
        "linear_num_heads": cfg.kda_num_heads, "linear_head_dim": cfg.kda_head_dim,
        "linear_conv_kernel_dim": cfg.kda_conv_size,
        "layer_types": ["full_attention" if n in full else "linear_attention" for n in layers],
        "mlp_layer_types": ["dense" if n <= cfg.first_k_dense else "sparse" for n in layers]})
  elif spelling == "release":
    out.update({
        "head_dim": cfg.d_model // cfg.mla_num_heads, "mla_use_nope": True,
        "first_k_dense_replace": cfg.first_k_dense, "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
        "num_nextn_predict_layers": 0, "rope_scaling": None, "rope_theta": 10000.0,
        "linear_attn_config": {"full_attn_layers": full,
                               "kda_layers": [n for n in layers if n not in full],
                               "head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_num_heads,
                               "short_conv_kernel_size": cfg.kda_conv_size}})
  else:
    raise ConvertError(f"spelling = {spelling!r}: expected one of {SPELLINGS}")
  out.update({k: source[k] for k in PASSED_THROUGH if k in source})
  return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Source:
  """One way to read a k3jax tensor: the HF tensors it needs with their expected shapes, and the
  function from them (NumPy arrays, in that order) to the k3jax array."""
  names: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  build: Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class ImportRule:
  """A k3jax leaf (`target`, e.g. ('params', 'layer_0', 'kda', 'q_proj')) and its sources, the
  release's spelling first."""
  target: Path
  sources: tuple[Source, ...]


@dataclasses.dataclass(frozen=True)
class ExportRule:
  """An HF tensor (`name`) written from k3jax leaves (`targets`) by `build(*arrays)`."""
  name: str
  targets: tuple[Path, ...]
  build: Callable[..., np.ndarray]


def _t(w: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(w.T)


def _layer_rules(cfg: ModelConfig, i: int, spelling: str
                 ) -> tuple[list[ImportRule], list[ExportRule]]:
  """Import and export rules of layer i (0-based); the export writes `spelling`'s names."""
  d, pre, lp = cfg.d_model, f"model.layers.{i}.", ("params", f"layer_{i}")
  imports, exports = [], []

  def simple(target: Path, name: str, hf_shape: tuple, to_k3: Callable, to_hf: Callable,
             alt_names: tuple[str, ...] = ()):
    sources = tuple(Source((n,), (hf_shape,), to_k3) for n in (name,) + alt_names)
    imports.append(ImportRule(target, sources))
    exports.append(ExportRule(name, (target,), to_hf))

  def norm(target: Path, name: str, width: int):
    simple(target, name, (width,), lambda w: w, lambda w: w)

  def linear(target: Path, name: str, d_in: int, out_split: tuple, alt_names=()):
    """PyTorch [prod(out_split), d_in] <-> k3jax [d_in, *out_split]."""
    out = int(np.prod(out_split))
    simple(target, name, (out, d_in), lambda w: w.T.reshape((d_in,) + out_split),
           lambda w: _t(w.reshape(d_in, out)), alt_names)

  def linear_out(target: Path, name: str, in_split: tuple, d_out: int, alt_names=()):
    """PyTorch [d_out, prod(in_split)] <-> k3jax [*in_split, d_out]."""
    n_in = int(np.prod(in_split))
    simple(target, name, (d_out, n_in), lambda w: w.T.reshape(in_split + (d_out,)),
           lambda w: _t(w.reshape(n_in, d_out)), alt_names)

  norm(lp + ("attn_norm", "scale"), pre + "input_layernorm.weight", d)
  norm(lp + ("ffn_norm", "scale"), pre + "post_attention_layernorm.weight", d)

  if cfg.layer_kind(i) == "kda":
    h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    a, kda = pre + "self_attn.", lp + ("kda",)
    for p in ("q", "k", "v"):
      linear(kda + (f"{p}_proj",), a + f"{p}_proj.weight", d, (h, k))
    for j, p in enumerate(("q", "k", "v")):
      target = kda + (f"{p}_conv", "kernel")
      imports.append(ImportRule(target, (
          Source((a + f"{p}_conv1d.weight",), ((h * k, 1, w),), lambda c: _t(c[:, 0, :])),
          Source((a + "conv1d.weight",), ((3 * h * k, 1, w),),
                 lambda c, j=j: _t(c[j * h * k:(j + 1) * h * k, 0, :])))))
      exports.append(ExportRule(a + f"{p}_conv1d.weight", (target,),
                                lambda c: np.ascontiguousarray(c.T[:, None, :])))
    linear(kda + ("f_a_proj",), a + "f_a_proj.weight", d, (k,),
           alt_names=(a + "forget_gate.f_a_proj.weight",))
    linear(kda + ("f_b_proj",), a + "f_b_proj.weight", k, (h, k),
           alt_names=(a + "forget_gate.f_b_proj.weight",))
    simple(kda + ("dt_bias",), a + "dt_bias", (h * k,), lambda x: x, lambda x: x,
           alt_names=(a + "forget_gate.dt_bias",))
    # transformers declares A_log [1, 1, H, 1]; it is read as its H values.
    imports.append(ImportRule(kda + ("A_log",), tuple(
        Source((n,), ((1, 1, h, 1),), lambda x: x.reshape(h))
        for n in (a + "A_log", a + "forget_gate.A_log"))))
    exports.append(ExportRule(a + "A_log", (kda + ("A_log",),), lambda x: x.reshape(1, 1, h, 1)))
    linear(kda + ("b_proj",), a + "b_proj.weight", d, (h,))
    linear(kda + ("g_a_proj",), a + "g_a_proj.weight", d, (k,))
    linear(kda + ("g_b_proj",), a + "g_b_proj.weight", k, (h, k))
    norm(kda + ("o_norm",), a + "o_norm.weight", k)
    linear_out(kda + ("o_proj",), a + "o_proj.weight", (h, k), d)
  else:
    h, nope, rope, v = cfg.mla_num_heads, cfg.mla_qk_nope_dim, cfg.mla_qk_rope_dim, cfg.mla_v_dim
    r, a, mla = cfg.mla_kv_lora_rank, pre + "self_attn.", lp + ("mla",)
    linear(mla + ("wq",), a + "q_proj.weight", d, (h, nope + rope))
    joint = a + "kv_a_proj_with_mqa.weight"
    imports.append(ImportRule(mla + ("wkv_a",), (Source((joint,), ((r + rope, d),),
                                                        lambda x: _t(x[:r])),)))
    if rope > 0:
      imports.append(ImportRule(mla + ("wk_rope",), (Source((joint,), ((r + rope, d),),
                                                            lambda x: _t(x[r:])),)))
      exports.append(ExportRule(joint, (mla + ("wkv_a",), mla + ("wk_rope",)),
                                lambda c, kr: _t(np.concatenate([c, kr], axis=1))))
    else:
      exports.append(ExportRule(joint, (mla + ("wkv_a",),), _t))
    norm(mla + ("kv_norm", "scale"), a + "kv_a_layernorm.weight", r)
    kv_b = a + "kv_b_proj.weight"
    per_head = lambda x: x.T.reshape(r, h, nope + v)  # noqa: E731
    imports.append(ImportRule(mla + ("wk_b",), (Source((kv_b,), ((h * (nope + v), r),),
                                                       lambda x: per_head(x)[..., :nope]),)))
    imports.append(ImportRule(mla + ("wv_b",), (Source((kv_b,), ((h * (nope + v), r),),
                                                       lambda x: per_head(x)[..., nope:]),)))
    exports.append(ExportRule(kv_b, (mla + ("wk_b",), mla + ("wv_b",)),
                              lambda kb, vb: _t(np.concatenate([kb, vb], -1).reshape(r, -1))))
    linear_out(mla + ("wo",), a + "o_proj.weight", (h, v), d)

  if cfg.layer_uses_moe(i):
    e, m = cfg.moe_num_experts, cfg.moe_expert_dim
    moe = lp + ("moe",)
    release, fused = pre + "block_sparse_moe.", pre + "mlp."
    linear(moe + ("router", "kernel"), release + "gate.weight", d, (e,),
           alt_names=(fused + "gate.weight",))
    simple(("moe_state", f"layer_{i}", "moe", "bias"), release + "gate.e_score_correction_bias",
           (e,), lambda x: x, lambda x: x, alt_names=(fused + "gate.e_score_correction_bias",))
    shared = cfg.moe_num_shared * cfg.moe_shared_dim
    for part, hf_part in (("gate", "gate_proj"), ("up", "up_proj")):
      linear(moe + ("shared", part, "kernel"), release + f"shared_experts.{hf_part}.weight", d,
             (shared,), alt_names=(fused + f"shared_experts.{hf_part}.weight",))
    linear_out(moe + ("shared", "out", "kernel"), release + "shared_experts.down_proj.weight",
               (shared,), d, alt_names=(fused + "shared_experts.down_proj.weight",))
    per_expert = lambda w: tuple(release + f"experts.{j}.{w}.weight" for j in range(e))  # noqa
    stack_t = lambda *ws: np.stack([w.T for w in ws])  # noqa: E731
    gate_up = fused + "experts.gate_up_proj"
    for target, w, half in (("w_gate", "w1", 0), ("w_up", "w3", 1)):
      imports.append(ImportRule(moe + (target,), (
          Source(per_expert(w), ((m, d),) * e, stack_t),
          Source((gate_up,), ((e, 2 * m, d),),
                 lambda x, half=half: np.ascontiguousarray(
                     x[:, half * m:(half + 1) * m, :].transpose(0, 2, 1))))))
    imports.append(ImportRule(moe + ("w_out",), (
        Source(per_expert("w2"), ((d, m),) * e, stack_t),
        Source((fused + "experts.down_proj",), ((e, d, m),),
               lambda x: np.ascontiguousarray(x.transpose(0, 2, 1))))))
    for j in range(e):
      for w, target in (("w1", "w_gate"), ("w2", "w_out"), ("w3", "w_up")):
        exports.append(ExportRule(release + f"experts.{j}.{w}.weight", (moe + (target,),),
                                  lambda x, j=j: _t(x[j])))
  else:
    # transformers' save_pretrained renames every '.mlp.' to '.block_sparse_moe.' on the way out,
    # the dense layers' too; the release keeps them under 'mlp.'. Both are read; `spelling`
    # decides which is written.
    f, ffn = cfg.dense_ffn_dim, lp + ("ffn",)
    written, other = ((pre + "block_sparse_moe.", pre + "mlp.") if spelling == "transformers"
                      else (pre + "mlp.", pre + "block_sparse_moe."))
    linear(ffn + ("gate", "kernel"), written + "gate_proj.weight", d, (f,),
           alt_names=(other + "gate_proj.weight",))
    linear(ffn + ("up", "kernel"), written + "up_proj.weight", d, (f,),
           alt_names=(other + "up_proj.weight",))
    linear_out(ffn + ("out", "kernel"), written + "down_proj.weight", (f,), d,
               alt_names=(other + "down_proj.weight",))
  return imports, exports


def tensor_rules(cfg: ModelConfig, spelling: str = "transformers"
                 ) -> tuple[list[ImportRule], list[ExportRule]]:
  """Every k3jax leaf's import rule and every HF tensor's export rule for a Kimi-Linear-shaped
  cfg, in checkpoint order (the embedding, the layers, the final norm, the head). The import
  rules read both spellings; the export rules write `spelling`'s names: 'transformers' (what its
  `save_pretrained` writes) or 'release' (the released checkpoints', which vLLM and SGLang read;
  they differ only in the dense layers' prefix)."""
  if spelling not in SPELLINGS:
    raise ConvertError(f"spelling = {spelling!r}: expected one of {SPELLINGS}")
  d, v = cfg.d_model, cfg.vocab_size
  same = lambda x: x  # noqa: E731
  imports = [ImportRule(("params", "embedding"),
                        (Source(("model.embed_tokens.weight",), ((v, d),), same),))]
  exports = [ExportRule("model.embed_tokens.weight", (("params", "embedding"),), same)]
  for i in range(cfg.num_layers):
    layer_imports, layer_exports = _layer_rules(cfg, i, spelling)
    imports += layer_imports
    exports += layer_exports
  imports.append(ImportRule(("params", "final_norm", "scale"),
                            (Source(("model.norm.weight",), ((d,),), same),)))
  exports.append(ExportRule("model.norm.weight", (("params", "final_norm", "scale"),), same))
  if not cfg.tie_embeddings:
    imports.append(ImportRule(("params", "lm_head"), (Source(("lm_head.weight",), ((v, d),), _t),)))
    exports.append(ExportRule("lm_head.weight", (("params", "lm_head"),), _t))
  return imports, exports
