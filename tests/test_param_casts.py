"""k3jax.runtime.param_casts: which parameters a function reads only as a narrower copy, on
hand-made jaxprs, and that feeding the copies gives the same value and (widened) gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.runtime import param_casts

BF16 = jnp.dtype(jnp.bfloat16)


@jax.custom_vjp
def _custom(w):
  return w.astype(jnp.bfloat16)


_custom.defvjp(lambda w: (_custom(w), w), lambda w, g: (g.astype(jnp.float32) * w,))


def _loss(p, x):
  terms = [
      jnp.dot(x, p["single"].astype(jnp.bfloat16)).sum(),                       # cast once
      jnp.dot(x.astype(jnp.float32), p["fp32"]).sum(),                           # read in fp32
      jax.jit(lambda w: w.astype(jnp.bfloat16))(p["nested"].reshape(4, 4).T).sum(),
      p["twice"].astype(jnp.bfloat16).sum() + p["twice"].astype(jnp.bfloat16).max(),
      jax.checkpoint(lambda w: (w.astype(jnp.bfloat16) ** 2).sum())(p["remat"]),
      _custom(p["custom"]).sum(),                                                # custom VJP
      jnp.broadcast_to(p["row"], (3, 4)).astype(jnp.bfloat16).sum(),             # fans out
      (p["widen"].astype(jnp.float32) * 2).sum(),                                # not narrower
      jax.lax.scan(lambda c, w: (c + (w.astype(jnp.bfloat16) * p["const"].astype(jnp.bfloat16)
                                     ).sum(), None),
                   jnp.zeros((), jnp.bfloat16), p["stacked"])[0],                # scanned over
  ]
  return sum(t.astype(jnp.float32) for t in terms)


def _params():
  rng = np.random.default_rng(0)
  shapes = {"single": (4, 4), "fp32": (4, 4), "nested": (16,), "twice": (4,), "remat": (4, 4),
            "custom": (4,), "row": (4,), "stacked": (3, 4), "const": (4,)}
  p = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
  p["widen"] = jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)
  return p


def test_single_cast_dtypes_finds_exactly_the_single_narrowing_casts():
  p, x = _params(), jnp.ones((2, 4), jnp.bfloat16)
  dtypes, out_shape = param_casts.single_cast_dtypes(_loss, p, x)
  got = dict(zip(jax.tree.structure(p).node_data()[1], dtypes))
  assert got == {"single": BF16, "fp32": None, "nested": BF16, "twice": None, "remat": BF16,
                 "custom": None, "row": None, "widen": None, "stacked": BF16, "const": None}
  assert out_shape.shape == () and out_shape.dtype == jnp.float32


def test_copies_give_the_same_value_and_gradient():
  p, x = _params(), jnp.asarray(np.random.default_rng(1).normal(size=(2, 4)), jnp.bfloat16)
  dtypes, _ = param_casts.single_cast_dtypes(_loss, p, x)
  copies = param_casts.narrow_copies(p, dtypes)
  assert {k for k in p if copies[k] is not None} == {"single", "nested", "remat", "stacked"}
  value, grads = jax.value_and_grad(_loss)(p, x)
  value2, grads2 = jax.value_and_grad(_loss)(param_casts.with_copies(p, copies), x)
  assert float(value) == float(value2)
  for name in p:
    g, g2 = grads[name], grads2[name]
    assert g2.dtype == (BF16 if copies[name] is not None else g.dtype)
    np.testing.assert_array_equal(np.asarray(g2.astype(g.dtype)), np.asarray(g))
