r"""The `convert` command: a Hugging Face model folder <-> a k3jax run directory.

  python -m k3jax.convert --from_hf=DIR --workdir=RUN [--mesh=data:8] [--dtype=bfloat16]
  python -m k3jax.convert --to_hf=DIR --workdir=RUN [--step=N] [--dtype=bfloat16]
                         [--spelling=transformers|release] [--experts=bf16|mxfp4]

(or `k3jax convert ...`). --from_hf writes RUN/config.gin (the imported ModelConfig, every other
setting at its default: bring your own stages and data when you fine-tune) and a checkpoint at
step 0 holding the parameters and balance biases only. `k3jax evaluate` and `k3jax generate`
restore it; `k3jax train --init_from=RUN --workdir=NEW ...` fine-tunes from it. The folder's
tokenizer files are copied to RUN/tokenizer/. --to_hf writes the run's checkpoint (default: the
newest) as a Hugging Face folder that transformers, vLLM and SGLang load, with the tokenizer files
the run has: a Kimi-Linear-shaped model in Kimi-Linear's format, a K3-shaped one in Kimi K3's
(`k3jax.convert.hf.format_for`; the text model only, the routed experts in bf16 or, with
--experts=mxfp4, packed as the release ships them). Importing a K3 folder skips, and reports, the
tensors k3jax does not model (the vision tower). Exit codes: 0 done, 2 a bad input (one line
naming the field, tensor or file; nothing is left behind), 3 the filesystem refused a write.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from typing import Sequence

from absl import app, flags

from k3jax import cli
from k3jax import config as config_lib
from k3jax.convert import kimi_k3, kimi_linear
from k3jax.convert.hf import format_for, load_hf, read_hf_config, save_hf
from k3jax.convert.kimi_linear import ConvertError
from k3jax.convert.safetensors_io import CheckpointFormatError

DTYPES = ("bfloat16", "float32")
# Tokenizer files a Hugging Face folder may hold, copied as they are in both directions.
TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenization_kimi.py", "tokenizer.json", "generation_config.json",
                   "chat_template.jinja")
TOKENIZER_DIR = "tokenizer"
# The imported folder's config.json, kept in the run directory for the export (token ids).
SOURCE_CONFIG = "hf_config.json"


def define_flags() -> None:
  flags.DEFINE_string("from_hf", None, "Import: a Hugging Face model folder (config.json, "
                      "safetensors shards, tokenizer files).")
  flags.DEFINE_string("to_hf", None, "Export: the Hugging Face folder to write.")
  flags.DEFINE_string("workdir", None, "The k3jax run directory: written by --from_hf, read by "
                      "--to_hf.", required=True)
  flags.DEFINE_integer("step", None, "--to_hf: the checkpoint step (default: the newest).")
  flags.DEFINE_string("mesh", "", "--from_hf: place the parameters on this device mesh as they "
                      "are read, e.g. 'data:8' (FSDP: the big weights spread over every device).")
  flags.DEFINE_enum("dtype", None, DTYPES, "--from_hf: the activations' dtype (default: "
                    "config.json's); --to_hf: the tensors' dtype (default bfloat16).")
  flags.DEFINE_enum("param_dtype", "float32", DTYPES, "--from_hf: the parameters' dtype.")
  flags.DEFINE_enum("spelling", None, sorted(set(kimi_linear.SPELLINGS + kimi_k3.SPELLINGS)),
                    "--to_hf: the tensor names and config keys. Kimi-Linear: 'transformers' (the "
                    "default: exactly what its save_pretrained writes) or 'release' (the released "
                    "checkpoints', read by vLLM and SGLang); K3: 'release' (the only one).")
  flags.DEFINE_enum("experts", "bf16", kimi_k3.EXPERT_FORMATS, "--to_hf, K3: the routed experts "
                    "in --dtype ('bf16') or packed as MXFP4 as the release ships them ('mxfp4': "
                    "exact for weights on the MXFP4 grid, others are rounded to it).")
  cli.define_flags()
  for module in cli.SHARED_FLAG_MODULES:
    flags.adopt_module_key_flags(module)


def _fresh_target(path: str, flag: str) -> None:
  if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
    raise ConvertError(f"{flag}={path} already exists and is not empty: choose a new folder")


def _staged(target: str):
  """A temporary folder beside `target`, renamed to it by `commit` (nothing half-written)."""
  parent = os.path.dirname(os.path.abspath(target)) or "."
  os.makedirs(parent, exist_ok=True)
  return tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(target))}.", dir=parent)


def _commit(staged: str, target: str) -> None:
  if os.path.isdir(target):
    os.rmdir(target)   # empty (`_fresh_target`)
  os.replace(staged, target)


def import_folder(folder: str, workdir: str, mesh_spec: str = "", dtype=None,
                  param_dtype: str = "float32") -> config_lib.Config:
  """--from_hf: writes the run directory `workdir` for the Hugging Face `folder`; returns its
  Config. Nothing is left at `workdir` when it fails."""
  from k3jax.parallel import sharding  # pylint: disable=import-outside-toplevel
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  from k3jax.training import run_dir  # pylint: disable=import-outside-toplevel
  if not os.path.isdir(folder):
    raise ConvertError(f"--from_hf={folder} is not a folder")
  _fresh_target(workdir, "--workdir")
  source_config = read_hf_config(folder)
  mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
  staged = _staged(workdir)
  try:
    cfg, variables = load_hf(folder, mesh, dtype=dtype, param_dtype=param_dtype,
                             log=lambda line: print(f"note: {line}", file=sys.stderr))
    data = cfg.data
    tokenizer_dir = os.path.join(staged, TOKENIZER_DIR)
    copied = _copy_tokenizer(folder, tokenizer_dir)
    if "tiktoken.model" in copied and "tokenizer_config.json" in copied:
      data = config_lib.DataConfig(tokenizer="kimi", tokenizer_path=os.path.join(
          os.path.abspath(workdir), TOKENIZER_DIR, "tiktoken.model"))
    cfg = config_lib.Config(model=cfg.model, impl=cfg.impl, mesh=cfg.mesh, data=data)
    run_dir.write_config(staged, cfg)
    with open(os.path.join(staged, SOURCE_CONFIG), "w") as f:
      json.dump(source_config, f, indent=2)
    ckpt = checkpoint_lib.Checkpointer(os.path.join(staged, "checkpoints"), cfg.checkpoint)
    try:
      ckpt.save_model(0, params=variables["params"], moe_state=variables["moe_state"],
                      meta={"stage": 0, "seq_len": cfg.stages.stages[0][0], "data_position": 0,
                            "imported_from": os.path.abspath(folder)})
    finally:
      ckpt.close()
    _commit(staged, workdir)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise
  return cfg


def export_run(workdir: str, folder: str, step=None, dtype: str = "bfloat16",
               spelling=None, experts: str = "bf16") -> list[str]:
  """--to_hf: writes the Hugging Face folder for `workdir`'s checkpoint `step` (default: the
  newest); returns the shard files. Nothing is left at `folder` when it fails."""
  from k3jax.training import checkpoint as checkpoint_lib  # pylint: disable=import-outside-toplevel
  from k3jax.training import run_dir  # pylint: disable=import-outside-toplevel
  if not os.path.isfile(os.path.join(workdir, run_dir.CONFIG_GIN)):
    raise ConvertError(f"--workdir={workdir} is not a k3jax run directory (no "
                       f"{run_dir.CONFIG_GIN})")
  _fresh_target(folder, "--to_hf")
  cfg = run_dir.read_config(workdir)
  format_for(cfg.model)
  source_config = None
  if os.path.isfile(os.path.join(workdir, SOURCE_CONFIG)):
    with open(os.path.join(workdir, SOURCE_CONFIG)) as f:
      source_config = json.load(f)
  _, params, moe_state, _ = checkpoint_lib.restore_run(
      workdir, step, log=lambda line: print(f"warning: {line}", file=sys.stderr))
  staged = _staged(folder)
  try:
    files = save_hf(staged, cfg.model, params, moe_state, dtype=dtype, spelling=spelling,
                    source_config=source_config, experts=experts)
    _copy_tokenizer(os.path.join(workdir, TOKENIZER_DIR), staged)
    _commit(staged, folder)
  except BaseException:
    shutil.rmtree(staged, ignore_errors=True)
    raise
  return files


def _copy_tokenizer(source: str, target: str) -> list[str]:
  """Copies the TOKENIZER_FILES that `source` holds into `target`; returns their names."""
  copied = []
  for name in TOKENIZER_FILES:
    path = os.path.join(source, name)
    if os.path.isfile(path):
      os.makedirs(target, exist_ok=True)
      shutil.copy2(path, os.path.join(target, name))
      copied.append(name)
  return copied


def main(argv: Sequence[str]) -> None:
  from k3jax.training import run_dir  # pylint: disable=import-outside-toplevel
  FLAGS = flags.FLAGS
  cli.start(argv)

  def run() -> int:
    if (FLAGS.from_hf is None) == (FLAGS.to_hf is None):
      raise ConvertError("give exactly one of --from_hf=DIR (import) and --to_hf=DIR (export)")
    if FLAGS.from_hf is not None:
      if FLAGS.step is not None:
        raise ConvertError("--step is for --to_hf (the imported checkpoint is step 0)")
      cfg = import_folder(FLAGS.from_hf, FLAGS.workdir, FLAGS.mesh, FLAGS.dtype,
                          FLAGS.param_dtype)
      print(f"wrote {FLAGS.workdir}: {cfg.model.num_layers} layers, d_model "
            f"{cfg.model.d_model}, checkpoint step 0")
    else:
      if FLAGS.mesh:
        raise ConvertError("--mesh is for --from_hf")
      files = export_run(FLAGS.workdir, FLAGS.to_hf, FLAGS.step, FLAGS.dtype or "bfloat16",
                         FLAGS.spelling, FLAGS.experts)
      print(f"wrote {FLAGS.to_hf}: config.json and {len(files)} safetensors file(s)")
    return 0

  cli.finish(run, usage_errors=(ConvertError, CheckpointFormatError),
             write_errors=(run_dir.RunWriteError,))


if __name__ == "__main__":
  define_flags()
  app.run(main)
