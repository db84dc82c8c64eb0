"""Test-wide set-up: 8 virtual CPU devices so that mesh tests can run anywhere, and the XLA:CPU
work-around of `k3jax.compiler` for the whole process (tests call KDA gradients eagerly and under
their own jits, where k3jax's per-jit option cannot apply).

This must run before JAX initialises its backends, hence at conftest import time.
"""
import os
import subprocess
import sys
import tempfile

_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib accepts `flag` (an unknown flag in XLA_FLAGS aborts the process)."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  code = "import jax; jax.numpy.zeros(1).block_until_ready()"
  probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
  return probe.returncode == 0


_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
if "ynn_fusion_type" not in _flags and _xla_knows(_YNN_FLAG):
  _flags += " " + _YNN_FLAG
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # backends already initialised (e.g. on GPU); the XLA flag above then applies.
  pass
jax.config.update("jax_default_matmul_precision", "highest")
# Many tests compile the same tiny programs (train steps, evaluators) in both workers: a persistent
# compilation cache shared by the run's processes compiles each once (programs >= 1 s to compile).
jax.config.update("jax_compilation_cache_dir",
                  os.path.join(tempfile.gettempdir(), "k3jax-tests-jax-cache"))


def pytest_collection_modifyitems(config, items):
  """Tests marked slow run first (the order is otherwise kept): with `pytest -n 2` the two workers
  then end together, instead of one running a minutes-long test alone at the end of the suite."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
