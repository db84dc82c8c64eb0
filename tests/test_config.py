"""Config parsing and validation: every gin file loads; bad settings name the field."""

import dataclasses
import glob
import os

import pytest

from k3jax import config as config_lib
from k3jax.training import run_dir
from testlib import TINY_RUN_BINDINGS

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "gin_configs")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(GIN_DIR, "*.gin"))))
def test_every_gin_file_parses_and_validates(path):
  cfg = config_lib.from_gin([path])
  assert cfg.model.num_layers > 0
  assert cfg.model.layer_kind(cfg.model.num_layers - 1) == "mla"


def test_bindings_override_files():
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")], ["ModelConfig.d_model = 96"])
  assert cfg.model.d_model == 96


@pytest.mark.parametrize("binding, field", [
    ("ModelConfig.dtype = 'float16'", "ModelConfig.dtype"),
    ("ModelConfig.kda_gate_lower_bound = -7.0", "ModelConfig.kda_gate_lower_bound"),
    ("ModelConfig.moe_top_k = 8", "ModelConfig.moe_top_k"),
    ("ModelConfig.moe_balance = 'magic'", "ModelConfig.moe_balance"),
    ("ModelConfig.moe_qb_cadence = 'token'", "ModelConfig.moe_qb_cadence"),
    ("ModelConfig.moe_qb_histogram_bins = 1", "ModelConfig.moe_qb_histogram_bins"),
    ("ModelConfig.kda_chunk_size = 24", "ModelConfig.kda_chunk_size"),
    ("ImplConfig.kda_conv_kernel = 'triton'", "ImplConfig.kda_conv_kernel"),
    ("ImplConfig.moe_situ_glu = 'triton'", "ImplConfig.moe_situ_glu"),
    ("ImplConfig.attention_impl = 'pallas'", "ImplConfig.attention_impl"),      # removed variant
    ("ImplConfig.attention_impl = 'auto_mosaic_bwd'", "ImplConfig.attention_impl"),
    ("RuntimeConfig.microbatch_loop = 'loop'", "RuntimeConfig.microbatch_loop"),
    ("RuntimeConfig.precompile_workers = 0", "RuntimeConfig.precompile_workers"),
    ("StagesConfig.stages = ((100, 3),)", "StagesConfig.tokens_per_step"),
    ("StagesConfig.stages = ((512, 3), (64, 3))", "StagesConfig.stages"),
    ("OptimizerConfig.name = 'sgd'", "OptimizerConfig.name"),
    ("MeshConfig.axes = 'model:2'", "MeshConfig.axes"),
    ("DataConfig.source = 'text'", "DataConfig.path"),
    ("ImplConfig.stage_remat = ('full',)", "ImplConfig.stage_remat"),     # 4 default stages
    ("ImplConfig.stage_remat = ('none', 'full', 'some', 'full')", "ImplConfig.stage_remat"),
    ("ImplConfig.position_chunk_tokens = -1", "ImplConfig.position_chunk_tokens"),
    ("EvalConfig.log_expert_loads = 1", "EvalConfig.log_expert_loads"),
])
def test_bad_values_name_the_field(binding, field):
  with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
    config_lib.from_gin([], [binding])


def test_expert_loads_are_refused_without_moe_layers():
  # Nothing to log: refused at the start rather than a run whose records silently lack the loads.
  with pytest.raises(config_lib.ConfigError,
                     match=r"EvalConfig\.log_expert_loads = True is not allowed: False when "
                           r"ModelConfig\.moe_num_experts = 0 \(a model without MoE layers"):
    config_lib.from_gin([], ["EvalConfig.log_expert_loads = True",
                             "ModelConfig.moe_num_experts = 0"])
  assert config_lib.from_gin([], ["EvalConfig.log_expert_loads = True"]).eval.log_expert_loads
  assert not config_lib.from_gin([], ["ModelConfig.moe_num_experts = 0"]).eval.log_expert_loads


def test_qb_cadence_error_says_what_is_allowed():
  with pytest.raises(config_lib.ConfigError,
                     match=r"ModelConfig.moe_qb_cadence = 'token' is not allowed: one of "
                           r"\('step', 'microbatch'\)"):
    config_lib.from_gin([], ["ModelConfig.moe_qb_cadence = 'token'"])


def test_unknown_parameter_and_missing_file_are_errors():
  with pytest.raises(config_lib.ConfigError, match="d_modle"):
    config_lib.from_gin([], ["ModelConfig.d_modle = 3"])
  with pytest.raises(config_lib.ConfigError, match="does not exist"):
    config_lib.from_gin(["/nonexistent.gin"])


def test_gin_syntax_errors_name_the_file_and_line(tmp_path):
  bad = tmp_path / "bad.gin"
  bad.write_text("ModelConfig.num_layers = 2\nModelConfig.d_model = \n")
  with pytest.raises(config_lib.ConfigError,
                     match=f"gin file {bad}, line 2: Unable to parse value"):
    config_lib.from_gin([str(bad)])
  with pytest.raises(config_lib.ConfigError,
                     match=r"gin binding 'ModelConfig.d_model = 3\)': Expected newline"):
    config_lib.from_gin([], ["ModelConfig.d_model = 3)"])


def test_a_lone_string_instead_of_a_list_is_an_error():
  """from_gin('a.gin') would otherwise look for the files 'a', '.', 'g', ..."""
  with pytest.raises(config_lib.ConfigError, match="gin_files must be a list of strings"):
    config_lib.from_gin("gin_configs/tiny.gin")
  with pytest.raises(config_lib.ConfigError, match="bindings must be a list of strings"):
    config_lib.from_gin([], "ModelConfig.d_model = 64")


def test_layer_pattern_is_three_to_one_with_last_mla():
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "k3.gin")]).model
  kinds = [cfg.layer_kind(i) for i in range(cfg.num_layers)]
  assert kinds.count("kda") == 69 and kinds.count("mla") == 24
  assert kinds[91] == kinds[92] == "mla"
  kl = config_lib.from_gin([os.path.join(GIN_DIR, "kimi_linear_48b.gin")]).model
  mla = [i + 1 for i in range(kl.num_layers) if kl.layer_kind(i) == "mla"]
  assert mla == [4, 8, 12, 16, 20, 24, 27]


def test_stage_bookkeeping():
  s = config_lib.StagesConfig(stages=((64, 3), (512, 2)), tokens_per_step=1024)
  s.validate()
  assert s.total_steps == 5
  assert [s.stage_at(i) for i in range(5)] == [0, 0, 0, 1, 1]
  assert s.batch_size(0) == 16 and s.batch_size(1) == 2


def test_stage_impl_sets_each_stage_remat():
  cfg = config_lib.from_gin([], ["ImplConfig.stage_remat = ('none', 'full', 'dots', 'full')",
                                 "ImplConfig.remat = 'dots'", "ImplConfig.scan_layers = False"])
  assert [cfg.stage_impl(i).remat for i in range(4)] == ["none", "full", "dots", "full"]
  # Only remat changes: the other implementation settings are the run's.
  assert cfg.stage_impl(1).scan_layers is False
  assert cfg.stage_impl(1) == dataclasses.replace(cfg.impl, remat="full")
  assert cfg.stage_impl(2) == cfg.impl.for_stage(2, 4)
  plain = config_lib.from_gin([], ["ImplConfig.remat = 'dots'"])
  assert plain.stage_impl(3) is plain.impl
  assert plain.impl.for_stage(0, 1) is plain.impl
  with pytest.raises(ValueError, match="StagesConfig.stages"):
    cfg.stage_impl(4)
  with pytest.raises(ValueError, match="StagesConfig.stages"):
    cfg.stage_impl(-1)


def test_validate_refuses_stage_remat_of_the_wrong_length():
  """The length check spans two parts (ImplConfig and StagesConfig): Config.validate makes it."""
  stages = config_lib.StagesConfig(stages=((64, 3), (512, 2)), tokens_per_step=1024)
  for stage_remat in (("full",), ("none", "full", "full")):
    cfg = config_lib.Config(stages=stages, impl=config_lib.ImplConfig(stage_remat=stage_remat))
    cfg.impl.validate()  # fine on its own: only the stage count refuses it
    with pytest.raises(config_lib.ConfigError,
                       match=r"ImplConfig\.stage_remat.*one entry per stage \(2 in StagesConfig"):
      cfg.validate()
  for stage_remat in ((), ("none", "full")):
    cfg = config_lib.Config(stages=stages, impl=config_lib.ImplConfig(stage_remat=stage_remat))
    assert cfg.validate() is cfg


def test_position_chunks_need_a_dropless_moe():
  with pytest.raises(config_lib.ConfigError, match="moe_capacity_factor.*per chunk"):
    config_lib.from_gin([], ["ImplConfig.position_chunk_tokens = 64",
                             "ModelConfig.moe_capacity_factor = 1.25"])
  assert config_lib.from_gin([], ["ImplConfig.position_chunk_tokens = 64"]).impl \
      .position_chunk_tokens == 64
  # The same check on a Config built without gin.
  cfg = config_lib.Config(model=config_lib.ModelConfig(moe_capacity_factor=1.25),
                          impl=config_lib.ImplConfig(position_chunk_tokens=64))
  with pytest.raises(config_lib.ConfigError,
                     match=r"ModelConfig\.moe_capacity_factor.*ImplConfig\.position_chunk_tokens"):
    cfg.validate()
  config_lib.Config(model=config_lib.ModelConfig(moe_capacity_factor=1.25)).validate()


def _new_default(new: str) -> str:
  """The default value of the setting `new` ('Configurable.field'), as gin text."""
  cls, field = new.split(".")
  return repr(getattr(getattr(config_lib, cls)(), field))


@pytest.mark.parametrize("old, new", sorted(config_lib.MOVED_FIELDS.items()))
def test_moved_settings_name_their_new_place(old, new, tmp_path):
  """A binding or gin file that sets a field at its old place is refused in one line naming the
  new place, even with a value the new place accepts; the new place takes it."""
  value = _new_default(new)
  binding = f"{old} = {value}"
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.from_gin([], [binding])
  assert str(e.value) == f"gin binding {binding!r}: {old} has moved: set {new} instead"
  assert "\n" not in str(e.value)
  path = tmp_path / "old.gin"
  path.write_text(f"ModelConfig.d_model = 32\n{old} = {value}  # as before\n")
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.from_gin([str(path)])
  assert str(e.value) == f"gin file {path}: {old} has moved: set {new} instead"
  cfg = config_lib.from_gin([], [f"{new} = {value}"])
  cls, field = new.split(".")
  part = {"ImplConfig": cfg.impl, "RuntimeConfig": cfg.runtime}[cls]
  assert repr(getattr(part, field)) == value


def test_moved_fields_name_existing_fields():
  fields = {f"{cls.__name__}.{f.name}" for cls in config_lib._PARTS.values()
            for f in dataclasses.fields(cls)}
  for old, new in config_lib.MOVED_FIELDS.items():
    assert new in fields and old not in fields, (old, new)


def test_renamed_settings_rewrites_old_config_gin():
  text, notes = config_lib.renamed_settings(OLD_CONFIG_GIN)
  assert config_lib._moved_settings(text) == []
  assert "ImplConfig.scan_layers = False\n" in text
  assert "ImplConfig.kda_conv_kernel = 'xla'\n" in text
  assert "ImplConfig.attention_impl = 'auto'\n" in text
  assert "ImplConfig.stage_remat = ('none', 'full')\n" in text
  assert "RuntimeConfig.microbatch_loop = 'host'\n" in text
  assert "RuntimeConfig.precompile = 'off'\n" in text
  assert "auto_mosaic_bwd" not in text
  # Every other line is kept as it was.
  old_lines, new_lines = OLD_CONFIG_GIN.splitlines(), text.splitlines()
  assert len(old_lines) == len(new_lines) and text.endswith("\n")
  assert [a for a, b in zip(old_lines, new_lines) if a != b] == [
      line for line in old_lines if config_lib._moved_settings(line)]
  moved = [line.split(" =")[0] for line in old_lines if config_lib._moved_settings(line)]
  assert len(moved) == len(config_lib.MOVED_FIELDS)
  assert notes == [f"{old} -> {config_lib.MOVED_FIELDS[old]}" for old in moved] + [
      "ImplConfig.attention_impl = 'auto_mosaic_bwd' -> 'auto'"]
  # Current names and allowed values are left alone.
  current = config_lib.to_gin(config_lib.from_gin([], []))
  assert config_lib.renamed_settings(current) == (current, [])


@pytest.mark.parametrize("old_value, new_value",
                         [(old, new) for (_, old), new in config_lib.REPLACED_VALUES.items()])
@pytest.mark.parametrize("quote", ["'", '"'])
def test_renamed_settings_replaces_removed_values(old_value, new_value, quote):
  text, notes = config_lib.renamed_settings(
      f"ModelConfig.attention_impl = {quote}{old_value}{quote}\n")
  assert text == f"ImplConfig.attention_impl = {new_value!r}\n"
  assert notes == ["ModelConfig.attention_impl -> ImplConfig.attention_impl",
                   f"ImplConfig.attention_impl = {old_value!r} -> {new_value!r}"]
  assert config_lib.from_gin([], [text]).impl.attention_impl == new_value


def test_read_config_reads_a_run_directory_written_before_the_move(tmp_path):
  (tmp_path / "config.gin").write_text(OLD_CONFIG_GIN)
  notes = []
  cfg = run_dir.read_config(str(tmp_path), log=notes.append)
  expected = config_lib.from_gin([], TINY_RUN_BINDINGS + [
      "ImplConfig.scan_layers = False", "ImplConfig.kda_conv_kernel = 'xla'",
      "ImplConfig.attention_impl = 'auto'", "ImplConfig.stage_remat = ('none', 'full')",
      "RuntimeConfig.microbatch_loop = 'host'", "RuntimeConfig.precompile = 'off'",
      # The buckets that run was written with (the default then; () derives them now).
      "EvalConfig.position_buckets = (0, 1024, 8192, 65536, 262144)",
      # Likewise the exact QB quantile (the default then; 1000 histogram bins now).
      "ModelConfig.moe_qb_histogram_bins = 0",
      # And the QB update of every micro-batch, which the code of then made.
      "ModelConfig.moe_qb_cadence = 'microbatch'"])
  assert cfg == expected
  assert len(notes) == 1 and "\n" not in notes[0]
  assert notes[0].startswith(f"{tmp_path / 'config.gin'} was written with settings that have "
                             "since moved")
  assert "ModelConfig.scan_layers -> ImplConfig.scan_layers" in notes[0]
  assert "StagesConfig.remat -> ImplConfig.stage_remat" in notes[0]
  assert "'auto_mosaic_bwd' -> 'auto'" in notes[0]
  # A resumed run compares the stored settings under their new names: the same config is no
  # change, and today's default cadence is named as one.
  assert run_dir.changed_settings(str(tmp_path), expected) == []
  added = ["ModelConfig.moe_qb_cadence: 'microbatch' -> 'step'"]
  expected = dataclasses.replace(expected, model=dataclasses.replace(
      expected.model, moe_qb_cadence="step"))
  assert run_dir.changed_settings(str(tmp_path), expected) == added
  assert run_dir.changed_settings(
      str(tmp_path), dataclasses.replace(expected, impl=dataclasses.replace(
          expected.impl, scan_layers=True))) == ["ImplConfig.scan_layers: False -> True"] + added


def test_read_config_of_a_current_run_directory(tmp_path):
  cfg = config_lib.from_gin([], TINY_RUN_BINDINGS + ["ImplConfig.remat = 'full'"])
  run_dir.write_config(str(tmp_path), cfg)
  notes = []
  assert run_dir.read_config(str(tmp_path), log=notes.append) == cfg
  assert notes == []
  with pytest.raises(FileNotFoundError, match="has no config.gin"):
    run_dir.read_config(str(tmp_path / "elsewhere"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(GIN_DIR, "*.gin"))))
def test_to_gin_round_trips(path, tmp_path):
  cfg = config_lib.from_gin([path])
  text = config_lib.to_gin(cfg)
  written = tmp_path / "config.gin"
  written.write_text(text)
  assert config_lib.from_gin([str(written)]) == cfg
  # Every field of every part is written: the defaults do not fill any in.
  assert len([line for line in text.splitlines() if not line.startswith("#")]) == 1 + sum(
      len(dataclasses.fields(cls)) for cls in config_lib._PARTS.values())


def test_to_gin_round_trips_implementation_and_runtime_settings(tmp_path):
  cfg = config_lib.from_gin([os.path.join(GIN_DIR, "tiny.gin")], [
      "ImplConfig.scan_layers = False", "ImplConfig.stage_remat = ('none', 'full', 'dots', 'full')",
      "ImplConfig.position_chunk_tokens = 64", "ImplConfig.attention_impl = 'xla'",
      "RuntimeConfig.microbatch_loop = 'host'", "RuntimeConfig.precompile_workers = 3",
      "Config.seed = 7"])
  written = tmp_path / "config.gin"
  written.write_text(config_lib.to_gin(cfg))
  assert config_lib.from_gin([str(written)]) == cfg


# DIR/config.gin as k3jax wrote it before ImplConfig and RuntimeConfig existed
# (k3jax.train.config_to_gin at 4cda8c3, for testlib.TINY_RUN_BINDINGS plus
# ModelConfig.scan_layers = False, ModelConfig.attention_impl = 'auto_mosaic_bwd',
# ModelConfig.kda_conv_backward = 'xla', StagesConfig.remat = ('none', 'full'),
# StagesConfig.microbatch_loop = 'host' and StagesConfig.precompile = 'off').
OLD_CONFIG_GIN = """\
# model
ModelConfig.vocab_size = 257
ModelConfig.d_model = 32
ModelConfig.num_layers = 2
ModelConfig.mla_every = 2
ModelConfig.norm_eps = 1e-05
ModelConfig.dtype = 'float32'
ModelConfig.param_dtype = 'float32'
ModelConfig.tie_embeddings = False
ModelConfig.init_std = 0.02
ModelConfig.kda_num_heads = 2
ModelConfig.kda_head_dim = 16
ModelConfig.kda_value_dim = 16
ModelConfig.kda_conv_size = 4
ModelConfig.kda_gate_rank = 0
ModelConfig.kda_gate_lower_bound = -5.0
ModelConfig.kda_chunk_size = 16
ModelConfig.kda_backend = 'auto'
ModelConfig.kda_conv_backward = 'xla'
ModelConfig.mla_num_heads = 2
ModelConfig.mla_q_lora_rank = 0
ModelConfig.mla_kv_lora_rank = 16
ModelConfig.mla_qk_nope_dim = 16
ModelConfig.mla_qk_rope_dim = 8
ModelConfig.mla_v_dim = 16
ModelConfig.mla_output_gate = True
ModelConfig.attention_impl = 'auto_mosaic_bwd'
ModelConfig.situ_beta1 = 4.0
ModelConfig.situ_beta2 = 25.0
ModelConfig.dense_ffn_dim = 32
ModelConfig.first_k_dense = 1
ModelConfig.moe_num_experts = 4
ModelConfig.moe_top_k = 2
ModelConfig.moe_latent_dim = 16
ModelConfig.moe_latent_norm = True
ModelConfig.moe_expert_dim = 16
ModelConfig.moe_num_shared = 1
ModelConfig.moe_shared_dim = 16
ModelConfig.moe_routed_scale = 1.0
ModelConfig.moe_balance = 'quantile'
ModelConfig.moe_qb_rate = 1.0
ModelConfig.moe_qb_cutoff = 'per_expert'
ModelConfig.moe_qb_histogram_bins = 0
ModelConfig.moe_qb_interval = 1
ModelConfig.moe_loss_free_rate = 0.001
ModelConfig.moe_aux_loss_coef = 0.01
ModelConfig.moe_capacity_factor = 0.0
ModelConfig.moe_grouped_matmul = 'auto'
ModelConfig.moe_situ_glu = 'auto'
ModelConfig.attnres = True
ModelConfig.attnres_block_size = 2
ModelConfig.attnres_kernel = 'auto'
ModelConfig.norm_kernel = 'xla'
ModelConfig.remat = 'none'
ModelConfig.scan_layers = False
ModelConfig.position_chunk_tokens = 0
# data
DataConfig.source = 'builtin'
DataConfig.path = ''
DataConfig.jsonl_field = 'text'
DataConfig.tokenizer = 'byte'
DataConfig.tokenizer_path = ''
DataConfig.validation_fraction = 0.05
DataConfig.max_bytes = 200000
DataConfig.mqar_num_kv_pairs = 8
DataConfig.reshuffle_each_epoch = True
DataConfig.seed = 0
# optimizer
OptimizerConfig.name = 'adamw'
OptimizerConfig.learning_rate = 0.003
OptimizerConfig.warmup_fraction = 0.01
OptimizerConfig.end_lr_fraction = 0.1
OptimizerConfig.weight_decay = 0.1
OptimizerConfig.b1 = 0.9
OptimizerConfig.b2 = 0.95
OptimizerConfig.eps = 1e-08
OptimizerConfig.grad_clip_norm = 1.0
OptimizerConfig.qk_clip_tau = 0.0
# stages
StagesConfig.stages = ((16, 3), (32, 3))
StagesConfig.tokens_per_step = 64
StagesConfig.microbatch_tokens = 0
StagesConfig.microbatch_loop = 'host'
StagesConfig.remat = ('none', 'full')
StagesConfig.precompile = 'off'
StagesConfig.precompile_workers = 2
# mesh
MeshConfig.axes = ''
# checkpoint
CheckpointConfig.every_steps = 50
CheckpointConfig.keep_last = 2
CheckpointConfig.async_save = True
# eval
EvalConfig.every_steps = 0
EvalConfig.num_batches = 4
EvalConfig.passkey_multipliers = (1, 2, 4, 8)
EvalConfig.passkey_samples = 8
EvalConfig.log_every_steps = 5
EvalConfig.passkey_max_len = 65536
EvalConfig.position_buckets = (0, 1024, 8192, 65536, 262144)
Config.seed = 0
"""
