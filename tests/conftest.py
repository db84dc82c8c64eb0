"""Test-wide set-up: 8 virtual CPU devices so that mesh tests can run anywhere, XLA:CPU's code
generation without LLVM's optimisation passes and programs without source locations (the tests
are compile-bound), and the XLA:CPU work-around of `k3jax.runtime.compiler` for the whole process
(tests call KDA gradients eagerly and under their own jits, where k3jax's per-jit option cannot
apply).

This must run before JAX initialises its backends, hence at conftest import time.
"""
import os
import subprocess
import sys
import tempfile

_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
_OPT_FLAG = "--xla_backend_optimization_level=0"


def _xla_knows(flag: str) -> bool:
  """Whether this jaxlib accepts `flag` (an unknown flag in XLA_FLAGS aborts the process)."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  code = "import jax; jax.numpy.zeros(1).block_until_ready()"
  probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=300)
  return probe.returncode == 0


_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The tests' programs are tiny: XLA:CPU spends their time compiling, most of it in LLVM's
# optimisation passes. Without them (-O0) a compile-bound test takes ~40 % less CPU
# (test_model's scan_equals_loop[attnres]: 134 -> 76 s of user time; a Pallas-interpreter KDA
# kernel test 32 -> 20 s): CI's budget is 15 minutes on 2 cores. Tests compare against
# references with tolerances, or two runs under the same flags; the CLIs and the main job run at
# XLA's default level.
_wanted = [flag for flag, key in ((_OPT_FLAG, "xla_backend_optimization_level"),
                                  (_YNN_FLAG, "ynn_fusion_type")) if key not in _flags]
if _wanted and _xla_knows(" ".join(_wanted)):   # one probe process when this jaxlib knows both
  _flags += " " + " ".join(_wanted)
else:
  _flags += "".join(" " + flag for flag in _wanted if _xla_knows(flag))
os.environ["XLA_FLAGS"] = _flags.strip()

# Source locations in the lowered programs: JAX keeps up to 10 stack frames per operation, which
# XLA carries through every pass as metadata. No test reads them (the name scopes that the
# profile tests read stay), and without them the tests' programs lower and compile with ~8 %
# less CPU (test_plan and test_sharding: 191 -> 176 s of CPU). The subprocesses inherit it.
os.environ.setdefault("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")

# Many tests compile the same tiny programs (train steps, evaluators), in both workers and in the
# commands that tests run as subprocesses: one persistent compilation cache for the whole run
# compiles each once. JAX's variable reaches the subprocesses, whose --compilation_cache_dir
# defaults to it; a test of the cache itself passes a folder of its own. JAX reads the variable at
# import: the test processes cache the programs that take >= 1 s to compile (its default), the
# commands every program (k3jax.runtime.compiler.enable_compilation_cache).
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(tempfile.gettempdir(),
                                                       "k3jax-tests-jax-cache")

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # backends already initialised (e.g. on GPU); the XLA flag above then applies.
  pass
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
  """Tests marked slow run first (the order is otherwise kept): with `pytest -n 2` the two workers
  then end together, instead of one running a minutes-long test alone at the end of the suite."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
