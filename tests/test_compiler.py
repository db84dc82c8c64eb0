"""k3jax.compiler: the XLA:CPU work-around, checked on the shape that crashed without it."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from k3jax import compiler

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_options_only_on_cpu():
  opts = compiler.compiler_options()
  if jax.default_backend() == "cpu":
    assert set(opts) <= {"xla_cpu_experimental_ynn_fusion_type"}
  else:
    assert opts == {}


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
      from k3jax.ops import kda
      rng = np.random.default_rng(0)
      B, T, H, D = 8, 32, 2, 32
      q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(3))
      g = -jnp.asarray(rng.random((B, T, H, D)), jnp.float32)
      beta = jnp.asarray(rng.random((B, T, H)), jnp.float32)
      def loss(fn, *args):
        o, _ = fn(*args)
        return jnp.sum(o * o)
      chunk = lambda *a: kda.chunk_kda(*a, chunk_size=32, use_qk_l2norm=True, backend="xla")
      ref = lambda q, k, v, g, b: kda.recurrent_kda(kda.l2_normalize(q), kda.l2_normalize(k),
                                                   v, g, b)
      from k3jax import compiler
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
