"""experiments/benchmarks/hlo_fwd_bwd.py: the arrays a compiled gradient carries from its forward
to its backward, on programs compiled here (XLA:CPU) where the answer is known."""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
import hlo_fwd_bwd  # noqa: E402


def _tanh_scaled(barrier: bool):
  """tanh(2x) · 3 with a custom VJP whose backward recomputes tanh(2x) from x: with barrier=False
  XLA merges the recomputation with the forward's tanh (the same expression of the same x)."""

  @jax.custom_vjp
  def f(x):
    return jnp.tanh(2.0 * x.astype(jnp.float32)) * 3.0

  def fwd(x):
    return f(x), x

  def bwd(x, dy):
    if barrier:
      x = jax.lax.optimization_barrier(x)
    t = jnp.tanh(2.0 * x.astype(jnp.float32))
    return ((dy * 6.0 * (1.0 - t * t)).astype(x.dtype),)

  f.defvjp(fwd, bwd)
  return f


def _compiled_gradient(f):
  x = jnp.linspace(-1.0, 1.0, 64 * 96).reshape(64, 96).astype(jnp.bfloat16)
  w = jnp.ones((96, 8), jnp.bfloat16)

  def loss(x, w):
    return jnp.sum(jnp.square(f(x).astype(jnp.bfloat16) @ w).astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()


def _carried_f32_of_shape(hlo: str, dims: str):
  return [r for r in hlo_fwd_bwd.forward_to_backward(hlo)
          if f"f32[{dims}]" in r["shape"] and "tanh" in r["op_name"] + str(r["shape"])]


def test_a_merged_recomputation_is_carried_and_a_barrier_removes_it():
  merged = _compiled_gradient(_tanh_scaled(barrier=False))
  assert _carried_f32_of_shape(merged, "64,96"), hlo_fwd_bwd.report(merged)
  separate = _compiled_gradient(_tanh_scaled(barrier=True))
  assert not _carried_f32_of_shape(separate, "64,96"), hlo_fwd_bwd.report(separate)
  # The fp32 bytes carried forward to backward fall by at least that [64, 96] array.
  f32 = lambda hlo: sum(r["bytes"].get("f32", 0) for r in hlo_fwd_bwd.forward_to_backward(hlo))
  assert f32(merged) - f32(separate) >= 64 * 96 * 4, (f32(merged), f32(separate))


def test_bytes_by_dtype_of_arrays_and_tuples():
  assert hlo_fwd_bwd.bytes_by_dtype("f32[4,8]{1,0}") == {"f32": 128}
  got = hlo_fwd_bwd.bytes_by_dtype("(bf16[2,3]{1,0}, f32[5]{0}, pred[7]{0}, f32[])")
  assert got == {"bf16": 12, "f32": 24, "pred": 7}
