"""A run directory's own files besides checkpoints and metrics: the operative configuration.

DIR/config.gin holds `config.to_gin(cfg)` (every field of every part; re-parsable) and
DIR/config.json the same as JSON. A resumed run compares the stored config with its own and names
each changed setting; evaluation and generation rebuild the run's Config from config.gin. A
config.gin written before a setting moved (`config.MOVED_FIELDS`) is read with its new name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Callable

from k3jax import config as config_lib

CONFIG_GIN = "config.gin"


def write_config(workdir: str, cfg: config_lib.Config) -> None:
  """Writes DIR/config.gin (re-parsable with `read_config`) and DIR/config.json."""
  with open(os.path.join(workdir, CONFIG_GIN), "w") as f:
    f.write(config_lib.to_gin(cfg))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)


def _stored_text(workdir: str, log: Callable[[str], None]) -> str | None:
  """DIR/config.gin's bindings with moved settings renamed (said once through `log`), or None
  when the directory has none."""
  path = os.path.join(workdir, CONFIG_GIN)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    text, renamed = config_lib.renamed_settings(f.read())
  if renamed:
    log(f"{path} was written with settings that have since moved; read as: " + "; ".join(renamed))
  return text


def read_config(workdir: str, log: Callable[[str], None] = lambda line: print(
    f"note: {line}", file=sys.stderr)) -> config_lib.Config:
  """The Config of the run in `workdir` (its config.gin, `from_gin`-validated).

  Raises FileNotFoundError when the directory holds no config.gin (not a k3jax run).
  """
  text = _stored_text(workdir, log)
  if text is None:
    raise FileNotFoundError(f"--workdir={workdir!r} has no {CONFIG_GIN} (not a k3jax training "
                            "run?)")
  bindings = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
  return config_lib.from_gin([], bindings)


def config_differences(old_gin: str, new_gin: str) -> list[str]:
  """'Configurable.field: old -> new' for every binding that differs between two config.gin texts
  (as `config.to_gin` writes them: one 'Name.field = value' per line)."""
  def bindings(text):
    out = {}
    for line in text.splitlines():
      if "=" in line and not line.lstrip().startswith("#"):
        name, value = line.split("=", 1)
        out[name.strip()] = value.strip()
    return out
  old, new = bindings(old_gin), bindings(new_gin)
  return [f"{name}: {old.get(name, '(unset)')} -> {new.get(name, '(unset)')}"
          for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)]


def changed_settings(workdir: str, cfg: config_lib.Config) -> list[str]:
  """'Configurable.field: old -> new' between the run so far (DIR/config.gin) and `cfg`; empty
  for a new run."""
  text = _stored_text(workdir, log=lambda line: None)
  return [] if text is None else config_differences(text, config_lib.to_gin(cfg))
