"""k3jax.convert against transformers' KimiLinearForCausalLM (fixtures it wrote: tests/fixtures/
kimi_linear/README.md): the imported model computes the same logits and greedy tokens; the
export is bit-exact, and has exactly the tensor names, shapes and dtypes transformers writes; the
same import on an 8-device FSDP mesh; the command's run directories, and its bad inputs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.convert import ConvertError, load_hf, save_hf
from k3jax.convert import command
from k3jax.convert.safetensors_io import CheckpointReader
from k3jax.model import K3Model
from k3jax.model.decode import generate
from k3jax.training import checkpoint as checkpoint_lib
from testlib import random_like

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "kimi_linear")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fixture(name: str) -> str:
  return os.path.join(FIXTURES, name)


def reference(name: str) -> dict:
  return dict(np.load(os.path.join(fixture(name.removesuffix("_release")), "reference.npz")))


def relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def safetensors_header(path: str) -> dict:
  """{name: (shape, dtype)} read by the `safetensors` library (an independent reader)."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel
  with safe_open(path, "np") as f:
    return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.mark.parametrize("name", ["tiny4", "tiny8", "tiny4_release"])
def test_imported_logits_equal_transformers(name):
  """fp32 logits against transformers' (tiny8: 8 layers with 2 MLA, 16 experts top-4, two shared
  experts, T = 100; the release copy: the release's names and config keys in two shards)."""
  cfg, variables = load_hf(fixture(name))
  ref = reference(name)
  # Jitted: one compile of the forward pass, against one per operation and shape eagerly.
  logits = jax.jit(K3Model(cfg.model).apply)(variables, jnp.asarray(ref["input_ids"]))
  assert logits.shape == ref["logits"].shape
  assert relative_error(logits, ref["logits"]) <= 1e-5


@pytest.mark.parametrize("name", ["tiny4", "tiny8"])
def test_greedy_generation_gives_transformers_tokens(name):
  cfg, variables = load_hf(fixture(name))
  ref = reference(name)
  prompt = jnp.asarray(ref["greedy_prompt"])
  out = generate(cfg.model, variables, prompt, 16, jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(out[:, prompt.shape[1]:]), ref["greedy"])


def test_export_round_trip_is_bit_exact_with_transformers_names(tmp_path):
  """load_hf -> save_hf (fp32) writes what transformers' save_pretrained wrote: the same tensor
  names, shapes, dtypes and values, and the same config keys (but transformers_version)."""
  cfg, variables = load_hf(fixture("tiny8"))
  save_hf(str(tmp_path), cfg.model, variables["params"], variables["moe_state"], dtype="float32")
  want = safetensors_header(os.path.join(fixture("tiny8"), "model.safetensors"))
  assert safetensors_header(str(tmp_path / "model.safetensors")) == want
  source, written = (CheckpointReader(d) for d in (fixture("tiny8"), str(tmp_path)))
  for name in want:
    np.testing.assert_array_equal(written.get(name), source.get(name), err_msg=name)
  with open(os.path.join(fixture("tiny8"), "config.json")) as f:
    hf_config = json.load(f)
  with open(tmp_path / "config.json") as f:
    ours = json.load(f)
  assert set(hf_config) - set(ours) == {"transformers_version"} and set(ours) <= set(hf_config)
  assert {k: v for k, v in ours.items() if v != hf_config[k]} == {}
  _, again = load_hf(str(tmp_path))
  jax.tree.map(np.testing.assert_array_equal, again, variables)


def test_release_spelling_and_bfloat16_export(tmp_path):
  """spelling='release' writes the release's names (dense layer under mlp.) and config keys;
  bfloat16 tensors read back (by safetensors' JAX reader) as the fp32 weights rounded once."""
  cfg, variables = load_hf(fixture("tiny4"))
  save_hf(str(tmp_path), cfg.model, variables["params"], variables["moe_state"],
          dtype="bfloat16", spelling="release", max_shard_bytes=300_000)
  with open(tmp_path / "model.safetensors.index.json") as f:
    names = set(json.load(f)["weight_map"])
  release = CheckpointReader(fixture("tiny4_release"))
  assert names == set(release.names())
  with open(tmp_path / "config.json") as f:
    ours = json.load(f)
  with open(os.path.join(fixture("tiny4_release"), "config.json")) as f:
    theirs = json.load(f)
  assert ours["linear_attn_config"] == theirs["linear_attn_config"]
  assert ours["first_k_dense_replace"] == 1 and "layer_types" not in ours
  from safetensors.flax import load_file  # pylint: disable=import-outside-toplevel
  shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[0]
  for name, value in load_file(str(tmp_path / shard)).items():
    assert value.dtype == jnp.bfloat16, name
    want = release.get(name).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(value, np.float32), np.asarray(want, np.float32))


def test_import_onto_an_fsdp_mesh_gives_the_same_logits():
  from k3jax.parallel import sharding  # pylint: disable=import-outside-toplevel
  mesh = sharding.make_mesh("data:8")
  cfg, variables = load_hf(fixture("tiny4"), mesh)
  embedding = variables["params"]["embedding"]
  assert len(embedding.sharding.device_set) == 8
  assert embedding.addressable_shards[0].data.shape[0] < embedding.shape[0] or \
      embedding.addressable_shards[0].data.shape[1] < embedding.shape[1]
  ref = reference("tiny4")
  with sharding.with_mesh(mesh):
    logits = jax.jit(K3Model(cfg.model).apply)(variables, jnp.asarray(ref["input_ids"]))
  assert relative_error(logits, ref["logits"]) <= 1e-5


def test_run_directory_restores_and_exports_back(tmp_path):
  """--from_hf writes config.gin, the source config and a model-only step 0 that restore_run
  reads; training refuses to resume it and points at --init_from; --to_hf writes the same
  tensors back."""
  run = str(tmp_path / "run")
  command.import_folder(fixture("tiny4"), run)
  assert sorted(os.listdir(run)) == ["checkpoints", "config.gin", "config.json",
                                     command.SOURCE_CONFIG, command.TOKENIZER_DIR]
  assert os.listdir(os.path.join(run, command.TOKENIZER_DIR)) == ["generation_config.json"]
  _, params, moe_state, meta = checkpoint_lib.restore_run(run)
  assert meta["step"] == 0 and meta["imported_from"] == os.path.abspath(fixture("tiny4"))
  _, variables = load_hf(fixture("tiny4"))
  jax.tree.map(np.testing.assert_array_equal, {"params": params, "moe_state": moe_state},
               variables)
  out = str(tmp_path / "hf")
  command.export_run(run, out, dtype="float32")
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]
  source, written = (CheckpointReader(d) for d in (fixture("tiny4"), out))
  assert written.names() == source.names()
  for name in source.names():
    np.testing.assert_array_equal(written.get(name), source.get(name), err_msg=name)


def _corrupt(tmp_path, edit_config=None, edit_tensors=None, drop_shard=False,
             unindex=None) -> str:
  """A copy of the release fixture (two shards and an index) with one thing wrong."""
  folder = str(tmp_path / "bad")
  shutil.copytree(fixture("tiny4_release"), folder)
  if edit_config is not None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
      hf = json.load(f)
    edit_config(hf)
    with open(path, "w") as f:
      json.dump(hf, f)
  if drop_shard:
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
  if edit_tensors is not None:
    from safetensors.numpy import load_file, save_file  # pylint: disable=import-outside-toplevel
    path = os.path.join(folder, "model-00001-of-00002.safetensors")
    tensors = load_file(path)
    edit_tensors(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
  if unindex is not None:
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
      index = json.load(f)
    del index["weight_map"][unindex]
    with open(path, "w") as f:
      json.dump(index, f)
  return folder


BAD_INPUTS = [
    ("model_type", dict(edit_config=lambda c: c.update(model_type="deepseek_v3")),
     "config.json: model_type = 'deepseek_v3' is not supported: 'kimi_linear' (Kimi-Linear) or "
     "'kimi_k3' (Kimi K3)"),
    ("missing shard", dict(drop_shard=True), "missing shard"),
    ("wrong shape", dict(edit_tensors=lambda t: t.update(
        {"model.embed_tokens.weight": np.zeros((250, 32), np.float32)})),
     "tensor model.embed_tokens.weight has shape [250, 32]: expected [250, 64]"),
    ("index names a tensor its shard lacks", dict(edit_tensors=lambda t: t.pop("lm_head.weight")),
     "model.safetensors.index.json puts tensor 'lm_head.weight' in "
     "model-00001-of-00002.safetensors, which does not hold it"),
    ("missing tensor", dict(edit_tensors=lambda t: t.pop("lm_head.weight"),
                            unindex="lm_head.weight"),
     "has no tensor lm_head.weight (for k3jax's params/lm_head)"),
    ("q_lora_rank", dict(edit_config=lambda c: c.update(q_lora_rank=16)),
     "config.json: q_lora_rank = 16 cannot be expressed in k3jax"),
    ("grouped routing", dict(edit_config=lambda c: c.update(num_expert_group=2)),
     "num_expert_group = 2 cannot be expressed in k3jax: grouped routing"),
    ("norm_topk_prob", dict(edit_config=lambda c: c.update(moe_renormalize=False)),
     "moe_renormalize = False cannot be expressed"),
    ("attention bias", dict(edit_config=lambda c: c.update(attention_bias=True)),
     "attention_bias = True cannot be expressed in k3jax: k3jax's projections have no bias"),
    ("layer pattern", dict(edit_config=lambda c: c["linear_attn_config"].update(
        full_attn_layers=[2], kda_layers=[1, 3, 4])),
     "full attention at layers [2] (1-based) cannot be expressed"),
]


@pytest.mark.parametrize("case,corruption,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, case, corruption, message):
  folder = _corrupt(tmp_path, **corruption)
  run = tmp_path / "run"
  with pytest.raises(Exception) as info:
    command.import_folder(folder, str(run))
  text = str(info.value)
  assert message in text and "\n" not in text, (case, text)
  assert isinstance(info.value, ValueError), type(info.value)
  assert not run.exists() and sorted(os.listdir(tmp_path)) == ["bad"]


def test_the_command_exits_2_with_one_line(tmp_path):
  folder = _corrupt(tmp_path, edit_config=lambda c: c.update(moe_renormalize=False))
  proc = subprocess.run([sys.executable, "-m", "k3jax.convert", f"--from_hf={folder}",
                         f"--workdir={tmp_path / 'run'}"], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: config.json: moe_renormalize"), lines
  assert not (tmp_path / "run").exists()


def test_existing_target_and_unsupported_export_are_refused(tmp_path):
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "x").write_text("")
  with pytest.raises(ConvertError, match="already exists and is not empty"):
    command.import_folder(fixture("tiny4"), str(tmp_path / "run"))
  with pytest.raises(ConvertError, match="is not a k3jax run directory"):
    command.export_run(str(tmp_path / "nothing"), str(tmp_path / "out"))


def test_fine_tuning_starts_from_the_imported_weights(tmp_path):
  """`train --init_from=RUN`: a new run whose step-0 parameters are the imported ones (with a new
  optimizer state); training in the imported directory itself is refused with that advice; a
  model that does not fit is refused naming the settings."""
  from k3jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from k3jax.model import init_variables  # pylint: disable=import-outside-toplevel
  from k3jax.training import train  # pylint: disable=import-outside-toplevel
  # A Kimi-Linear-shaped model whose vocabulary holds the byte tokenizer's (the fixtures' 250
  # does not), written as a Hugging Face folder and imported.
  imported, _ = load_hf(fixture("tiny4"))
  model = dataclasses.replace(imported.model, vocab_size=300)
  # Random values of the model's shapes (traced, not compiled: `init_variables` runs the forward
  # pass, a compile as large as the model's); unlike an initialisation, no two leaves are alike.
  variables = jax.tree.map(jnp.asarray, random_like(
      flax.core.meta.unbox(jax.eval_shape(lambda: init_variables(model, jax.random.key(3)))),
      seed=3))
  save_hf(str(tmp_path / "hf"), model, variables["params"], variables["moe_state"],
          dtype="float32")
  run = str(tmp_path / "imported")
  command.import_folder(str(tmp_path / "hf"), run)
  cfg = config_lib.from_gin([os.path.join(run, "config.gin")],
                            ["StagesConfig.stages = ((16, 2),)", "StagesConfig.tokens_per_step = 64"])
  with pytest.raises(config_lib.ConfigError, match="holds a model imported by k3jax.convert"):
    train(cfg, run, max_steps=0, progress=False, tensorboard=False)
  other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_model=32))
  with pytest.raises(config_lib.ConfigError, match="ModelConfig.d_model: 64 -> 32"):
    train(other, str(tmp_path / "other"), max_steps=0, init_from=run, progress=False,
          tensorboard=False)
  assert not (tmp_path / "other").exists()
  train(cfg, str(tmp_path / "tuned"), max_steps=0, init_from=run, progress=False,
        tensorboard=False)
  _, params, moe_state, meta = checkpoint_lib.restore_run(str(tmp_path / "tuned"))
  assert meta["step"] == 0 and "imported_from" not in meta
  jax.tree.map(np.testing.assert_array_equal, {"params": params, "moe_state": moe_state},
               variables)
