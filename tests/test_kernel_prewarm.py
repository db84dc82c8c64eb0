"""kernel_prewarm on the CPU: Mosaic GPU kernels need a GPU, so the tests take the CPU's LAPACK
custom calls (`jax.scipy.linalg.lu`) as the kernels to find, cut out and compile alone."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from k3jax.runtime import kernel_prewarm


def _lu_program():
  def f(a, b, c):
    # a and b: the same call twice (one kernel); c: another shape (a second kernel).
    return (jax.scipy.linalg.lu(a)[1].sum() + jax.scipy.linalg.lu(b)[1].sum()
            + jax.scipy.linalg.lu(c)[2].sum())
  args = (jnp.ones((4, 4)), jnp.ones((4, 4)), jnp.ones((5, 5)))
  return jax.jit(f).lower(*args)


def _lapack_targets(lowered):
  targets = set(re.findall(r"stablehlo\.custom_call @(lapack_\w+)", lowered.as_text()))
  assert targets, "the LU program holds no LAPACK custom call"
  return tuple(sorted(targets))


def test_kernel_calls_one_per_distinct_call():
  lowered = _lu_program()
  targets = _lapack_targets(lowered)
  calls = kernel_prewarm.kernel_calls(lowered.compiler_ir("stablehlo"), targets)
  assert sorted(str(op.operands[0].type) for op in calls) == ["tensor<4x4xf32>",
                                                              "tensor<5x5xf32>"]
  assert kernel_prewarm.kernel_calls(lowered.compiler_ir("stablehlo"), ("no_such_target",)) == []


def test_kernel_calls_tells_typed_ffi_calls_apart_by_their_attributes():
  """Calls of one typed-FFI target with equal types are different kernels when their attributes
  differ (Mosaic GPU's kernel_hash sits in `mhlo.backend_config`, `backend_config` is empty)."""
  def call(x, kernel_hash):
    return jax.ffi.ffi_call("k3jax_test_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(
        x, kernel_hash=kernel_hash)
  lowered = jax.jit(lambda x: call(x, "a") + call(x, "b") + call(x, "a")).lower(jnp.ones((3,)))
  calls = kernel_prewarm.kernel_calls(lowered.compiler_ir("stablehlo"), ("k3jax_test_kernel",))
  assert len(calls) == 2


def test_single_call_program_computes_the_call():
  """The cut-out call, compiled and run alone, gives what the call gives inside its program
  (LAPACK's packed LU factors: the program's L below the diagonal)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((5, 5)).astype(np.float32)
  lowered = jax.jit(lambda a: jax.scipy.linalg.lu(a)).lower(x)
  (call,) = kernel_prewarm.kernel_calls(lowered.compiler_ir("stablehlo"), _lapack_targets(lowered))
  text = kernel_prewarm.single_call_module(call)
  assert "func.func public @main" in text
  exe = kernel_prewarm.compile_single_call(text, jax.devices()[0])
  packed, pivots = [np.asarray(o) for o in exe.execute([jax.device_put(x)])][:2]
  _, lower, upper = jax.scipy.linalg.lu(x)
  np.testing.assert_allclose(np.tril(packed, -1) + np.eye(5), lower, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.triu(packed), upper, rtol=1e-6, atol=1e-6)
  # getrf's pivots are 1-based row swaps: applied to x they give the permutation P^T x = L U.
  rows = list(range(5))
  for i, p in enumerate(pivots):
    rows[i], rows[p - 1] = rows[p - 1], rows[i]
  np.testing.assert_allclose(x[rows], np.asarray(lower @ upper), rtol=1e-5, atol=1e-5)


def test_prewarm_kernels_compiles_each_distinct_call_once():
  """Once per kernel across programs and calls: what `compiled` records is skipped (jaxlib's
  cache holds it already)."""
  lowered = _lu_program()
  compiled = kernel_prewarm.CompiledKernels()
  report = kernel_prewarm.prewarm_kernels([lowered, lowered], jax.devices()[0],
                                          _lapack_targets(lowered), compiled)
  assert (report["kernels"], report["known"], report["errors"]) == (2, 0, [])
  again = kernel_prewarm.prewarm_kernels([lowered], jax.devices()[0], _lapack_targets(lowered),
                                         compiled)
  assert (again["kernels"], again["known"], again["errors"]) == (0, 2, [])


def test_call_inside_shard_map_compiles_alone():
  """A kernel inside `shard_map` (as the GPU kernels run on a mesh, `map_over_batch_shards`)
  takes per-device shapes; cut out of the mesh's program, it compiles for one device."""
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
  spec = jax.sharding.PartitionSpec("data")
  f = jax.shard_map(lambda a: jax.scipy.linalg.lu(a[0])[1][None], mesh=mesh, in_specs=spec,
                    out_specs=spec)
  x = jax.device_put(jnp.ones((4, 3, 3)), jax.sharding.NamedSharding(mesh, spec))
  lowered = jax.jit(f).lower(x)
  (call,) = kernel_prewarm.kernel_calls(lowered.compiler_ir("stablehlo"), _lapack_targets(lowered))
  assert str(call.operands[0].type) == "tensor<3x3xf32>"
  report = kernel_prewarm.prewarm_kernels([lowered], jax.devices()[0], _lapack_targets(lowered),
                                          kernel_prewarm.CompiledKernels())
  assert (report["kernels"], report["errors"]) == (1, [])


def test_prewarm_kernels_reports_a_call_that_does_not_compile():
  """A custom call that XLA cannot compile (no implementation registered) is reported, not
  raised: XLA compiles the real program's kernels itself then, and fails there as it would."""
  def f(x):
    return jax.ffi.ffi_call("k3jax_test_unregistered_kernel",
                            jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  lowered = jax.jit(f).lower(jnp.ones((3,)))
  compiled = kernel_prewarm.CompiledKernels()
  report = kernel_prewarm.prewarm_kernels([lowered], jax.devices()[0],
                                          ("k3jax_test_unregistered_kernel",), compiled)
  assert report["kernels"] == 0
  assert kernel_prewarm.kernel_key(kernel_prewarm.kernel_calls(
      lowered.compiler_ir("stablehlo"), ("k3jax_test_unregistered_kernel",))[0]) not in compiled
  assert len(report["errors"]) == 1 and report["errors"][0]


def test_beside_prewarms_on_a_thread_during_the_block_on_a_gpu(monkeypatch):
  """`beside` runs `prewarm_kernels` on the given programs on another thread while its block runs
  (on a GPU backend, patched in here), and returns only once that thread is done; on the CPU it
  starts nothing."""
  import threading
  calls, release = [], threading.Event()

  def fake_prewarm(lowered, device):
    calls.append((list(lowered), device, threading.current_thread().name))
    release.wait(5)

  monkeypatch.setattr(kernel_prewarm, "prewarm_kernels", fake_prewarm)
  lowered = _lu_program()
  with kernel_prewarm.beside([lowered]):
    pass
  assert calls == []                       # the CPU backend
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with kernel_prewarm.beside([lowered]):
    for _ in range(500):
      if calls:
        break
      threading.Event().wait(0.01)
    assert len(calls) == 1 and calls[0][0] == [lowered]
    assert calls[0][2] != threading.current_thread().name
    release.set()
  assert not any(t.name == "k3jax-kernel-prewarm" for t in threading.enumerate())


if __name__ == "__main__":
  pytest.main([__file__, "-v"])
