"""A training step run as a host loop of jitted programs (RuntimeConfig.microbatch_loop = 'host').

A step of n micro-batches runs as n + 2 program calls: `train_step_prepare` (slices the
micro-batches, their weights and zero accumulators, and casts once the parameters that the loss
reads only as a narrower copy, `k3jax.runtime.param_casts`), n calls of `train_step_microbatch`
(one micro-batch's forward and backward pass added to the accumulators, which it donates), then
`train_step_update` (optimizer update, QK-Clip, balance state, metrics; it donates the state). A
step of one micro-batch runs as two programs, `train_step_grads` (the loss and its gradients) and
`train_step_update`, compiled at once.

Why programs and not one `lax.scan` over the micro-batches: the decoder's `nn.scan` then sits at
the top level of a program, where XLA turns the zero initialisations of its stacked saved
activations and parameter gradients into fills; inside a scan's body it copied them once per
micro-batch. And XLA's compile time grows faster than a program's size, so the programs, compiled
at once on separate threads, start faster than one step (docs/startup.md).

The arithmetic is the training step's own (`k3jax.training.accumulate`), passed in as
`accumulate`, so the host loop gives the 'scan' loop's results up to the rounding of XLA's fusions.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from typing import Any, Callable

import flax.linen as nn
import jax

from k3jax.parallel import sharding as sharding_lib
from k3jax.runtime import kernel_prewarm
from k3jax.runtime import lowered_cache
from k3jax.runtime import param_casts

PyTree = Any
# loss_fn(params, moe_state, batch, num_micro=n) -> (total, (ce, aux, mutated collections)), for
# `batch` one of the n equal micro-batches of a step.
LossFn = Callable[..., tuple]


# apply_update(state, total, ce, aux, mutated, grads) -> (state, metrics): everything a training
# step does once it has the step's loss and gradients (`k3jax.training.step.make_train_step`).
ApplyUpdate = Callable[..., tuple]


def _abstract(out_info: PyTree, device=None) -> PyTree:
  """A Lowered's out_info -> ShapeDtypeStructs with plain shardings (to lower the next program).

  device: the single-device sharding of the program's inputs, or None. An output that out_info
  leaves unplaced gets it: at run time it is an array committed there, and XLA's compile cache
  keys a program by its arguments' placement (without it, a program lowered here was compiled
  again when the loop called it with the real outputs)."""
  def one(o):
    sharding = o.sharding
    sharding = getattr(sharding, "sharding", sharding)   # a Format wraps the sharding
    if sharding is None:
      sharding = device
    return jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=sharding)
  return jax.tree.map(one, out_info, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def _later_in_this_context(lower: Callable[[], Any]) -> Callable[[], Any]:
  """`lower` to be called later, from any thread, inside the mesh and logical axis rules in force
  here and now (`sharding.with_mesh`'s): both are per thread, and a program traced without them
  is another program (on a mesh, compiled again where the loop calls it)."""
  mesh, rules = jax.sharding.get_mesh(), nn.get_logical_axis_rules()

  def call():
    with contextlib.nullcontext() if mesh.empty else sharding_lib.with_mesh(mesh, rules):
      return lower()

  return call


def _replicated(state_shardings) -> Any:
  """A sharding replicated over the mesh of `state_shardings` (a tree of NamedShardings), or None
  when there is none (one device: the programs take no shardings)."""
  for sharding in jax.tree.leaves(state_shardings):
    if isinstance(sharding, jax.sharding.NamedSharding):
      return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
  return None


def _update_args(state, acc: dict, moe_state: PyTree) -> tuple:
  """The update program's arguments (`HostLoopStep._update_for`). The old balance state goes
  apart from the donated rest: the last micro-batch's balance state may be the very same arrays
  (a model that writes none passes its input through)."""
  return state.replace(moe_state=None), state.moe_state, acc, moe_state


def _run(prepare: Callable, microbatch: Callable, update: Callable, state, batch: dict):
  """The host loop: prepare, one program call per micro-batch, the update."""
  micro_batches, weights, acc, copies = prepare(state.params, state.moe_state, batch)
  moe_state = state.moe_state
  for micro_batch, weight in zip(micro_batches, weights):
    acc, moe_state = microbatch(state.params, copies, moe_state, micro_batch, weight, acc)
  return update(*_update_args(state, acc, moe_state))


def _run_split(grads: Callable, update: Callable, state, batch: dict):
  """A step of one micro-batch: the gradients' program, then the update's."""
  acc, moe_state = grads(state.params, state.moe_state, batch)
  return update(*_update_args(state, acc, moe_state))


class HostLoopStep:
  """The training step `(state, batch) -> (state, metrics)` with micro-batches run as a host loop
  of jitted programs (module docstring); a batch of one micro-batch runs as two programs, the
  loss's gradients and the update (`train_step_grads`, `train_step_update`).

  loss_fn: (params, moe_state, micro-batch, num_micro=n) -> (total, (ce, aux, mutated)).
  apply_update: `ApplyUpdate`.
  accumulate: the accumulation arithmetic, `k3jax.training.accumulate` (its split,
    token_weights, zero_accumulators, add_microbatch, finish and one_microbatch).
  microbatch_rows: (seq_len, batch rows) -> rows per micro-batch (`StagesConfig.microbatch_rows`).
  state_shardings / batch_shardings / cache_dir / description / context_modules: as for
    `make_train_step` and `lowered_cache.cached_jit` (the programs' names and the micro-batch
    count are added to the description).
  cast_once: `train_step_prepare` casts the parameters that `loss_fn` reads only as a narrower
    copy (`param_casts.single_cast_dtypes`: a bf16 model's fp32 matmul weights), once a step;
    the micro-batch program reads the copies. The same values and gradients as casting in every
    micro-batch (False; bit for bit in the CPU tests, `param_casts` says where a GPU may differ);
    it holds the copies for the step (2 bytes a bf16 weight).

  `lower(state, batch).compile()` gives a callable with the same contract whose `programs` maps
  each program's name to its `jax.stages.Compiled` (memory analysis per program).
  """

  def __init__(self, loss_fn: LossFn, apply_update: ApplyUpdate, accumulate: Any,
               microbatch_rows: Callable[[int, int], int], *, state_shardings: Any,
               batch_shardings: Any, cache_dir: str, description: str, cast_once: bool = True,
               context_modules: tuple = lowered_cache.CONTEXT_REGISTERING_MODULES):
    self._loss_fn = loss_fn
    self._acc = accumulate
    self._apply_update = apply_update
    self._microbatch_rows = microbatch_rows
    self._state_sh = state_shardings
    self._batch_sh = batch_shardings
    self._sharded = state_shardings is not None or batch_shardings is not None
    self._cache_dir = cache_dir
    self._description = description
    self._context_modules = context_modules
    self._cast_once = cast_once
    self._programs: dict = {}
    self._grads_program: Any = None
    self._update_programs: dict = {}
    self._microbatch_programs: dict = {}
    self._loss_info: dict = {}
    st = state_shardings
    self._params_sh = None if st is None else st.params
    self._moe_sh = None if st is None else st.moe_state
    # The weights and the small accumulators (scalar sums, MoE load statistics, QK-Clip maxima)
    # are replicated over the mesh, named in the programs' shardings: left unspecified, the
    # micro-batch program lowered ahead of time from prepare's abstract outputs (`lower`,
    # RuntimeConfig.precompile) read them with other shardings than the arrays prepare returns
    # at run time, so on a mesh the loop compiled that program again.
    self._rep = _replicated(st)
    rep = self._rep
    self._acc_sh = {"grads": self._params_sh, "total": rep, "ce": rep, "aux": rep,
                    "stats": rep, "balance": rep, "qk": rep}

  def _jit(self, fun, donate, in_sh, out_sh, extra):
    kwargs = dict(in_shardings=in_sh, out_shardings=out_sh) if self._sharded else {}
    return lowered_cache.cached_jit(fun, cache_dir=self._cache_dir, donate_argnums=donate,
                                    description=f"{self._description}{extra}",
                                    context_modules=self._context_modules, **kwargs)

  def _num_micro(self, batch: dict) -> int:
    rows, seq_len = batch["inputs"].shape
    return rows // self._microbatch_rows(seq_len, rows)

  def _info(self, params, moe_state, batch: dict, num_micro: int) -> tuple[tuple, PyTree]:
    """(the cast dtypes per params leaf, or all None without cast_once; the mutated collections'
    shapes) of `loss_fn` on one micro-batch of `batch`: one abstract trace per signature (a step
    with a signature seen before only builds the key)."""
    def signature(tree):
      return jax.tree.structure(tree), tuple((x.shape, x.dtype) for x in jax.tree.leaves(tree))

    key = (num_micro, signature(params), signature(moe_state), signature(batch))
    if key not in self._loss_info:
      abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
      micro_batch = jax.eval_shape(lambda b: jax.tree.map(lambda x: x[0], self._acc.split(b, num_micro)),
                                   abstract(batch))
      args = (abstract(params), abstract(moe_state), micro_batch)
      dtypes, out_shape = param_casts.single_cast_dtypes(self._loss_for(num_micro), *args)
      if not self._cast_once:
        dtypes = [None] * len(dtypes)
      self._loss_info[key] = (tuple(dtypes), out_shape[1][2])
    return self._loss_info[key]

  def _loss_for(self, num_micro: int) -> Callable:
    """`loss_fn` for the micro-batches of steps of `num_micro` of them."""
    return functools.partial(self._loss_fn, num_micro=num_micro)

  def _copies_sh(self, dtypes: tuple):
    if self._params_sh is None:
      return None
    leaves, treedef = jax.tree.flatten(self._params_sh)
    return jax.tree.unflatten(treedef, [s if d is not None else None
                                        for s, d in zip(leaves, dtypes)])

  def _microbatch_for(self, dtypes: tuple, num_micro: int) -> Callable:
    """The micro-batch program for parameters with these cast copies, in steps of `num_micro`
    micro-batches (built once per pair)."""
    key = (dtypes, num_micro)
    if key not in self._microbatch_programs:
      loss_fn, acc_lib = self._loss_for(num_micro), self._acc

      def train_step_microbatch(params, copies, moe_state, micro_batch, weight, acc):
        return acc_lib.add_microbatch(loss_fn, param_casts.with_copies(params, copies),
                                      moe_state, micro_batch, weight, acc)

      rep = self._rep
      self._microbatch_programs[key] = self._jit(
          train_step_microbatch, donate=(5,),
          in_sh=(self._params_sh, self._copies_sh(dtypes), self._moe_sh, self._batch_sh, rep,
                 self._acc_sh),
          out_sh=(self._acc_sh, self._moe_sh), extra="")
    return self._microbatch_programs[key]

  def _programs_for(self, num_micro: int, info: tuple) -> tuple[Callable, Callable, Callable]:
    """(prepare, micro-batch, update) for steps of `num_micro` micro-batches and `_info`'s
    result (built once per pair)."""
    dtypes, mutated_shape = info
    key = (num_micro, dtypes)
    if key not in self._programs:
      loss_fn, acc_lib = self._loss_for(num_micro), self._acc

      def train_step_prepare(params, moe_state, batch):
        micro = acc_lib.split(batch, num_micro)
        weights = acc_lib.token_weights(micro)
        micro_batches = tuple(jax.tree.map(lambda x: x[i], micro) for i in range(num_micro))
        acc = acc_lib.zero_accumulators(loss_fn, params, moe_state, micro_batches[0],
                                        mutated_shape)
        return (micro_batches, tuple(weights[i] for i in range(num_micro)), acc,
                param_casts.narrow_copies(params, list(dtypes)))

      extra = f" microbatch_loop='host' num_micro={num_micro}"
      prepare = self._jit(
          train_step_prepare, donate=(), extra=extra,
          in_sh=(self._params_sh, self._moe_sh, self._batch_sh),
          out_sh=((self._batch_sh,) * num_micro, (self._rep,) * num_micro, self._acc_sh,
                  self._copies_sh(dtypes)))
      self._programs[key] = (prepare, self._microbatch_for(dtypes, num_micro),
                             self._update_for(num_micro))
    return self._programs[key]

  def _update_for(self, num_micro: int) -> Callable:
    """The update program for steps of `num_micro` micro-batches: `finish`, then `apply_update`
    (built once per count)."""
    if num_micro not in self._update_programs:
      apply_update, acc_lib = self._apply_update, self._acc

      def train_step_update(state, old_moe_state, acc, moe_state):
        (total, (ce, aux, mutated)), grads = acc_lib.finish(acc, moe_state, num_micro)
        return apply_update(state.replace(moe_state=old_moe_state), total, ce, aux, mutated,
                            grads)

      st = self._state_sh
      self._update_programs[num_micro] = self._jit(
          train_step_update, donate=(0,), extra=f" microbatch_loop='host' num_micro={num_micro}",
          in_sh=(None if st is None else st.replace(moe_state=None), self._moe_sh, self._acc_sh,
                 self._moe_sh),
          out_sh=(st, None))
    return self._update_programs[num_micro]

  def _split_for_one(self) -> tuple[Callable, Callable]:
    """(gradients, update) for steps of one micro-batch (built once): the gradients' program
    returns, as the micro-batch program does, the accumulators (`zero_accumulators`' layout,
    here the one micro-batch's own values: no zeros to add to) and the balance state; the update
    is the host loop's for one micro-batch."""
    if self._grads_program is None:
      loss_fn, acc_lib = self._loss_for(1), self._acc

      def train_step_grads(params, moe_state, batch):
        return acc_lib.one_microbatch(loss_fn, params, moe_state, batch)

      self._grads_program = self._jit(
          train_step_grads, donate=(), extra=" microbatch_loop='host' num_micro=1",
          in_sh=(self._params_sh, self._moe_sh, self._batch_sh),
          out_sh=(self._acc_sh, self._moe_sh))
    return self._grads_program, self._update_for(1)

  def __call__(self, state, batch: dict):
    num_micro = self._num_micro(batch)
    if num_micro == 1:
      return _run_split(*self._split_for_one(), state, batch)
    info = self._info(state.params, state.moe_state, batch, num_micro)
    return _run(*self._programs_for(num_micro, info), state, batch)

  def lower(self, state, batch: dict) -> "HostLoopLowered":
    """The programs lowered for these arguments (arrays or ShapeDtypeStructs). The update's is
    lowered later, by `HostLoopLowered.compile` while the others compile (or at the first read
    of `programs`): compile before `state` is donated."""
    num_micro = self._num_micro(batch)
    first = getattr(jax.tree.leaves(state)[0], "sharding", None)
    device = first if isinstance(first, jax.sharding.SingleDeviceSharding) else None
    if num_micro == 1:
      grads, update = self._split_for_one()
      grads_lowered = grads.lower(state.params, state.moe_state, batch)
      acc, moe_state = _abstract(grads_lowered.out_info, device)
      lowered = {"train_step_grads": grads_lowered}
    else:
      info = self._info(state.params, state.moe_state, batch, num_micro)
      prepare, microbatch, update = self._programs_for(num_micro, info)
      prepare_lowered = prepare.lower(state.params, state.moe_state, batch)
      micro_batches, weights, acc, copies = _abstract(prepare_lowered.out_info, device)
      micro_lowered = microbatch.lower(state.params, copies, state.moe_state, micro_batches[0],
                                       weights[0], acc)
      _, moe_state = _abstract(micro_lowered.out_info, device)
      lowered = {"train_step_prepare": prepare_lowered, "train_step_microbatch": micro_lowered}
    return HostLoopLowered(lowered, {"train_step_update": _later_in_this_context(
        lambda: update.lower(*_update_args(state, acc, moe_state)))})


class HostLoopLowered:
  """The lowered programs of a `HostLoopStep` for one argument signature; `compile()` gives a
  `HostLoopCompiled`.

  lowered: {program name: jax.stages.Lowered}; deferred: {program name: () -> Lowered}, programs
  whose tracing and lowering waits for `compile` (the optimizer update's: small.gin's took 4.3 s
  on a CPU host, time that now passes while the gradients' program compiles).
  programs: {program name: Lowered} of all of them; its first read lowers the deferred ones.
  """

  def __init__(self, lowered: dict, deferred: dict | None = None):
    self._lowered = dict(lowered)
    self._deferred = dict(deferred or {})

  @property
  def programs(self) -> dict:
    while self._deferred:
      name, lower = next(iter(self._deferred.items()))
      self._lowered[name] = lower()
      del self._deferred[name]
    return self._lowered

  def compile(self) -> "HostLoopCompiled":
    """The programs compiled at once, one thread each: XLA's compile releases Python's lock, so
    the optimizer update's and the preparation's compiles hide behind the micro-batch program's
    (tiny.gin's host loop on a 2-core CPU: 17.4 s one after the other, 15.0 s at once; the
    update alone 3.9 s), and so does the deferred programs' lowering, done here after the
    others' compiles have started. An error of any program is raised, as by a plain
    `compile()`.

    On a GPU the programs' Mosaic GPU kernels are also compiled on a thread of their own while
    XLA runs the programs' HLO passes (`kernel_prewarm`): XLA would compile them one after the
    other at the end of the gradients' compile."""
    workers = len(self._lowered) + len(self._deferred)
    # The deferred programs (the optimizer update) hold no Mosaic GPU kernels.
    with (kernel_prewarm.beside(list(self._lowered.values())),
          concurrent.futures.ThreadPoolExecutor(workers,
                                                thread_name_prefix="k3jax-host-loop") as pool):
      futures = {name: pool.submit(lowered.compile) for name, lowered in self._lowered.items()}
      for name, lowered in self.programs.items():
        if name not in futures:
          futures[name] = pool.submit(lowered.compile)
      return HostLoopCompiled({name: future.result() for name, future in futures.items()})


class HostLoopCompiled:
  """`(state, batch) -> (state, metrics)` through the compiled programs of a `HostLoopStep`.
  programs: {'train_step_prepare' | 'train_step_microbatch' | 'train_step_update': Compiled},
  or for a step of one micro-batch {'train_step_grads' | 'train_step_update': Compiled}."""

  def __init__(self, programs: dict):
    self.programs = programs

  def __call__(self, state, batch: dict):
    p = self.programs
    if "train_step_grads" in p:
      return _run_split(p["train_step_grads"], p["train_step_update"], state, batch)
    return _run(p["train_step_prepare"], p["train_step_microbatch"], p["train_step_update"],
                state, batch)
