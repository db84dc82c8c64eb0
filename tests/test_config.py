"""Config parsing and validation: every gin file loads; bad settings name the field."""

import glob
import os

import pytest

from k3jax import config as config_lib

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
    ("ModelConfig.kda_chunk_size = 24", "ModelConfig.kda_chunk_size"),
    ("ModelConfig.kda_conv_backward = 'triton'", "ModelConfig.kda_conv_backward"),
    ("ModelConfig.moe_situ_glu = 'triton'", "ModelConfig.moe_situ_glu"),
    ("StagesConfig.stages = ((100, 3),)", "StagesConfig.tokens_per_step"),
    ("StagesConfig.stages = ((512, 3), (64, 3))", "StagesConfig.stages"),
    ("OptimizerConfig.name = 'sgd'", "OptimizerConfig.name"),
    ("MeshConfig.axes = 'model:2'", "MeshConfig.axes"),
    ("DataConfig.source = 'text'", "DataConfig.path"),
    ("StagesConfig.remat = ('full',)", "StagesConfig.remat"),            # 4 default stages
    ("StagesConfig.remat = ('none', 'full', 'some', 'full')", "StagesConfig.remat"),
    ("ModelConfig.position_chunk_tokens = -1", "ModelConfig.position_chunk_tokens"),
])
def test_bad_values_name_the_field(binding, field):
  with pytest.raises(config_lib.ConfigError, match=field.replace(".", r"\.")):
    config_lib.from_gin([], [binding])


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


def test_stage_model_config_sets_each_stage_remat():
  cfg = config_lib.from_gin([], ["StagesConfig.remat = ('none', 'full', 'dots', 'full')",
                                 "ModelConfig.remat = 'dots'"])
  assert [config_lib.stage_model_config(cfg, i).remat for i in range(4)] == \
      ["none", "full", "dots", "full"]
  assert config_lib.stage_model_config(cfg, 1).d_model == cfg.model.d_model
  plain = config_lib.from_gin([], ["ModelConfig.remat = 'dots'"])
  assert config_lib.stage_model_config(plain, 3) is plain.model
  with pytest.raises(ValueError, match="StagesConfig.stages"):
    config_lib.stage_model_config(cfg, 4)


def test_position_chunks_need_a_dropless_moe():
  with pytest.raises(config_lib.ConfigError, match="moe_capacity_factor.*per chunk"):
    config_lib.from_gin([], ["ModelConfig.position_chunk_tokens = 64",
                             "ModelConfig.moe_capacity_factor = 1.25"])
  assert config_lib.from_gin([], ["ModelConfig.position_chunk_tokens = 64"]).model \
      .position_chunk_tokens == 64
