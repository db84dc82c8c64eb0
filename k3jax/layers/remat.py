"""Rematerialisation whose recomputation waits for the cotangent: one layer's backward at a time.

`jax.checkpoint` (`nn.remat`) saves a function's inputs and recomputes its forward pass in the
backward pass, but nothing orders that recomputation: it depends only on the saved inputs, so
XLA's scheduler may run it as soon as the backward pass starts. Inside the decoder's scan body
(four layers per step) XLA's GPU scheduler did exactly that: at 1M tokens the compiled step held
the recomputed forward passes of all four layers of the group at once (188 GiB of temporaries,
RESULTS.md run 11).

`ordered_checkpoint` (a function) and `OrderedRemat` (a Flax module class transform) compute the
same values and gradients as `jax.checkpoint` with no saving policy (the forward's residuals are
the inputs), but their backward rule passes the saved inputs and the output cotangent through one
`lax.optimization_barrier` before recomputing, and all the gradients it returns (the inputs'
and the parameters') through a second one: the recomputation of a layer can start only once the
cotangent of its output exists, and that cotangent only exists once the layer above has computed
all its gradients. Without the second barrier XLA postponed the parameter gradients (and kept
their inputs alive) past the next layers' recomputations. The first barrier also keeps XLA from
merging the recomputation with the forward pass (what `jax.checkpoint`'s prevent_cse does).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.core import lift
from flax.linen import transforms as nn_transforms


def _differentiable(x: Any) -> bool:
  """Whether a leaf gets a cotangent: floating (or complex) arrays; ints, bools and PRNG keys do
  not."""
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _barrier_safe(x: Any) -> bool:
  """Leaves that can go through `optimization_barrier` (arrays of plain dtypes, not keys)."""
  return (hasattr(x, "dtype") and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
          and x.dtype != jax.dtypes.float0)


def _through_barrier(args: Any, cotangent: Any) -> tuple[Any, Any]:
  """(args, cotangent) with every array leaf of both passed through one optimization_barrier."""
  leaves_a, tree_a = jax.tree.flatten(args)
  leaves_g, tree_g = jax.tree.flatten(cotangent)
  leaves = leaves_a + leaves_g
  picked = [i for i, x in enumerate(leaves) if _barrier_safe(x)]
  passed = jax.lax.optimization_barrier([leaves[i] for i in picked])
  for i, x in zip(picked, passed):
    leaves[i] = x
  return (jax.tree.unflatten(tree_a, leaves[:len(leaves_a)]),
          jax.tree.unflatten(tree_g, leaves[len(leaves_a):]))


def ordered_checkpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
  """`fn` with a custom VJP: save the inputs, recompute in the backward pass after the cotangent.

  fn: a function of positional pytree arguments (arrays of any dtype, None) to a pytree of arrays;
    every non-array setting must be closed over (use functools.partial), not passed.
  Returns a function with fn's values; its VJP equals fn's. Arguments that are not floating point
  (ints, bools, PRNG keys) get no cotangent.
  """

  @jax.custom_vjp
  def checkpointed(*args):
    return fn(*args)

  def forward(*args):
    return fn(*args), args

  def backward(args, cotangent):
    args, cotangent = _through_barrier(args, cotangent)
    leaves, tree = jax.tree.flatten(args)
    diff = [i for i, x in enumerate(leaves) if _differentiable(x)]

    def of_differentiable(*diff_leaves):
      full = list(leaves)
      for i, x in zip(diff, diff_leaves):
        full[i] = x
      return fn(*jax.tree.unflatten(tree, full))

    _, vjp = jax.vjp(of_differentiable, *[leaves[i] for i in diff])
    # All of this layer's gradients leave together: the input cotangent (which the layer below
    # waits for) is released only once the parameter gradients exist, so this layer's backward
    # pass is over, and its recomputed activations dead, before the layer below recomputes.
    grads = jax.lax.optimization_barrier(list(vjp(cotangent)))
    out: list = [None] * len(leaves)
    for i, g in zip(diff, grads):
      out[i] = g
    # None is a zero cotangent for custom_vjp; the tree keeps each argument's structure.
    return tuple(jax.tree.unflatten(tree, out))

  checkpointed.defvjp(forward, backward)
  return checkpointed


def _lifted_ordered_checkpoint(fn: Callable[..., Any], variables: Any = True, rngs: Any = True,
                               static_argnums: Sequence[int] = ()) -> Callable[..., Any]:
  """Flax's core-level lift of `ordered_checkpoint` (as `flax.core.lift.checkpoint` lifts
  `jax.checkpoint`): the scope's variables and rngs become arguments of the checkpointed function,
  the mutated collections its outputs. `static_argnums` (positions in *args) are closed over."""
  static = tuple(static_argnums)

  def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
    if kwargs:
      raise TypeError(f"OrderedRemat: keyword arguments are not supported, got {sorted(kwargs)}")
    dynamic = [i for i in range(len(args)) if i not in static]

    def rematted(variable_groups, rng_groups, *dynamic_args):
      full = list(args)
      for i, x in zip(dynamic, dynamic_args):
        full[i] = x
      scope = scope_fn(variable_groups, rng_groups)
      y = fn(scope, *full)
      return y, repack_fn(scope)

    return ordered_checkpoint(rematted)(variable_groups, rng_groups,
                                        *[args[i] for i in dynamic])

  return lift.pack(inner, (variables,), (variables,), (rngs,), name="ordered_remat",
                   enable_kwargs=True)


def OrderedRemat(module_cls: type[nn.Module], static_argnums: Sequence[int] = ()
                 ) -> type[nn.Module]:  # pylint: disable=invalid-name
  """`module_cls` whose __call__ is rematerialised by `ordered_checkpoint` (cf. `nn.remat`).

  static_argnums: positions of __call__'s Python-valued arguments, counting the module itself as
    0 (as `nn.remat` counts them); they are fixed at trace time.
  """
  return nn_transforms.lift_transform(_lifted_ordered_checkpoint, module_cls,
                                      static_argnums=tuple(i - 1 for i in static_argnums))
