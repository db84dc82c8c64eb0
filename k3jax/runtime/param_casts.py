"""Which parameters a loss reads only as a narrower copy, so a step of many micro-batches casts them
once (`k3jax.runtime.host_loop.HostLoopStep`) instead of once per micro-batch.

A bf16 model keeps fp32 parameters and casts most of them to bf16 where it uses them; with the
micro-batches as a host loop of programs, every micro-batch's program cast all of them again
(medium.gin: 1.6 G parameters, 6.5 GB read and 3.2 GB written per 32K-token micro-batch on an
H200). `single_cast_dtypes` finds, from the loss's jaxpr, the leaves whose one use is a conversion
to a narrower float dtype (through layout-only ops and nested jits). Feeding such a leaf already
converted gives the same forward values, and the same gradient: the conversion's transpose only
widened the narrow cotangent, which the accumulation now widens instead. Inside a `lax.scan` only
the scanned-over inputs are followed (a scanned decoder's stacked weights). A leaf with any other use
(an fp32 router weight, a norm scale, a weight read inside a custom VJP, two separate casts whose
cotangents autodiff adds in fp32) is left as it is. Bit for bit on the CPU; on a GPU, XLA may fuse
a convert into its consumer and keep the fp32 value there (it allows excess precision), where the
copy is rounded to bf16: at most one bf16 rounding of that weight apart.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any
# Ops that move elements without changing them (a conversion commutes with them exactly, and so
# does the transpose: a reshape, a transpose or a sharding annotation of the cotangent).
_LAYOUT_OPS = frozenset({"reshape", "transpose", "squeeze", "sharding_constraint", "copy",
                         "copy_p"})
# Calls whose body autodiff differentiates as written (no custom rule): followed inside.
_CALL_JAXPR_PARAM = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                     "core_call": "call_jaxpr", "remat2": "jaxpr", "checkpoint": "jaxpr"}


def _only_cast(jaxpr, var) -> Optional[np.dtype]:
  """The narrower float dtype that `var` of `jaxpr` is converted to, when that conversion is its
  single use (reached through layout ops and calls); None otherwise."""
  if any(v is var for v in jaxpr.outvars):
    return None
  uses = [(eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.invars) if v is var]
  if len(uses) != 1:
    return None
  eqn, i = uses[0]
  name = eqn.primitive.name
  if name == "convert_element_type":
    old, new = np.dtype(var.aval.dtype), np.dtype(eqn.params["new_dtype"])
    narrower = (jnp.issubdtype(old, jnp.floating) and jnp.issubdtype(new, jnp.floating)
                and new.itemsize < old.itemsize)
    return new if narrower else None
  if name in _LAYOUT_OPS and len(eqn.outvars) == 1:
    return _only_cast(jaxpr, eqn.outvars[0])
  if name == "broadcast_in_dim" and eqn.outvars[0].aval.size == var.aval.size:
    return _only_cast(jaxpr, eqn.outvars[0])    # adds unit axes only
  if name in _CALL_JAXPR_PARAM or name == "scan":
    inner = eqn.params[_CALL_JAXPR_PARAM.get(name, "jaxpr")]
    inner = getattr(inner, "jaxpr", inner)       # ClosedJaxpr or Jaxpr
    if len(inner.invars) != len(eqn.invars):
      return None
    if name == "scan" and inner.invars[i].aval.shape == var.aval.shape:
      # A constant of the loop body (its cotangent is summed over the iterations, in the narrow
      # dtype once converted outside) or a carry: only the scanned-over inputs are followed
      # (the stacked weights of a scanned decoder; each iteration reads its own slice).
      return None
    return _only_cast(inner, inner.invars[i])
  return None


def single_cast_dtypes(fn: Callable, params: PyTree, *args) -> tuple[list, Any]:
  """(dtypes, out_shape): per leaf of `params` (in `jax.tree.leaves` order), the narrower float
  dtype that `fn(params, *args)` converts it to when that is the leaf's only use, else None; and
  the shapes of fn's outputs (one trace serves both). params and args: arrays or
  ShapeDtypeStructs."""
  leaves, treedef = jax.tree.flatten(params)
  closed, out_shape = jax.make_jaxpr(
      lambda flat, rest: fn(jax.tree.unflatten(treedef, flat), *rest), return_shape=True)(
          leaves, args)
  invars = closed.jaxpr.invars[:len(leaves)]   # the params' leaves come first
  return [_only_cast(closed.jaxpr, v) for v in invars], out_shape


def narrow_copies(params: PyTree, dtypes: list) -> PyTree:
  """params with each leaf whose dtype (`single_cast_dtypes`' order) is not None converted to it,
  and None in place of the others."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [None if d is None else leaf.astype(d)
                                      for leaf, d in zip(leaves, dtypes)])


def with_copies(params: PyTree, copies: PyTree) -> PyTree:
  """params with the leaves `narrow_copies` converted replaced by the copies."""
  return jax.tree.map(lambda p, c: p if c is None else c, params, copies)
