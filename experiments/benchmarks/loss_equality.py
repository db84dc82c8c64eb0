r"""Loss equality: the training step's losses on the GPU kernels against the plain XLA path.

small.gin's real training step (`k3jax.training.init_train_state` + `make_train_step`, as
train_bench.py builds it: the config's optimizer, QB and micro-batching; the implementation
settings of the stage whose row length this is, else stage 0's) runs --steps steps from the same
seed on the same batches (packed rows of random tokens, documents of geometric length with mean
--doc_len, from train_bench.random_rows; batch i is seed i) once per path:

  old         the XLA path: `ImplConfig.attention_impl = 'xla'` (the blockwise XLA flash
              attention; the cuDNN dense-mask path that packed rows used before is gone, and
              'cudnn' now refuses segment ids) and `ImplConfig.moe_grouped_matmul = 'tiled'`.
              The reference every other path is compared with.
  new         today's defaults ('auto' for both). On an H200 at 2048 tokens per row: tokamax's
              Mosaic flash attention with its stock backward (`ops/attention.py`: 'auto' picks
              'tokamax' up to AUTO_TOKAMAX_MAX_T tokens per row (16384 then, 4096 since
              run 16), 'tokamax_mosaic_bwd' above) and tokamax's Mosaic grouped matmul.

Both 'auto' choices fall back to XLA on CPU: there 'old' and 'new' compile the same program and
their losses are equal to the bit. The KDA backend is the config's own ('auto') on every path.

One JSON line per event, printed as soon as known:
  start     the paths, the shape, the mean document length of the batches, the device;
  progress  a path's init_s (state initialisation, compile included), trace_lower_s, compile_s;
  path      a path's per-step losses, gradient norms (full precision) and learning rates, its
            bindings, and the attention implementation its MLA layers resolve to here;
  error     a path that failed (first line of the error);
  summary   per path against 'old': the relative loss difference |l - l_old| / |l_old| per step,
            its maximum, the gradient norms' relative differences (first step and maximum), and
            passed (max loss difference <= --tolerance, every value finite); wall_s.
Exit status: 0 when every path passes, 1 when one does not (or failed to run).

GPU (one H200; two cold compiles of small.gin's step, ~100-150 s each):
  PYTHONPATH=. python experiments/benchmarks/loss_equality.py            # old vs new, 4 steps
--smoke: tiny.gin, 2 x 128 tokens (mean document 48 tokens), 2 steps (CPU).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import train_bench  # noqa: E402  (sets the GPU allocator's environment before jax is imported)

_PROCESS_START = time.time()

REFERENCE = "old"
PATH_BINDINGS = {
    "old": ["ImplConfig.attention_impl = 'xla'", "ImplConfig.moe_grouped_matmul = 'tiled'"],
    "new": [],
}
TOLERANCE = 2e-3   # the step's loss within 2e-3 relative of the old path's


def parse_paths(text: str) -> list[str]:
  """'old,new' -> ['old', 'new']: known names, no repeats, the reference 'old' first."""
  names = [n.strip() for n in text.split(",") if n.strip()]
  unknown = [n for n in names if n not in PATH_BINDINGS]
  if unknown or len(set(names)) != len(names) or REFERENCE not in names or len(names) < 2:
    raise ValueError(f"--paths = {text!r}: a comma-separated list of distinct names from "
                     f"{tuple(PATH_BINDINGS)}, with {REFERENCE!r} and at least one other")
  return [REFERENCE] + [n for n in names if n != REFERENCE]


def relative_differences(values: list[float], reference: list[float]) -> list[float]:
  """|v - r| / |r| per step (inf where r == 0 and v != r, nan where either is not finite)."""
  if len(values) != len(reference):
    raise ValueError(f"{len(values)} values against {len(reference)} reference values")
  out = []
  for v, r in zip(values, reference):
    if not (math.isfinite(v) and math.isfinite(r)):
      out.append(math.nan)
    elif v == r:
      out.append(0.0)
    else:
      out.append(abs(v - r) / abs(r) if r != 0 else math.inf)
  return out


def compare(path: dict, reference: dict, tolerance: float) -> dict:
  """The summary entry of one path's `path` row against the reference's."""
  loss_rel = relative_differences(path["losses"], reference["losses"])
  grad_rel = relative_differences(path["grad_norms"], reference["grad_norms"])
  # max() would skip a nan that is not first; a nan anywhere fails the comparison.
  worst = lambda xs: math.nan if any(math.isnan(x) for x in xs) else max(xs)
  max_loss_rel = worst(loss_rel)
  return dict(path=path["path"], loss_rel_diff=loss_rel, max_loss_rel_diff=max_loss_rel,
              grad_norm_rel_diff_first=grad_rel[0], max_grad_norm_rel_diff=worst(grad_rel),
              tolerance=tolerance, passed=bool(max_loss_rel <= tolerance))


def attention_resolution(mcfg, impl, batch: int, seq_len: int) -> str:
  """The implementation the MLA layers' attention (ImplConfig `impl`, model config `mcfg`)
  resolves to here for packed rows (what 'auto' picks on this device at these shapes)."""
  import jax
  import jax.numpy as jnp
  from k3jax.ops import attention as attention_ops
  dtype = jnp.dtype(mcfg.dtype)
  q = jax.ShapeDtypeStruct((batch, seq_len, mcfg.mla_num_heads,
                            mcfg.mla_qk_nope_dim + mcfg.mla_qk_rope_dim), dtype)
  v = jax.ShapeDtypeStruct((batch, seq_len, mcfg.mla_num_heads, mcfg.mla_v_dim), dtype)
  return attention_ops._resolve(impl.attention_impl, q, v, has_segments=True,
                                has_positions=False)


def run_path(name: str, gin_files: list[str], bindings: list[str], host_batches: list[dict],
             seq_len: int) -> dict:
  """Runs the training step of one path over `host_batches` (one a step); returns its `path` row
  (progress lines are emitted). The state and the compiled step are dropped on return."""
  import jax
  import jax.numpy as jnp

  from k3jax import cli
  from k3jax import training as train_lib
  from k3jax.model import K3Model

  cfg = train_bench.config_at_length(cli.config_from_flags(gin_files, bindings), seq_len)
  mcfg = cfg.model
  t0 = time.perf_counter()
  state, optimizer, schedule = train_lib.init_train_state(cfg, cfg.stages.total_steps)
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  step_fn = train_lib.make_train_step(cfg, K3Model(mcfg, cfg.impl), optimizer, schedule)
  batches = [{k: jnp.asarray(v) for k, v in b.items()} for b in host_batches]
  compiled, trace_lower_s, compile_s = train_bench.lower_and_compile(step_fn, state, batches[0])
  train_bench.emit(event="progress", path=name, init_s=round(init_s, 2),
                   trace_lower_s=round(trace_lower_s, 2), compile_s=round(compile_s, 2),
                   since_start_s=round(time.time() - _PROCESS_START, 1))
  losses, grad_norms, lrs = [], [], []
  t0 = time.perf_counter()
  for batch in batches:
    state, m = compiled(state, batch)
    losses.append(float(m["loss"]))
    grad_norms.append(float(m["grad_norm"]))
    lrs.append(float(m["lr"]))
  steps_s = time.perf_counter() - t0
  row = dict(event="path", path=name, bindings=bindings, attention=attention_resolution(
      mcfg, cfg.impl, *host_batches[0]["inputs"].shape),
      moe_grouped_matmul=cfg.impl.moe_grouped_matmul,
      losses=losses, grad_norms=grad_norms, lrs=lrs, init_s=round(init_s, 2),
      trace_lower_s=round(trace_lower_s, 2), compile_s=round(compile_s, 2),
      steps_s=round(steps_s, 2))
  del state, compiled, step_fn, batches, m
  gc.collect()
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny.gin, 2 x 128 tokens, 2 steps (CPU)")
  p.add_argument("--gin_file", action="append", default=None,
                 help="the config (default gin_configs/small.gin)")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="applied to every path, e.g. \"ImplConfig.remat = 'full'\"")
  p.add_argument("--candidate_bindings", action="append", default=[],
                 help="applied to every path but 'old' (after --gin_bindings): a deliberate "
                      "difference, e.g. \"Config.seed = 1\", must be reported as unequal")
  p.add_argument("--paths", default="old,new",
                 help=f"comma-separated, from {tuple(PATH_BINDINGS)}; 'old' is the reference")
  p.add_argument("--batch", type=int, default=16, help="rows per step")
  p.add_argument("--seq_len", type=int, default=2048, help="tokens per row")
  p.add_argument("--doc_len", type=int, default=2048, help="mean document length of the rows")
  p.add_argument("--steps", type=int, default=4, help="training steps per path")
  p.add_argument("--tolerance", type=float, default=TOLERANCE,
                 help="largest relative loss difference that passes")
  p.add_argument("--cache_dir", default="",
                 help="JAX's persistent compilation cache folder (default: off, cold compiles)")
  args = p.parse_args(argv)
  if args.smoke:
    args.gin_file = args.gin_file or ["gin_configs/tiny.gin"]
    args.batch, args.seq_len, args.steps = 2, 128, 2
    args.doc_len = min(args.doc_len, 48)  # several documents in a 128-token row
  gin_files = args.gin_file or ["gin_configs/small.gin"]
  paths = parse_paths(args.paths)
  for name, value in (("--batch", args.batch), ("--seq_len", args.seq_len),
                      ("--steps", args.steps)):
    if value < 1:
      raise ValueError(f"{name} = {value} must be a positive integer")
  if not args.tolerance > 0:
    raise ValueError(f"--tolerance = {args.tolerance} must be a positive float")

  from k3jax.runtime import compiler
  compiler.enable_compilation_cache(args.cache_dir)
  import jax

  from k3jax import cli
  base = cli.config_from_flags(gin_files, args.gin_bindings).model
  # The same batches for every path: batch i of the run is random_rows' seed i.
  host = [train_bench.random_rows(args.batch, args.seq_len, "packed", base.vocab_size,
                                  base.vocab_size - 1, args.doc_len, seed=i)
          for i in range(args.steps)]
  docs = sum(int(b["segment_ids"].max(axis=1).sum()) for b in host)
  train_bench.emit(event="start", paths=paths, gin_files=gin_files, bindings=args.gin_bindings,
                   candidate_bindings=args.candidate_bindings, batch=args.batch,
                   seq_len=args.seq_len, steps=args.steps,
                   mean_doc_len=round(args.batch * args.seq_len * args.steps / docs, 1),
                   backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))
  rows = {}
  for name in paths:
    bindings = list(args.gin_bindings) + PATH_BINDINGS[name]
    if name != REFERENCE:
      bindings += args.candidate_bindings
    try:
      rows[name] = run_path(name, gin_files, bindings, host, args.seq_len)
    except Exception as e:  # an OOM or a kernel that cannot run here: the other paths go on
      train_bench.emit(event="error", path=name, error=train_bench.first_line(e))
      continue
    train_bench.emit(**rows[name])
  summary = []
  for name in paths[1:]:
    if REFERENCE in rows and name in rows:
      summary.append(compare(rows[name], rows[REFERENCE], args.tolerance))
    else:
      missing = REFERENCE if REFERENCE not in rows else name
      summary.append(dict(path=name, passed=False, error=f"path {missing!r} did not run"))
  train_bench.emit(event="summary", reference=REFERENCE, comparisons=summary,
                   passed=all(c["passed"] for c in summary),
                   wall_s=round(time.time() - _PROCESS_START, 1))
  return 0 if all(c["passed"] for c in summary) else 1


if __name__ == "__main__":
  sys.exit(main())
