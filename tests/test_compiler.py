"""k3jax.runtime.compiler: the XLA:CPU work-around, checked on the shape that crashed without it,
and the persistent compilation cache of the CLIs."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from testlib import TINY_RUN_BINDINGS

from k3jax.runtime import compiler

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_options_only_on_cpu():
  opts = compiler.compiler_options()
  if jax.default_backend() == "cpu":
    assert set(opts) <= {"xla_cpu_experimental_ynn_fusion_type"}
  else:
    assert opts == {}


def test_options_for_backends_and_device_counts():
  gpu_one = compiler.options_for("gpu", 1)
  assert gpu_one == {"xla_gpu_enable_latency_hiding_scheduler": False}
  # Several GPUs: the scheduler overlaps their collectives, so it stays on.
  assert compiler.options_for("gpu", 8) == {}
  assert compiler.options_for("tpu", 1) == {}
  assert set(compiler.options_for("cpu", 8)) <= {"xla_cpu_experimental_ynn_fusion_type"}


def test_options_named_in_xla_flags_are_left_to_them():
  flags = "--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=true"
  assert compiler.options_for("gpu", 1, flags) == {}
  assert compiler.options_for("gpu", 1, "--xla_gpu_autotune_level=0") == {
      "xla_gpu_enable_latency_hiding_scheduler": False}
  assert compiler.options_for("cpu", 1, "--xla_cpu_experimental_ynn_fusion_type=") == {}


def test_jit_keeps_caller_options_and_semantics():
  f = compiler.jit(lambda x, n: x * n, static_argnums=1)
  np.testing.assert_array_equal(f(jnp.arange(3.0), 2), [0.0, 2.0, 4.0])


def test_chunk_kda_gradient_that_crashed_xla_cpu():
  """chunk 32, 2 heads: the gradient used to kill the process (SIGSEGV in XLA:CPU's YNNPACK
  fusion). Run in a subprocess without the suite's process-wide flag (conftest), so that it is
  k3jax's per-jit option that is tested, and so that a regression fails this test instead of the
  whole session; the gradient must match the recurrent reference."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from k3jax.ops import kda, kda_inputs
      rng = np.random.default_rng(0)
      B, T, H, D = 8, 32, 2, 32
      q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
      g = -jnp.asarray(rng.random((B, T, H, D)), jnp.float32)
      beta = jnp.asarray(rng.random((B, T, H)), jnp.float32)
      def loss(fn, *args):
        o, _ = fn(*args)
        return jnp.sum(o * o)
      chunk = lambda *a: kda.chunk_kda(*a, chunk_size=32, use_qk_l2norm=True, backend="xla")
      ref = lambda q, k, v, g, b: kda.recurrent_kda(kda_inputs.l2_normalize(q),
                                                   kda_inputs.l2_normalize(k), v, g, b)
      from k3jax.runtime import compiler
      ga = compiler.jit(jax.grad(lambda *a: loss(chunk, *a), argnums=(0, 1, 2, 3, 4)))(
          q, k, v, g, beta)
      gb = jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)
      for a, b in zip(ga, gb):
        err = float(jnp.sqrt(jnp.mean((a - b) ** 2)) / jnp.sqrt(jnp.mean(b ** 2)))
        assert err < 1e-4, err
      print("ok")
  """)
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "ynn_fusion_type" not in f)
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=600, env=env)
  assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
  assert "ok" in out.stdout


def _run(args, env_extra=None, timeout=600):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.update(env_extra or {})
  out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=_REPO)
  assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
  return out


@pytest.mark.slow
def test_cli_compilation_cache_is_written_then_read(tmp_path):
  """The generate CLI run twice with one --compilation_cache_dir: the first run fills the folder,
  the second compiles nothing new (every computation is found there, so no entry is added)."""
  cache = tmp_path / "cache"
  bindings = [f"--gin_bindings={b}" for b in TINY_RUN_BINDINGS]
  args = ["-m", "k3jax.generate", "--gin_file=gin_configs/tiny.gin", *bindings,
          "--max_new_tokens=1", f"--compilation_cache_dir={cache}"]
  _run(args)
  first = sorted(os.listdir(cache))
  assert first, "the first run wrote no cache entries"
  _run(args)
  assert sorted(os.listdir(cache)) == first


def test_empty_path_disables_the_cache(tmp_path):
  """enable_compilation_cache('') turns the cache off even where JAX's own setting
  (JAX_COMPILATION_CACHE_DIR) would turn it on; a path turns it on with every entry kept."""
  script = textwrap.dedent("""
      import sys, jax, jax.numpy as jnp
      from k3jax.runtime import compiler
      folder = compiler.enable_compilation_cache(sys.argv[1])
      jax.jit(lambda x: jnp.sin(x) * 3)(jnp.arange(4.0)).block_until_ready()
      print(repr(folder))
  """)
  off, on = tmp_path / "off", tmp_path / "on"
  # Without the call, these settings alone make this process write its compile into `off`.
  out = _run(["-c", script, ""], {"JAX_COMPILATION_CACHE_DIR": str(off),
                                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                                  "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"})
  assert out.stdout.strip() == "''"
  assert not off.exists() or not os.listdir(off)
  out = _run(["-c", script, str(on)])
  assert out.stdout.strip() == repr(str(on))
  assert os.listdir(on)  # a sub-second compile is cached too


def test_the_commands_default_cache_folder_follows_jax_compilation_cache_dir(monkeypatch,
                                                                            tmp_path):
  """--compilation_cache_dir defaults to JAX's JAX_COMPILATION_CACHE_DIR where it is set and not
  empty, else to ~/.cache/k3jax/jax_cache; the flag still wins."""
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
  assert compiler.default_compilation_cache_dir() == str(tmp_path / "jax")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "")
  assert compiler.default_compilation_cache_dir() == "~/.cache/k3jax/jax_cache"
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  assert compiler.default_compilation_cache_dir() == "~/.cache/k3jax/jax_cache"
  # A command's flag, defined at its import from the environment of its process.
  script = textwrap.dedent("""
      import sys
      from absl import flags
      from k3jax import train
      train.define_flags()
      flags.FLAGS(["k3jax", "--workdir=unused"] + sys.argv[1:])
      print(flags.FLAGS.compilation_cache_dir)
  """)
  out = _run(["-c", script], {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")})
  assert out.stdout.strip() == str(tmp_path / "env")
  out = _run(["-c", script, f"--compilation_cache_dir={tmp_path / 'flag'}"],
             {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "env")})
  assert out.stdout.strip() == str(tmp_path / "flag")
