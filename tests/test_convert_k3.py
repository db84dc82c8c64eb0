"""k3jax.convert's Kimi K3 format (k3jax/convert/kimi_k3.py), on tiny folders in the released
checkpoint's format that tests/fixtures/kimi_k3/make_fixture.py writes (at run time, about a
second) from a random K3-shaped k3jax model: one with the routed experts packed as MXFP4 (OCP MX),
one with them in bf16. Both import to exactly the source model's parameters (every value the
format stores is exact: bf16 weights, F32 A_log/dt_bias/convolutions/o_norm/routing bias, MXFP4
grid values dequantised), hence to exactly its logits; the vision tower is skipped and reported;
A_log is unpadded; the export writes the release's names, shapes and dtypes and round-trips bit
for bit, MXFP4 included; bad K3 inputs fail with one line naming the field or tensor."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import ConvertError, command, hf_model_config, kimi_k3, kimi_linear, load_hf
from k3jax.convert import save_hf
from k3jax.convert.hf import format_for
from k3jax.convert.safetensors_io import CheckpointReader, ShardedWriter
from k3jax.model import K3Model
from k3jax.model.layout import scanned_to_unrolled, to_layout
from k3jax.training import checkpoint as checkpoint_lib

_SCRIPT = os.path.join(os.path.dirname(__file__), "fixtures", "kimi_k3", "make_fixture.py")
_spec = importlib.util.spec_from_file_location("kimi_k3_make_fixture", _SCRIPT)
make_fixture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_fixture)

VISION = sorted(make_fixture.VISION)
SKIP_LINE = "skipped 6 tensors that k3jax does not model: mm_projector.* (2), vision_tower.* (4)"


@dataclasses.dataclass
class Fixture:
  root: str
  cfg: object            # the source ModelConfig
  source: dict           # the source variables, per-layer layout, fp32 NumPy

  def folder(self, experts: str) -> str:
    return os.path.join(self.root, experts)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Fixture:
  root = str(tmp_path_factory.mktemp("kimi_k3"))
  cfg, source = make_fixture.write_fixture(root)
  return Fixture(root, cfg, source)


@pytest.fixture(scope="module")
def forward(fx):
  """The source model's forward, jitted once for every call (same config, shapes and layout)."""
  apply = jax.jit(K3Model(fx.cfg).apply)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, fx.cfg.vocab_size, (2, 24)),
                       jnp.int32)
  return lambda variables: np.asarray(apply(variables, tokens))


def unrolled(variables) -> dict:
  return jax.tree.map(np.asarray, scanned_to_unrolled(variables))


def assert_trees_equal(got, want) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)
  jax.tree_util.tree_map_with_path(
      lambda path, g, w: np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path)),
      got, want)


def tensors(folder: str, skip=()) -> dict:
  reader = CheckpointReader(folder)
  return {name: reader.get(name) for name in reader.names() if name not in skip}


def safetensors_headers(folder: str) -> dict:
  """{name: (shape, dtype)} read by the `safetensors` library (an independent reader)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  out = {}
  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    with safe_open(os.path.join(folder, file), "np") as f:
      out.update({k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                  for k in f.keys()})
  return out


@pytest.mark.parametrize("experts", ["mxfp4", "bf16"])
def test_folder_imports_the_source_parameters_bit_for_bit(fx, experts):
  """The MXFP4 folder and its bf16 source import to the same parameters, bit for bit, equal to
  the k3jax model they were written from; the config is the source's (activations in the
  config's bfloat16 unless asked), and the vision tower is skipped and reported."""
  lines = []
  cfg, variables = load_hf(fx.folder(experts), dtype="float32", log=lines.append)
  assert cfg.model == fx.cfg
  assert_trees_equal(unrolled(variables), fx.source)
  assert lines == [SKIP_LINE]
  assert hf_model_config(fx.folder(experts)) == dataclasses.replace(fx.cfg, dtype="bfloat16")


def test_logits_equal_the_source_models_and_the_test_sees_mapping_errors(fx, forward):
  """Identical parameters give identical logits (tolerance 0: the same program on the same
  bits). Two deliberate mapping errors move them: the AttnRes key-norm gain dropped (the query
  alone) and the experts' gate and up swapped."""
  want = forward(to_layout(fx.source, fx.cfg, True))
  assert np.all(np.isfinite(want)) and np.std(want) > 0.1
  for experts in ("mxfp4", "bf16"):
    _, variables = load_hf(fx.folder(experts), dtype="float32")
    np.testing.assert_array_equal(forward(variables), want, err_msg=experts)
  broken = []
  no_gain = jax.tree.map(lambda x: x, fx.source)
  for layer in range(fx.cfg.num_layers):
    no_gain["params"][f"layer_{layer}"]["ffn_mix"]["key_norm_gain"] = np.ones(fx.cfg.d_model,
                                                                              np.float32)
  broken.append(no_gain)
  swapped = jax.tree.map(lambda x: x, fx.source)
  moe = swapped["params"]["layer_2"]["moe"]
  moe["w_gate"], moe["w_up"] = moe["w_up"], moe["w_gate"]
  broken.append(swapped)
  for variables in broken:
    got = forward(to_layout(variables, fx.cfg, True))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) > 1e-3


def test_a_log_is_stored_padded_with_zeros_and_read_unpadded(fx):
  reader = CheckpointReader(fx.folder("mxfp4"))
  name = "language_model.model.layers.0.self_attn.A_log"
  assert reader.dtype_name(name) == "F32" and reader.shape(name) == (128,)
  stored = reader.get(name)
  assert np.all(stored[2:] == 0)
  _, variables = load_hf(fx.folder("mxfp4"))
  np.testing.assert_array_equal(unrolled(variables)["params"]["layer_0"]["kda"]["A_log"],
                                stored[:2])


def test_release_dtypes_in_the_fixture(fx):
  """What the fixture claims to be: the release's dtypes, MXFP4 experts as U8 [out, in/2] and
  [out, in/32] (read by the safetensors library)."""
  headers = safetensors_headers(fx.folder("mxfp4"))
  pre = "language_model.model.layers.1."
  assert headers[pre + "block_sparse_moe.experts.0.w1.weight_packed"] == ((32, 16), "U8")
  assert headers[pre + "block_sparse_moe.experts.0.w2.weight_scale"] == ((32, 1), "U8")
  assert headers[pre + "self_attn.q_conv1d.weight"] == ((64, 1, 4), "F32")
  assert headers[pre + "self_attn.dt_bias"] == ((64,), "F32")
  assert headers[pre + "self_attn.q_proj.weight"] == ((64, 64), "BF16")
  assert headers[pre + "mlp_res_proj.weight"] == ((1, 64), "BF16")
  assert headers["language_model.lm_head.weight"] == ((320, 64), "BF16")


def test_export_round_trip_is_bit_exact_in_the_releases_format(fx, tmp_path):
  """load -> save_hf writes the fixture's tensors (the vision tower aside): the same names,
  shapes, dtypes and bytes, with bf16 experts by default and MXFP4 (the same packed codes and
  scales) with experts='mxfp4'; its config.json reads back to the same model, keeping the token
  ids; and it imports to the same parameters."""
  with open(os.path.join(fx.folder("mxfp4"), "config.json")) as f:
    source_config = json.load(f)
  cfg, variables = load_hf(fx.folder("mxfp4"), dtype="float32")
  for experts in ("bf16", "mxfp4"):
    out = str(tmp_path / experts)
    save_hf(out, cfg.model, variables["params"], variables["moe_state"], experts=experts,
            source_config=source_config, max_shard_bytes=300_000)
    want_headers = safetensors_headers(fx.folder(experts))
    assert safetensors_headers(out) == {k: v for k, v in want_headers.items() if k not in VISION}
    written, want = tensors(out), tensors(fx.folder(experts), skip=VISION)
    for name in want:
      np.testing.assert_array_equal(written[name], want[name], err_msg=name)
    with open(os.path.join(out, "config.json")) as f:
      ours = json.load(f)
    with open(os.path.join(fx.folder(experts), "config.json")) as f:
      theirs = json.load(f)
    assert ours["model_type"] == "kimi_k3" and ours["architectures"] == theirs["architectures"]
    differ = {k: (v, theirs["text_config"].get(k)) for k, v in ours["text_config"].items()
              if v != theirs["text_config"].get(k)}
    assert differ == {}
    assert set(theirs["text_config"]) - set(ours["text_config"]) == {"rope_theta", "rope_scaling"}
    reloaded_cfg, reloaded = load_hf(out, dtype="float32")
    assert reloaded_cfg.model == cfg.model
    assert_trees_equal(reloaded, variables)


def test_flat_text_config_without_prefix_is_read_as_k3(fx, tmp_path):
  """A text-only copy: config.json the text config itself (model_type 'kimi_linear' with K3's
  keys, which the Kimi-Linear importer would misread) and names without `language_model.`."""
  folder = str(tmp_path / "flat")
  writer = ShardedWriter(folder)
  for name, array in tensors(fx.folder("mxfp4"), skip=VISION).items():
    writer.add(name.removeprefix("language_model."), array)
  writer.close()
  with open(os.path.join(fx.folder("mxfp4"), "config.json")) as f:
    flat = json.load(f)["text_config"]
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(flat, f)
  lines = []
  cfg, variables = load_hf(folder, dtype="float32", log=lines.append)
  assert cfg.model == fx.cfg and lines == []
  assert_trees_equal(unrolled(variables), fx.source)


def test_format_for_picks_the_format_or_names_the_field(fx):
  assert format_for(fx.cfg) is kimi_k3
  linear = dataclasses.replace(
      fx.cfg, attnres=False, attnres_key_norm_gain=False, moe_latent_dim=0,
      moe_latent_norm=False, mla_output_gate=False, ffn_activation="swiglu",
      kda_gate_lower_bound=None, mla_q_lora_rank=0, kda_output_gate_rank=32)
  assert format_for(linear) is kimi_linear
  with pytest.raises(ConvertError) as info:
    format_for(dataclasses.replace(fx.cfg, moe_latent_dim=0))
  assert str(info.value).startswith("ModelConfig.moe_latent_dim = 0: a K3 checkpoint has the "
                                    "latent MoE") and "Kimi-Linear-shaped" in str(info.value)
  with pytest.raises(ConvertError, match=r"^ModelConfig.moe_latent_dim = 32: a Kimi-Linear "):
    format_for(dataclasses.replace(linear, moe_latent_dim=32))
  with pytest.raises(ConvertError, match="a Kimi-Linear checkpoint's experts are not quantised"):
    save_hf("/nonexistent", linear, {}, {}, experts="mxfp4")
  with pytest.raises(ConvertError, match=r"^--spelling = 'transformers': a K3 checkpoint is "
                     r"written with 'release'$"):
    save_hf("/nonexistent", fx.cfg, {}, {}, spelling="transformers")


def test_command_round_trip_with_mxfp4_experts(fx, tmp_path, capsys):
  """--from_hf then --to_hf --experts=mxfp4: the run directory restores the source parameters,
  the skip is reported on stderr, and the export holds the fixture's tensors again."""
  run, out = str(tmp_path / "run"), str(tmp_path / "hf")
  command.import_folder(fx.folder("mxfp4"), run, dtype="float32")
  assert f"note: {SKIP_LINE}" in capsys.readouterr().err
  _, params, moe_state, _ = checkpoint_lib.restore_run(run)
  assert_trees_equal(unrolled({"params": params, "moe_state": moe_state}), fx.source)
  command.export_run(run, out, experts="mxfp4")
  written, want = tensors(out), tensors(fx.folder("mxfp4"), skip=VISION)
  assert sorted(written) == sorted(want)
  for name in want:
    np.testing.assert_array_equal(written[name], want[name], err_msg=name)
  with open(os.path.join(out, "config.json")) as f:
    text = json.load(f)["text_config"]
  assert (text["bos_token_id"], text["eos_token_id"], text["pad_token_id"]) == (310, 311, 319)


# ------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------

def _edit_text(**changes):
  def edit(hf):
    for key, value in changes.items():
      node, *path = key.split(".")
      target = hf["text_config"]
      for part in ([node] + path)[:-1]:
        target = target[part]
      if value is _DELETE:
        del target[([node] + path)[-1]]
      else:
        target[([node] + path)[-1]] = value
  return edit


_DELETE = object()
PRE = "language_model.model.layers."


def _a_log(value, length=128):
  def edit(t):
    x = np.zeros(length, np.float32)
    x[:min(2, length)] = t[PRE + "0.self_attn.A_log"][:min(2, length)]
    if length > 5:
      x[5] = value
    t[PRE + "0.self_attn.A_log"] = x
  return edit


def _nan_scale(t):
  scale = t[PRE + "1.block_sparse_moe.experts.3.w2.weight_scale"].copy()
  scale[0, 0] = 0xFF
  t[PRE + "1.block_sparse_moe.experts.3.w2.weight_scale"] = scale


BAD_INPUTS = [
    ("low-rank KDA output gate", dict(config=_edit_text(
        **{"linear_attn_config.use_full_rank_gate": False})),
     "config.json: text_config.linear_attn_config.use_full_rank_gate = False cannot be expressed "
     "in k3jax: the K3 importer reads KDA's full-rank output gate g_proj"),
    ("no AttnRes", dict(config=_edit_text(attn_res_block_size=_DELETE)),
     "config.json: text_config.attn_res_block_size is missing"),
    ("no latent MoE", dict(config=_edit_text(routed_expert_hidden_size=None)),
     "config.json: text_config.routed_expert_hidden_size is missing"),
    ("gate bound", dict(config=_edit_text(**{"linear_attn_config.gate_lower_bound": -8.0})),
     "ModelConfig.kda_gate_lower_bound = -8.0 is not allowed"),
    ("activation", dict(config=_edit_text(hidden_act="gelu")),
     "config.json: text_config.hidden_act = 'gelu' cannot be expressed in k3jax"),
    ("SiTU beta missing", dict(config=_edit_text(activation_situ_beta=_DELETE)),
     "config.json: text_config.activation_situ_beta is missing"),
    ("rotary MLA", dict(config=_edit_text(mla_use_nope=False)),
     "config.json: text_config.mla_use_nope = False cannot be expressed in k3jax"),
    ("grouped routing", dict(config=_edit_text(num_expert_group=4)),
     "config.json: text_config.num_expert_group = 4 cannot be expressed in k3jax"),
    ("quantization format", dict(config=_edit_text(
        **{"quantization_config.format": "nvfp4-pack-quantized"})),
     "config.json: text_config.quantization_config.format = 'nvfp4-pack-quantized' cannot be "
     "read"),
    ("MXFP4 group size", dict(config=_edit_text(
        **{"quantization_config.config_groups.group_0.weights.group_size": 16})),
     "quantization_config.config_groups.group_0.weights.group_size = 16: MXFP4 blocks are 32"),
    ("A_log padding not zero", dict(tensors=_a_log(0.25)),
     "tensor language_model.model.layers.0.self_attn.A_log[5] = 0.25: the entries past the 2 "
     "heads are padding and must be zero"),
    ("A_log too short", dict(tensors=_a_log(0.0, length=1)),
     "tensor language_model.model.layers.0.self_attn.A_log has shape [1]: expected at least 2"),
    ("NaN MXFP4 scale", dict(tensors=_nan_scale),
     "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale[0, 0] is 0xFF "
     "(E8M0 NaN)"),
    ("missing expert scale", dict(tensors=lambda t: t.pop(
        PRE + "2.block_sparse_moe.experts.5.w1.weight_scale")),
     "has no tensor language_model.model.layers.2.block_sparse_moe.experts.5.w1.weight_scale "
     "(for k3jax's params/layer_2/moe/w_gate)"),
    ("packed shape", dict(tensors=lambda t: t.update({
        PRE + "4.block_sparse_moe.experts.0.w3.weight_packed": np.zeros((32, 8), np.uint8)})),
     "tensor language_model.model.layers.4.block_sparse_moe.experts.0.w3.weight_packed has shape "
     "[32, 8]: expected [32, 16]"),
]


@pytest.mark.parametrize("case,edits,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_k3_input_is_one_line(fx, tmp_path, case, edits, message):
  folder = str(tmp_path / "bad")
  shutil.copytree(fx.folder("mxfp4"), folder)
  if "config" in edits:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
      hf = json.load(f)
    edits["config"](hf)
    with open(path, "w") as f:
      json.dump(hf, f)
  if "tensors" in edits:
    t = tensors(folder)
    edits["tensors"](t)
    for file in os.listdir(folder):
      if file.endswith(".safetensors") or file.endswith(".index.json"):
        os.remove(os.path.join(folder, file))
    writer = ShardedWriter(folder, make_fixture.MAX_SHARD_BYTES)
    for name, array in t.items():
      writer.add(name, array)
    writer.close()
  with pytest.raises(ConvertError) as info:
    load_hf(folder)
  text = str(info.value)
  assert message in text and "\n" not in text, (case, text)
