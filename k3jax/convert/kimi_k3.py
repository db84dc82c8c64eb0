"""Kimi K3 (`model_type = "kimi_k3"`) checkpoints: the text model's config and tensors, both ways.

The release (moonshotai/Kimi-K3) is a multimodal folder, `KimiK3ForConditionalGeneration`:
  * config.json: `model_type` 'kimi_k3' with the text model's config nested under `text_config`
    (whose own `model_type` is 'kimi_linear': K3's text config extends Kimi-Linear's keys) and the
    vision tower's under `vision_config`. `config_from_hf` also reads a flat (text-only) config,
    whichever of the two `model_type`s it names.
  * the text model's tensors under `language_model.model.` (`layers.{i}.`, `embed_tokens`,
    `norm`, `output_attn_res_{norm,proj}`) and `language_model.lm_head.weight`; the vision tower
    (`vision_tower.*`) and its projector (`mm_projector.*`), which k3jax does not model, are left
    unread and reported by `load_hf` as skipped. Names without the `language_model.` prefix (a
    text-only copy) are read too.
  * per layer: `input_layernorm`, `post_attention_layernorm`, and AttnRes's
    `self_attention_res_{norm,proj}` / `mlp_res_{norm,proj}` (norm.weight [d], proj.weight [1, d]);
    KDA and MLA both under `self_attn.` (KDA: `{q,k,v,g,b,f_a,f_b,o}_proj`, `{q,k,v}_conv1d`
    [C, 1, W], `o_norm`, `A_log`, `dt_bias`, with the full-rank output gate `g_proj` [H·V, d]; MLA:
    `q_a_proj`, `q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
    `kv_b_proj`, the output gate `g_proj` [H·v, d], `o_proj`); the dense layer 0 under `mlp.`
    (`{gate,up,down}_proj`); MoE layers under `block_sparse_moe.` (`gate.weight`,
    `gate.e_score_correction_bias`, the latent projections `routed_expert_down_proj` [ℓ, d] and
    `routed_expert_up_proj` [d, ℓ] around `routed_expert_norm` [ℓ], `shared_experts.*` of width
    num_shared·moe_intermediate_size, and per expert `experts.{e}.w1/w2/w3` = gate, down, up).
  * dtypes: `A_log`, `dt_bias`, the three convolutions and `o_norm` are F32, the routed experts
    MXFP4 (`experts.{e}.w{1,2,3}.weight_packed` U8 [out, in/2] and `.weight_scale` U8 E8M0
    [out, in/32], compressed-tensors' "mxfp4-pack-quantized", `k3jax.convert.mxfp4`), the rest BF16.
    The routing bias is written F32 (the dtype the release's safetensors headers give it).
  * `A_log` is stored padded: F32 [128] for the 96 heads, the padding zero. It is read as its
    first H entries (ConvertError unless the rest is zero) and written padded with zeros to a
    multiple of A_LOG_PAD_MULTIPLE.

Routed experts are read from MXFP4 (dequantised exactly: every E2M1 value times a power of two
is a bfloat16) or from plain `experts.{e}.w{1,2,3}.weight`, and written in the export dtype
(experts='bf16', the default) or as MXFP4 (experts='mxfp4': `mxfp4.quantize`, exact for weights
on the MXFP4 grid, such as imported ones; others are rounded to it).

The k3jax side is a K3-shaped ModelConfig (`check_expressible`; `gin_configs/k3.gin`): AttnRes
with the key-norm gain (`*_res_norm.weight` -> 'key_norm_gain', `*_res_proj.weight` -> 'query'),
the latent MoE, the full-rank KDA output gate, the KDA decay gate through rank head_dim; the
bounded or softplus decay gate, q LoRA, the MLA output gate, the latent norm and SiTU-GLU or SwiGLU
follow the config. Layout conventions (PyTorch [out, in] -> k3jax [in, out] with the head axes
split out, MLA's per-head [nope | rope] and [nope | v]) are those of `kimi_linear`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import ml_dtypes
import numpy as np

from k3jax.config import ModelConfig
from k3jax.convert import mxfp4
from k3jax.convert import kimi_linear
from k3jax.convert.kimi_linear import ConvertError, ImportRule, Source

MODEL_TYPE = "kimi_k3"
TEXT_MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiK3ForConditionalGeneration"
# The release's prefix of the text model's tensors; the import also reads them unprefixed.
PREFIX = "language_model."
PREFIXES = (PREFIX, "")
SPELLINGS = ("release",)
EXPERT_FORMATS = ("bf16", "mxfp4")
MXFP4_FORMAT = "mxfp4-pack-quantized"
# A_log is written padded with zeros to a multiple of this many heads (the release: 96 -> 128).
A_LOG_PAD_MULTIPLE = 128
# Keys of a source config.json (top level and text_config) kept on export: token ids.
PASSED_THROUGH = ("bos_token_id", "eos_token_id", "pad_token_id", "media_placeholder_token_id")
Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class ExportRule(kimi_linear.ExportRule):
  """`kimi_linear.ExportRule` with the stored dtype: 'float32' or 'uint8' whatever the export's
  dtype, or None for the export's dtype."""
  stored: Optional[str] = None


# ------------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ------------------------------------------------------------------------------------------------

def text_config(hf: dict) -> dict:
  """The text model's config: `hf['text_config']` (the release), or hf itself (a flat config)."""
  tc = hf.get("text_config")
  if tc is None:
    return hf
  if not isinstance(tc, dict):
    raise ConvertError(f"config.json: text_config is a {type(tc).__name__}: expected an object")
  return tc


def is_k3_text_config(tc: dict) -> bool:
  """Whether a flat config (`model_type` 'kimi_linear') has any of K3's own keys set, which the
  Kimi-Linear importer would ignore: AttnRes, the latent MoE, the full-rank KDA output gate, the
  bounded decay gate, the MLA output gate or SiTU-GLU."""
  lac = tc.get("linear_attn_config") or {}
  return (tc.get("attn_res_block_size") is not None
          or tc.get("routed_expert_hidden_size") is not None
          or bool(lac.get("use_full_rank_gate")) or lac.get("gate_lower_bound") is not None
          or bool(tc.get("mla_use_output_gate")) or tc.get("hidden_act") == "situ")


class _Fields:
  """Reads a text config, naming keys in messages as they sit in config.json."""

  def __init__(self, tc: dict, nested: bool):
    self.tc, self.lac = tc, tc.get("linear_attn_config") or {}
    self.where = "text_config." if nested else ""

  def _lookup(self, name: str):
    if name.startswith("lac."):
      return self.lac.get(name[4:]), f"{self.where}linear_attn_config.{name[4:]}"
    return self.tc.get(name), f"{self.where}{name}"

  def get(self, *names, default=None):
    for name in names:
      value, _ = self._lookup(name)
      if value is not None:
        return value
    return default

  def require(self, *names):
    value = self.get(*names)
    if value is None:
      shown = " or ".join(self._lookup(n)[1] for n in names)
      raise ConvertError(f"config.json: {shown} is missing")
    return value

  def expect(self, names: tuple, allowed, why: str, default=None) -> None:
    value = self.get(*names, default=default)
    if value not in allowed:
      present = [n for n in names if self._lookup(n)[0] is not None]
      shown = self._lookup((present or names)[0])[1]
      raise ConvertError(f"config.json: {shown} = {value!r} cannot be expressed in k3jax: {why} "
                         f"(expected {' or '.join(repr(a) for a in allowed)})")


def _check_quantization(fields: _Fields, hf: dict) -> None:
  """ConvertError unless the config's quantization (if any) is MXFP4 with 32-element groups."""
  q = fields.tc.get("quantization_config")
  where = fields.where
  if q is None:
    q, where = hf.get("quantization_config"), ""
  if q is None:
    return
  fmt = q.get("format")
  if fmt != MXFP4_FORMAT:
    raise ConvertError(f"config.json: {where}quantization_config.format = {fmt!r} cannot be read: "
                       f"k3jax reads the routed experts as {MXFP4_FORMAT!r} or unquantised")
  for name, group in sorted((q.get("config_groups") or {}).items()):
    size = (group.get("weights") or {}).get("group_size", mxfp4.BLOCK_SIZE)
    if size != mxfp4.BLOCK_SIZE:
      raise ConvertError(f"config.json: {where}quantization_config.config_groups.{name}.weights."
                         f"group_size = {size!r}: MXFP4 blocks are {mxfp4.BLOCK_SIZE} elements")


def config_from_hf(hf: dict, dtype: Optional[str] = None,
                   param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a Kimi K3 config.json (the release's, with `text_config`, or a flat text
  config). `dtype`: the activations' dtype (default: the config's `dtype`/`torch_dtype` if float32
  or bfloat16, else bfloat16). Raises ConvertError naming the first field k3jax cannot express."""
  model_type = hf.get("model_type")
  if model_type not in (MODEL_TYPE, TEXT_MODEL_TYPE):
    raise ConvertError(f"config.json: model_type = {model_type!r}: expected {MODEL_TYPE!r}")
  tc = text_config(hf)
  f = _Fields(tc, nested=tc is not hf)
  f.expect(("attention_bias",), (False,), "k3jax's projections have no bias", default=False)
  f.expect(("num_expert_group", "n_group"), (1,), "grouped routing is not implemented", default=1)
  f.expect(("topk_group",), (1,), "grouped routing is not implemented", default=1)
  f.expect(("moe_renormalize", "norm_topk_prob"), (True,), "k3jax renormalises the chosen "
           "experts' scores", default=True)
  f.expect(("moe_router_activation_func",), ("sigmoid",), "k3jax's router is a sigmoid",
           default="sigmoid")
  f.expect(("mla_use_nope",), (True,), "k3jax's MLA has no rotary embedding")
  f.expect(("hidden_act",), ("situ", "silu"), "k3jax's GLU activations are SiTU-GLU and SwiGLU",
           default="silu")
  f.expect(("lac.use_full_rank_gate",), (True,), "the K3 importer reads KDA's full-rank output "
           "gate g_proj")
  heads, kv_heads = f.require("num_attention_heads"), f.get("num_key_value_heads")
  if kv_heads not in (None, heads):
    raise ConvertError(f"config.json: {f.where}num_key_value_heads = {kv_heads} cannot be "
                       f"expressed in k3jax: MLA has one key-value head per query head ({heads})")
  _check_quantization(f, hf)
  num_layers = int(f.require("num_hidden_layers"))
  head_dim = int(f.require("lac.head_dim"))
  situ = f.get("hidden_act", default="silu") == "situ"
  betas = ((float(f.require("activation_situ_beta")),
            float(f.require("activation_situ_linear_beta"))) if situ else (4.0, 25.0))
  lower_bound = f.get("lac.gate_lower_bound")
  if dtype is None:
    stored = f.get("dtype", "torch_dtype", default=hf.get("dtype", hf.get("torch_dtype")))
    dtype = stored if stored in ("float32", "bfloat16") else "bfloat16"
  experts_dim = int(f.require("moe_intermediate_size"))
  cfg = ModelConfig(
      vocab_size=int(f.require("vocab_size")), d_model=int(f.require("hidden_size")),
      num_layers=num_layers,
      mla_every=kimi_linear._mla_every(  # pylint: disable=protected-access
          kimi_linear.full_attention_layers(tc, num_layers), num_layers),
      norm_eps=float(f.get("rms_norm_eps", default=1e-5)), dtype=dtype, param_dtype=param_dtype,
      tie_embeddings=bool(f.get("tie_word_embeddings", default=False)),
      init_std=float(f.get("initializer_range", default=0.02)),
      kda_num_heads=int(f.require("lac.num_heads")), kda_head_dim=head_dim,
      kda_value_dim=head_dim, kda_conv_size=int(f.get("lac.short_conv_kernel_size", default=4)),
      kda_gate_rank=head_dim,
      kda_gate_lower_bound=None if lower_bound is None else float(lower_bound),
      kda_a_log_init="log_uniform", kda_output_gate_rank=0,
      mla_num_heads=int(heads), mla_q_lora_rank=int(f.get("q_lora_rank", default=0)),
      mla_kv_lora_rank=int(f.require("kv_lora_rank")),
      mla_qk_nope_dim=int(f.require("qk_nope_head_dim")),
      mla_qk_rope_dim=int(f.require("qk_rope_head_dim")),
      mla_v_dim=int(f.require("v_head_dim")),
      mla_output_gate=bool(f.get("mla_use_output_gate", default=False)),
      ffn_activation="situ_glu" if situ else "swiglu", situ_beta1=betas[0], situ_beta2=betas[1],
      dense_ffn_dim=int(f.require("intermediate_size")),
      first_k_dense=kimi_linear._first_dense(tc, num_layers),  # pylint: disable=protected-access
      moe_num_experts=int(f.require("num_experts", "num_local_experts")),
      moe_top_k=int(f.require("num_experts_per_token", "num_experts_per_tok")),
      moe_latent_dim=int(f.require("routed_expert_hidden_size")),
      moe_latent_norm=bool(f.get("latent_moe_use_norm", default=False)),
      moe_expert_dim=experts_dim,
      moe_num_shared=int(f.get("num_shared_experts", "n_shared_experts", default=0)),
      moe_shared_dim=experts_dim,
      moe_routed_scale=float(f.get("routed_scaling_factor", default=1.0)),
      moe_qb_cutoff="token",
      attnres=True, attnres_block_size=int(f.require("attn_res_block_size")),
      attnres_key_norm_gain=True)
  return kimi_linear.validated(cfg)


def check_expressible(cfg: ModelConfig) -> None:
  """Raises ConvertError unless cfg is a K3-shaped model (what `save_hf` writes in this format)."""
  wanted = dict(kda_variant="kda", attnres=True, attnres_key_norm_gain=True,
                kda_output_gate_rank=0, kda_gate_rank=cfg.kda_head_dim,
                kda_value_dim=cfg.kda_head_dim)
  for field, value in wanted.items():
    if getattr(cfg, field) != value:
      raise ConvertError(f"ModelConfig.{field} = {getattr(cfg, field)!r}: a K3 checkpoint needs "
                         f"{value!r}")
  if cfg.moe_num_experts == 0:
    raise ConvertError("ModelConfig.moe_num_experts = 0: a K3 checkpoint has MoE layers")
  if cfg.moe_latent_dim == 0:
    raise ConvertError("ModelConfig.moe_latent_dim = 0: a K3 checkpoint has the latent MoE "
                       "(routed_expert_hidden_size > 0)")
  if cfg.moe_num_shared and cfg.moe_shared_dim != cfg.moe_expert_dim:
    raise ConvertError(f"ModelConfig.moe_shared_dim = {cfg.moe_shared_dim}: a K3 checkpoint's "
                       f"shared experts have the routed experts' width ({cfg.moe_expert_dim})")


def _check_choice(name: str, value: str, allowed: tuple) -> None:
  if value not in allowed:
    raise ConvertError(f"--{name} = {value!r}: a K3 checkpoint is written with "
                       f"{' or '.join(repr(a) for a in allowed)}")


def config_to_hf(cfg: ModelConfig, dtype: str, spelling: str = "release",
                 source: Optional[dict] = None, experts: str = "bf16") -> dict:
  """config.json for a K3-shaped ModelConfig (`check_expressible`) in the release's spelling:
  `KimiK3ForConditionalGeneration` with the text model's keys under `text_config` (no vision
  config: the folder holds the text model only). experts='mxfp4' adds the routed experts'
  `quantization_config`. `source`: the config.json the model was imported from, whose token ids
  (PASSED_THROUGH, top level and text_config) are kept."""
  check_expressible(cfg)
  _check_choice("spelling", spelling, SPELLINGS)
  _check_choice("experts", experts, EXPERT_FORMATS)
  source = source or {}
  source_text = source.get("text_config") if isinstance(source.get("text_config"), dict) else source
  layers = range(1, cfg.num_layers + 1)
  full = [n for n in layers if cfg.layer_kind(n - 1) == "mla"]
  situ = cfg.ffn_activation == "situ_glu"
  text = {
      "model_type": TEXT_MODEL_TYPE, "dtype": dtype, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "num_hidden_layers": cfg.num_layers,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "initializer_range": cfg.init_std, "max_position_embeddings": 1048576,
      "hidden_act": "situ" if situ else "silu",
      "num_attention_heads": cfg.mla_num_heads, "num_key_value_heads": cfg.mla_num_heads,
      "q_lora_rank": cfg.mla_q_lora_rank or None, "kv_lora_rank": cfg.mla_kv_lora_rank,
      "qk_nope_head_dim": cfg.mla_qk_nope_dim, "qk_rope_head_dim": cfg.mla_qk_rope_dim,
      "v_head_dim": cfg.mla_v_dim, "mla_use_nope": True,
      "mla_use_output_gate": cfg.mla_output_gate,
      "intermediate_size": cfg.dense_ffn_dim, "first_k_dense_replace": cfg.first_k_dense,
      "moe_layer_freq": 1, "moe_intermediate_size": cfg.moe_expert_dim,
      "num_experts": cfg.moe_num_experts, "num_experts_per_token": cfg.moe_top_k,
      "num_shared_experts": cfg.moe_num_shared, "routed_scaling_factor": cfg.moe_routed_scale,
      "routed_expert_hidden_size": cfg.moe_latent_dim, "latent_moe_use_norm": cfg.moe_latent_norm,
      "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
      "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
      "num_nextn_predict_layers": 0, "attn_res_block_size": cfg.attnres_block_size,
      "linear_attn_config": {
          "full_attn_layers": full, "kda_layers": [n for n in layers if n not in full],
          "head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_num_heads,
          "short_conv_kernel_size": cfg.kda_conv_size,
          "gate_lower_bound": cfg.kda_gate_lower_bound, "use_full_rank_gate": True},
      "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
  if situ:
    text.update(activation_situ_beta=cfg.situ_beta1, activation_situ_linear_beta=cfg.situ_beta2)
  if experts == "mxfp4":
    text["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": MXFP4_FORMAT,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                        "group_size": mxfp4.BLOCK_SIZE, "symmetric": True,
                        "scale_dtype": "torch.uint8"}}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*gate$",
                   "re:.*routed_expert_(down|up)_proj.*", "re:vision_tower.*",
                   "re:mm_projector.*"]}
  text.update({k: source_text[k] for k in PASSED_THROUGH if k in source_text})
  out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
         "text_config": dict(sorted(text.items())), "tie_word_embeddings": cfg.tie_embeddings}
  out.update({k: source[k] for k in PASSED_THROUGH if k in source})
  return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------
# Tensors
# ------------------------------------------------------------------------------------------------

def _t(w: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(w.T)


def _same(x: np.ndarray) -> np.ndarray:
  return x


def _a_log_import(x: np.ndarray, *, name: str, heads: int) -> np.ndarray:
  """A_log [P] (P >= H, padded with zeros) -> [H]."""
  if x.shape[0] < heads:
    raise ConvertError(f"tensor {name} has shape {list(x.shape)}: expected at least {heads} "
                       "entries (linear_attn_config.num_heads)")
  tail = np.asarray(x[heads:], np.float32)
  if np.any(tail != 0):
    bad = heads + int(np.argmax(tail != 0))
    raise ConvertError(f"tensor {name}[{bad}] = {float(x[bad])!r}: the entries past the "
                       f"{heads} heads are padding and must be zero")
  return x[:heads]


def _a_log_export(x: np.ndarray) -> np.ndarray:
  padded = -(-x.shape[0] // A_LOG_PAD_MULTIPLE) * A_LOG_PAD_MULTIPLE
  return np.concatenate([x, np.zeros(padded - x.shape[0], x.dtype)])


def _dequantize_experts(*arrays: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
  """(packed_0, scale_0, packed_1, ...) of E experts' [out, in] weights -> k3jax [E, in, out]
  (bfloat16: exact)."""
  out = None
  for j, base in enumerate(names):
    try:
      w = mxfp4.dequantize(arrays[2 * j], arrays[2 * j + 1], dtype=ml_dtypes.bfloat16, name=base)
    except ValueError as e:
      raise ConvertError(str(e)) from None
    if out is None:
      out = np.empty((len(names),) + w.shape[::-1], w.dtype)
    out[j] = w.T
  return out


def _stack_t(*ws: np.ndarray) -> np.ndarray:
  return np.stack([w.T for w in ws])


class _Quantized:
  """MXFP4 export of one expert weight: the packed codes and the scales come from one
  `mxfp4.quantize` (computed by whichever of the two rules runs first)."""

  def __init__(self, j: int, name: str):
    self.j, self.name, self._scales = j, name, None

  def _quantize(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    try:
      return mxfp4.quantize(_t(x[self.j]))
    except ValueError as e:
      raise ConvertError(f"{self.name}: {e}") from None

  def packed(self, x: np.ndarray) -> np.ndarray:
    packed, self._scales = self._quantize(x)
    return packed

  def scales(self, x: np.ndarray) -> np.ndarray:
    scales, self._scales = self._scales, None
    return scales if scales is not None else self._quantize(x)[1]


class _Rules:
  """Collects import and export rules; names are given without the text model's prefix."""

  def __init__(self, experts: str):
    self.imports: list[ImportRule] = []
    self.exports: list[ExportRule] = []
    self.experts = experts

  def add(self, target: Path, stem: str, hf_shape: tuple, to_k3: Callable, to_hf: Callable,
          stored: Optional[str] = None) -> None:
    self.imports.append(ImportRule(target, tuple(Source((p + stem,), (hf_shape,), to_k3)
                                                 for p in PREFIXES)))
    self.exports.append(ExportRule(PREFIX + stem, (target,), to_hf, stored))

  def norm(self, target: Path, stem: str, width: int, stored: Optional[str] = None) -> None:
    self.add(target, stem, (width,), _same, _same, stored)

  def linear(self, target: Path, stem: str, d_in: int, out_split: tuple) -> None:
    """PyTorch [prod(out_split), d_in] <-> k3jax [d_in, *out_split]."""
    out = math.prod(out_split)
    self.add(target, stem, (out, d_in), lambda w: w.T.reshape((d_in,) + out_split),
             lambda w: _t(w.reshape(d_in, out)))

  def linear_out(self, target: Path, stem: str, in_split: tuple, d_out: int) -> None:
    """PyTorch [d_out, prod(in_split)] <-> k3jax [*in_split, d_out]."""
    n_in = math.prod(in_split)
    self.add(target, stem, (d_out, n_in), lambda w: w.T.reshape(in_split + (d_out,)),
             lambda w: _t(w.reshape(n_in, d_out)))

  def split(self, targets: tuple[Path, ...], stem: str, hf_shape: tuple,
            to_k3: tuple[Callable, ...], to_hf: Callable) -> None:
    """One HF tensor <-> several k3jax leaves."""
    for target, build in zip(targets, to_k3):
      self.imports.append(ImportRule(target, tuple(Source((p + stem,), (hf_shape,), build)
                                                   for p in PREFIXES)))
    self.exports.append(ExportRule(PREFIX + stem, targets, to_hf))

  def experts_weight(self, target: Path, stems: tuple[str, ...], d_out: int, d_in: int) -> None:
    """E experts' [d_out, d_in] weights `{stem}.weight` (or MXFP4 `{stem}.weight_packed` and
    `.weight_scale`) <-> k3jax [E, d_in, d_out]."""
    sources = []
    mx = d_in % mxfp4.BLOCK_SIZE == 0
    for p in PREFIXES:
      bases = tuple(f"{p}{s}.weight" for s in stems)
      if mx:
        names = tuple(n for b in bases for n in (b + "_packed", b + "_scale"))
        shapes = ((d_out, d_in // 2), (d_out, d_in // mxfp4.BLOCK_SIZE)) * len(stems)
        sources.append(Source(names, shapes, functools.partial(_dequantize_experts, names=bases)))
      sources.append(Source(bases, ((d_out, d_in),) * len(stems), _stack_t))
    self.imports.append(ImportRule(target, tuple(sources)))
    for j, stem in enumerate(stems):
      name = f"{PREFIX}{stem}.weight"
      if self.experts == "mxfp4":
        q = _Quantized(j, name)
        self.exports.append(ExportRule(name + "_packed", (target,), q.packed, "uint8"))
        self.exports.append(ExportRule(name + "_scale", (target,), q.scales, "uint8"))
      else:
        self.exports.append(ExportRule(name, (target,), lambda x, j=j: _t(x[j])))


def _layer_rules(rules: _Rules, cfg: ModelConfig, i: int) -> None:
  """The rules of layer i (0-based)."""
  d, pre, lp = cfg.d_model, f"model.layers.{i}.", ("params", f"layer_{i}")
  rules.norm(lp + ("attn_norm", "scale"), pre + "input_layernorm.weight", d)
  rules.norm(lp + ("ffn_norm", "scale"), pre + "post_attention_layernorm.weight", d)
  for mix, hf_mix in (("attn_mix", "self_attention"), ("ffn_mix", "mlp")):
    rules.norm(lp + (mix, "key_norm_gain"), pre + f"{hf_mix}_res_norm.weight", d)
    rules.add(lp + (mix, "query"), pre + f"{hf_mix}_res_proj.weight", (1, d),
              lambda w: w.reshape(-1), lambda w: w.reshape(1, -1))

  a = pre + "self_attn."
  if cfg.layer_kind(i) == "kda":
    h, k, w = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    kda = lp + ("kda",)
    for p in ("q", "k", "v"):
      rules.linear(kda + (f"{p}_proj",), a + f"{p}_proj.weight", d, (h, k))
      rules.add(kda + (f"{p}_conv", "kernel"), a + f"{p}_conv1d.weight", (h * k, 1, w),
                lambda c: _t(c[:, 0, :]), lambda c: np.ascontiguousarray(c.T[:, None, :]),
                "float32")
    rules.linear(kda + ("f_a_proj",), a + "f_a_proj.weight", d, (k,))
    rules.linear(kda + ("f_b_proj",), a + "f_b_proj.weight", k, (h, k))
    rules.norm(kda + ("dt_bias",), a + "dt_bias", h * k, "float32")
    name = a + "A_log"
    rules.imports.append(ImportRule(kda + ("A_log",), tuple(
        Source((p + name,), ((None,),), functools.partial(_a_log_import, name=p + name, heads=h))
        for p in PREFIXES)))
    rules.exports.append(ExportRule(PREFIX + name, (kda + ("A_log",),), _a_log_export, "float32"))
    rules.linear(kda + ("b_proj",), a + "b_proj.weight", d, (h,))
    rules.linear(kda + ("g_proj",), a + "g_proj.weight", d, (h, k))
    rules.norm(kda + ("o_norm",), a + "o_norm.weight", k, "float32")
    rules.linear_out(kda + ("o_proj",), a + "o_proj.weight", (h, k), d)
  else:
    h, nope, rope, v = cfg.mla_num_heads, cfg.mla_qk_nope_dim, cfg.mla_qk_rope_dim, cfg.mla_v_dim
    r, q, mla = cfg.mla_kv_lora_rank, cfg.mla_q_lora_rank, lp + ("mla",)
    if q > 0:
      rules.linear(mla + ("wq_a",), a + "q_a_proj.weight", d, (q,))
      rules.norm(mla + ("q_norm", "scale"), a + "q_a_layernorm.weight", q)
      rules.linear(mla + ("wq_b",), a + "q_b_proj.weight", q, (h, nope + rope))
    else:
      rules.linear(mla + ("wq",), a + "q_proj.weight", d, (h, nope + rope))
    joint = a + "kv_a_proj_with_mqa.weight"
    if rope > 0:
      rules.split((mla + ("wkv_a",), mla + ("wk_rope",)), joint, (r + rope, d),
                  (lambda x: _t(x[:r]), lambda x: _t(x[r:])),
                  lambda c, kr: _t(np.concatenate([c, kr], axis=1)))
    else:
      rules.add(mla + ("wkv_a",), joint, (r, d), _t, _t)
    rules.norm(mla + ("kv_norm", "scale"), a + "kv_a_layernorm.weight", r)
    per_head = lambda x: x.T.reshape(r, h, nope + v)  # noqa: E731
    rules.split((mla + ("wk_b",), mla + ("wv_b",)), a + "kv_b_proj.weight", (h * (nope + v), r),
                (lambda x: per_head(x)[..., :nope], lambda x: per_head(x)[..., nope:]),
                lambda kb, vb: _t(np.concatenate([kb, vb], -1).reshape(r, -1)))
    if cfg.mla_output_gate:
      rules.linear(mla + ("w_gate",), a + "g_proj.weight", d, (h, v))
    rules.linear_out(mla + ("wo",), a + "o_proj.weight", (h, v), d)

  if cfg.layer_uses_moe(i):
    e, m, lat = cfg.moe_num_experts, cfg.moe_expert_dim, cfg.moe_latent_dim
    moe, b = lp + ("moe",), pre + "block_sparse_moe."
    rules.linear(moe + ("router", "kernel"), b + "gate.weight", d, (e,))
    rules.norm(("moe_state", f"layer_{i}", "moe", "bias"), b + "gate.e_score_correction_bias", e,
               "float32")
    rules.linear(moe + ("down", "kernel"), b + "routed_expert_down_proj.weight", d, (lat,))
    if cfg.moe_latent_norm:
      rules.norm(moe + ("latent_norm", "scale"), b + "routed_expert_norm.weight", lat)
    rules.linear(moe + ("up", "kernel"), b + "routed_expert_up_proj.weight", lat, (d,))
    if cfg.moe_num_shared > 0:
      shared = cfg.moe_num_shared * cfg.moe_shared_dim
      for part, hf_part in (("gate", "gate_proj"), ("up", "up_proj")):
        rules.linear(moe + ("shared", part, "kernel"), b + f"shared_experts.{hf_part}.weight", d,
                     (shared,))
      rules.linear_out(moe + ("shared", "out", "kernel"), b + "shared_experts.down_proj.weight",
                       (shared,), d)
    for target, w, d_out, d_in in (("w_gate", "w1", m, lat), ("w_out", "w2", lat, m),
                                   ("w_up", "w3", m, lat)):
      rules.experts_weight(moe + (target,), tuple(f"{b}experts.{j}.{w}" for j in range(e)),
                           d_out, d_in)
  else:
    f, ffn = cfg.dense_ffn_dim, lp + ("ffn",)
    rules.linear(ffn + ("gate", "kernel"), pre + "mlp.gate_proj.weight", d, (f,))
    rules.linear(ffn + ("up", "kernel"), pre + "mlp.up_proj.weight", d, (f,))
    rules.linear_out(ffn + ("out", "kernel"), pre + "mlp.down_proj.weight", (f,), d)


def tensor_rules(cfg: ModelConfig, spelling: str = "release", experts: str = "bf16"
                 ) -> tuple[list[ImportRule], list[ExportRule]]:
  """Every k3jax leaf's import rule and every HF tensor's export rule for a K3-shaped cfg: the
  embedding, the layers, the final mix and norm, the head. The import rules read the release's
  names (prefixed or not; experts MXFP4 or not); the export rules write the release's names and
  dtypes, the routed experts in the export dtype (experts='bf16') or as MXFP4 ('mxfp4')."""
  _check_choice("spelling", spelling, SPELLINGS)
  _check_choice("experts", experts, EXPERT_FORMATS)
  d, v = cfg.d_model, cfg.vocab_size
  rules = _Rules(experts)
  rules.add(("params", "embedding"), "model.embed_tokens.weight", (v, d), _same, _same)
  for i in range(cfg.num_layers):
    _layer_rules(rules, cfg, i)
  rules.norm(("params", "final_mix", "key_norm_gain"), "model.output_attn_res_norm.weight", d)
  rules.add(("params", "final_mix", "query"), "model.output_attn_res_proj.weight", (1, d),
            lambda w: w.reshape(-1), lambda w: w.reshape(1, -1))
  rules.norm(("params", "final_norm", "scale"), "model.norm.weight", d)
  if not cfg.tie_embeddings:
    rules.add(("params", "lm_head"), "lm_head.weight", (v, d), _t, _t)
  return rules.imports, rules.exports
