"""k3jax/layers/remat.py: the same values and gradients as no remat; only the inputs are saved; the
recomputation is tied to the output's cotangent (what jax.checkpoint does not do)."""

import contextlib
import functools
import io

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.extend
import jax.numpy as jnp
import numpy as np

from k3jax.layers.remat import OrderedRemat, ordered_checkpoint


def layer(w, x, ids, mask, scale=2.0):
  """Args of every kind: float weight and input, int ids, bool mask; outputs float and int."""
  h = jnp.tanh(x @ w) * jnp.where(mask, 1.0, 0.5)[:, None]
  return {"y": x + scale * jnp.sin(h) @ w.T, "count": jnp.sum(ids)}, h.mean()


def _inputs():
  kw, kx = jax.random.split(jax.random.PRNGKey(0))
  w = jax.random.normal(kw, (8, 16)) * 0.3
  x = jax.random.normal(kx, (5, 8))
  ids = jnp.arange(5, dtype=jnp.int32)
  mask = ids % 2 == 0
  return w, x, ids, mask


def _loss(fn):
  def loss(w, x, ids, mask):
    out, m = fn(w, x, ids, mask)
    return jnp.sum(out["y"] ** 2) + 3.0 * m + out["count"].astype(jnp.float32)
  return loss


def test_values_and_gradients_equal_the_plain_function():
  args = _inputs()
  ref_val, ref_grads = jax.value_and_grad(_loss(layer), argnums=(0, 1))(*args)
  val, grads = jax.jit(jax.value_and_grad(_loss(ordered_checkpoint(layer)), argnums=(0, 1)))(*args)
  np.testing.assert_allclose(val, ref_val, rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
  # Closed-over settings (functools.partial) are constants of the function.
  half = ordered_checkpoint(functools.partial(layer, scale=0.5))
  np.testing.assert_allclose(jax.grad(_loss(half))(*args),
                             jax.grad(_loss(functools.partial(layer, scale=0.5)))(*args),
                             rtol=1e-5, atol=1e-6)


def _barrier_operands(jaxpr) -> list:
  """Operand lists of every optimization_barrier in `jaxpr` and its sub-jaxprs."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "optimization_barrier":
      found.append(list(eqn.invars))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      found += _barrier_operands(sub)
  return found


def _recompute_waits_for_cotangent(fn) -> bool:
  """Whether the backward pass of fn (a jaxpr of its VJP) sends the output cotangent through an
  optimization barrier together with the saved inputs: the recomputation then depends on it."""
  w, x, ids, mask = _inputs()
  single = lambda w, x: fn(w, x, ids, mask)[0]["y"]
  _, vjp = jax.vjp(single, w, x)
  closed = jax.make_jaxpr(vjp)(jnp.ones((5, 8)))
  cotangent = closed.jaxpr.invars[0]

  def reaches(var, jaxpr) -> bool:  # var used directly or through a pjit/closed call's argument
    for ops in _barrier_operands(jaxpr):
      if var in ops:
        return True
    for eqn in jaxpr.eqns:
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        inner = [v for v, o in zip(sub.invars, eqn.invars) if o is var]
        if any(reaches(v, sub) for v in inner):
          return True
    return False

  return reaches(cotangent, closed.jaxpr)


def test_recomputation_waits_for_the_cotangent():
  assert _recompute_waits_for_cotangent(ordered_checkpoint(layer))
  # jax.checkpoint's barrier (prevent_cse) holds the saved inputs only: its recomputation may be
  # scheduled before the cotangent exists, which is what ordered_checkpoint is for.
  assert not _recompute_waits_for_cotangent(jax.checkpoint(layer))


def _saved_shapes(fn, *args) -> str:
  """jax.ad_checkpoint.print_saved_residuals' listing (one residual per line, e.g. 'f32[5,16]')."""
  text = io.StringIO()
  with contextlib.redirect_stdout(text):
    jax.ad_checkpoint.print_saved_residuals(fn, *args)
  return text.getvalue()


def test_gradients_leave_together():
  # The input's cotangent (what the layer below waits for) and the weight's gradient come out of
  # one barrier: the layer's whole backward pass is done before the layer below recomputes.
  w, x, ids, mask = _inputs()
  single = lambda w, x: ordered_checkpoint(layer)(w, x, ids, mask)[0]["y"]
  _, vjp = jax.vjp(single, w, x)
  jaxpr = jax.make_jaxpr(vjp)(jnp.ones((5, 8))).jaxpr
  barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert any(all(v in e.outvars for v in jaxpr.outvars) for e in barriers)


def test_only_the_inputs_are_saved():
  w, x, ids, mask = _inputs()
  wide = lambda w, x: layer(w, x, ids, mask)[0]["y"]
  assert "[5,16]" not in _saved_shapes(ordered_checkpoint(wide), w, x)  # h is recomputed
  assert "[5,16]" in _saved_shapes(wide, w, x)


class _Block(nn.Module):
  """A module with parameters, a static flag and a mutable collection, as DecoderLayer has."""

  @nn.compact
  def __call__(self, x, ids, double: bool):
    count = self.variable("stats", "count", jnp.zeros, (), jnp.int32)
    count.value = count.value + jnp.sum(ids)
    y = nn.Dense(8)(jnp.tanh(nn.Dense(16)(x)))
    return x + (2.0 if double else 1.0) * y


class _Stack(nn.Module):
  cls: type

  @nn.compact
  def __call__(self, x, ids):
    for i in range(3):
      x = self.cls(name=f"block_{i}")(x, ids, i % 2 == 0)
    return x


def test_flax_module_transform_matches_the_plain_module():
  x = jax.random.normal(jax.random.PRNGKey(1), (4, 8))
  ids = jnp.arange(4, dtype=jnp.int32)
  plain, ordered = _Stack(_Block), _Stack(OrderedRemat(_Block, static_argnums=(3,)))
  variables = plain.init(jax.random.PRNGKey(0), x, ids)
  assert jax.tree.structure(ordered.init(jax.random.PRNGKey(0), x, ids)) == \
      jax.tree.structure(variables)

  def loss(model):
    def f(params):
      y, mutated = model.apply({**variables, "params": params}, x, ids, mutable=["stats"])
      return jnp.sum(y ** 2), mutated
    return jax.value_and_grad(f, has_aux=True)(variables["params"])

  (ref, ref_stats), ref_grads = jax.jit(lambda: loss(plain))()
  (val, stats), grads = jax.jit(lambda: loss(ordered))()
  np.testing.assert_allclose(val, ref, rtol=1e-6)
  assert jax.tree.map(int, stats) == jax.tree.map(int, ref_stats)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(r))))
