"""transformers loads what `k3jax convert --to_hf` writes, and computes the same logits: a
Kimi-Linear-shaped k3jax model trained for a few steps, exported, loaded with
AutoModelForCausalLM. Runs only where transformers 5.23 and torch are installed (the `[hf]`
extra); tests/test_convert.py checks the same format against fixtures without them. transformers
runs in a subprocess: torch and jax in one process share thread pools and signal handlers, and
the test worker must stay a plain jax process for the tests after this one."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
  pytest.skip("needs torch and transformers (pip install -e '.[hf]')", allow_module_level=True)

from k3jax import config as config_lib  # noqa: E402
from k3jax.convert import command, load_hf  # noqa: E402
from k3jax.model import K3Model  # noqa: E402
from k3jax.training import checkpoint as checkpoint_lib  # noqa: E402
from k3jax.training import train  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "kimi_linear", "tiny8")
# Loads the exported folder with transformers and writes its logits for the tokens given.
TRANSFORMERS_LOGITS = """
import sys, numpy as np, torch, transformers
folder, tokens_path, out_path = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="eager")
tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
with torch.no_grad():
  np.save(out_path, model(tokens, use_cache=False).logits.numpy())
"""


def test_transformers_loads_a_trained_export(tmp_path):
  version = importlib.metadata.version("transformers")
  if version != "5.23.0":
    pytest.skip(f"written against transformers 5.23.0, found {version}")
  imported, _ = load_hf(FIXTURE)
  # The fixture's shapes with a vocabulary that holds the byte tokenizer's (257 ids).
  model = dataclasses.replace(imported.model, vocab_size=300)
  cfg = config_lib.Config(model=model, stages=config_lib.StagesConfig(
      stages=((32, 3),), tokens_per_step=256))
  run = str(tmp_path / "run")
  train(cfg, run, progress=False, tensorboard=False)
  hf_folder = str(tmp_path / "hf")
  command.export_run(run, hf_folder, dtype="float32")

  _, params, moe_state, meta = checkpoint_lib.restore_run(run)
  assert meta["step"] == 3
  tokens = np.random.default_rng(0).integers(0, 300, (2, 77)).astype(np.int32)
  ours = np.asarray(K3Model(model).apply({"params": params, "moe_state": moe_state},
                                         jnp.asarray(tokens)), np.float64)
  np.save(tmp_path / "tokens.npy", tokens)
  proc = subprocess.run([sys.executable, "-c", TRANSFORMERS_LOGITS, hf_folder,
                         str(tmp_path / "tokens.npy"), str(tmp_path / "theirs.npy")],
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  theirs = np.load(tmp_path / "theirs.npy")
  error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
  print(f"relative error of the logits against transformers': {error:.2e}")
  assert error <= 1e-5, error
