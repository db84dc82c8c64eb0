"""map_position_chunks: chunk layout, values and gradients against the unchunked function, and
what the chunked backward holds (no whole-sequence wide intermediate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.ops.chunking import chunk_layout, map_position_chunks


def all_shapes(jaxpr) -> list[tuple]:
  """Shapes of every value a (closed) jaxpr defines, sub-jaxprs (loops, remat, custom VJPs)
  included."""
  out = []

  def walk(jx):
    for eqn in jx.eqns:
      out.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
      for p in eqn.params.values():
        for q in (p if isinstance(p, (tuple, list)) else (p,)):
          if hasattr(q, "jaxpr") and hasattr(q.jaxpr, "eqns"):
            walk(q.jaxpr)
          elif hasattr(q, "eqns"):
            walk(q)

  walk(jaxpr.jaxpr)
  return out


def test_chunk_layout():
  assert chunk_layout(1, 1024, 0) == (1, 1024)
  assert chunk_layout(2, 100, 200) == (1, 100)        # fits one chunk
  assert chunk_layout(1, 100, 32) == (4, 25)          # 4 chunks of 25: no padding
  assert chunk_layout(2, 11, 6) == (4, 3)             # 3 positions x 2 rows, one padded position
  assert chunk_layout(8, 10, 4) == (10, 1)            # at least one position per chunk
  n, c = chunk_layout(1, 1 << 20, 1 << 16)
  assert (n, c) == (16, 1 << 16)
  with pytest.raises(ValueError, match="batch"):
    chunk_layout(0, 10, 4)


def _fn(w):
  def fn(x, valid):
    h = jnp.tanh(x @ w)                                    # [b, c, 32]: the wide intermediate
    y = h @ w.T
    return {"y": y}, jnp.sum(jnp.where(valid[..., None], h, 0.0), axis=(0, 1))
  return fn


def test_values_and_gradients_equal_unchunked():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 11, 4)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(4, 32)), jnp.float32)
  valid = jnp.ones((2, 11), bool).at[1, 8:].set(False)

  def loss(x, w, chunk):
    per, summed = map_position_chunks(_fn(w), [x, valid], chunk)
    return jnp.sum(jnp.sin(per["y"])) + jnp.sum(summed ** 2), (per, summed)

  (l0, (p0, s0)), g0 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w, 0)
  (l1, (p1, s1)), g1 = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w, 6)
  assert p1["y"].shape == (2, 11, 4)
  np.testing.assert_allclose(p1["y"], p0["y"], rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(s1, s0, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  for a, b in zip(g1, g0):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_gradient_holds_no_whole_sequence_intermediate():
  x = jnp.ones((2, 12, 4), jnp.float32)
  w = jnp.ones((4, 32), jnp.float32)
  valid = jnp.ones((2, 12), bool)

  def grad_of(chunk):
    f = lambda x, w: jnp.sum(map_position_chunks(_fn(w), [x, valid], chunk)[0]["y"])  # noqa: E731
    return all_shapes(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w))

  def wide(shapes):   # hidden-width values over more than one chunk's 2 x 3 positions
    return [s for s in shapes if s[-1:] == (32,) and np.prod(s[:-1]) > 2 * 3]

  assert wide(grad_of(0))                      # unchunked: [2, 12, 32] intermediates
  assert not wide(grad_of(6)), wide(grad_of(6))


def test_rejects_mismatched_arrays():
  with pytest.raises(ValueError, match="must start with"):
    map_position_chunks(lambda a, b: (a, ()), [jnp.zeros((2, 5, 3)), jnp.zeros((2, 4))], 2)
