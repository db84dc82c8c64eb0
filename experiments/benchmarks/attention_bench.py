"""Packed-document softmax attention on one GPU: k3jax's implementations side by side.

MLA's head dims (H 6, q/k 192, v 128), bf16, B 1 (--batch), causal within documents. Variants:
  cudnn_causal        cuDNN, plain causal over the whole row, no mask (the reference speed; not
                      document attention, so no numerics row).
  tokamax             tokamax Mosaic GPU, Mask(k_start=document start, is_causal=True), its stock
                      sm90 backward (its heuristic tiles): `attention_gpu.tokamax_attention`.
  tokamax_mosaic_bwd  tokamax's forward, pallas_kernels.flash_attention's Mosaic GPU backward
                      (skips the blocks outside the documents; wgmma tiles; dq, then dV and dK in
                      two kernels): `attention_gpu.mosaic_backward_attention`; one row per
                      --mosaic-configs entry.
  xla                 k3jax's blockwise XLA path (only up to --xla-max-t tokens).

Timing shapes: T = 8192 with 1 document, and T = 65536 with 8 documents whose lengths are a
uniform random partition of the row (7 distinct cut points drawn uniformly without replacement,
numpy seed 0; printed in the row), no padding. ms per call: median over 5 batches of 20 calls
dispatched back to back and synchronised once, after a warm-up of at least 0.3 s; "fwd" is the
jitted forward, "fwdbwd" the jitted VJP (output and dq, dk, dv).

Numerics (T = 2048 and 8192, packed: documents as above plus a padding tail of T/16 tokens): error
ratio RMS(x - ref) / RMS(ref) (tests/testlib.py `error_ratio`) of the output and dq, dk, dv against
a dense fp32 computation (HIGHEST precision) from the same bf16 inputs; the issue's bound is 0.01.

One JSON line per result; a variant that fails prints {"error": ...} and the run goes on.
Run (one H200): PYTHONPATH=. python experiments/benchmarks/attention_bench.py
--smoke: small shapes on CPU: xla, and tokamax_mosaic_bwd with the Mosaic GPU backward in its
interpreter behind a dense fp32 forward (`dense_forward_lse`; tokamax's forward needs a GPU).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.ops import attention_gpu  # noqa: E402
from k3jax.ops.attention import attention  # noqa: E402
from pallas_kernels.flash_attention import MosaicBwdConfig  # noqa: E402

VARIANTS = ("cudnn_causal", "tokamax", "tokamax_mosaic_bwd", "xla")
# block_q_dq, block_k_dq, block_q_dkv, block_k_dkv, num_stages, compute_wgs[, smem]: the Mosaic GPU
# backward's tiles (`mosaic_config`).
MOSAIC_CONFIGS = ("64,64,64,64,2,2",)

_T0 = time.time()


def emit(**row):
  row["wall_s"] = round(time.time() - _T0, 1)
  print(json.dumps(row), flush=True)


def mosaic_config(spec: str, interpret: bool) -> MosaicBwdConfig:
  """'bq_dq,bk_dq,bq_dkv,bk_dkv,stages,wgs[,smem]' -> MosaicBwdConfig: 'smem' stages P and dS
  through shared memory (always so in the interpreter, which supports nothing else)."""
  fields = spec.split(",")
  names = ("block_q_dq", "block_k_dq", "block_q_dkv", "block_k_dkv", "num_stages", "compute_wgs")
  flags = set(fields[6:])
  if len(fields) < 6 or flags - {"smem"}:
    raise ValueError(f"--mosaic-configs entry {spec!r}: bq_dq,bk_dq,bq_dkv,bk_dkv,stages,wgs "
                     "and optionally ',smem'")
  return MosaicBwdConfig(**dict(zip(names, (int(x) for x in fields[:6]))),
                         register_operands=not (interpret or "smem" in flags),
                         interpret=interpret)


def segments(t: int, n_docs: int, pad: int, seed: int = 0, batch: int = 1) -> np.ndarray:
  """[batch, t] int32: per row n_docs documents (a uniform random partition of t - pad tokens;
  row r drawn with seed + r), then pad zeros."""
  if batch > 1:
    return np.concatenate([segments(t, n_docs, pad, seed + r) for r in range(batch)])
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, t - pad), size=n_docs - 1, replace=False))
  bounds = [0, *cuts.tolist(), t - pad]
  seg = np.zeros((1, t), np.int32)
  for doc, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
    seg[0, lo:hi] = doc
  return seg


def doc_lengths(seg: np.ndarray) -> list[int]:
  ids, counts = np.unique(seg[0][seg[0] != 0], return_counts=True)
  return [int(c) for _, c in sorted(zip(ids, counts))]


def dense_forward_lse(q, k, v, segment_ids, *, scale: float, causal: bool):
  """`attention_gpu.tokamax_forward_lse`'s contract computed densely in fp32 (HIGHEST precision;
  [B, H, T, T] logits: small shapes only), for the Mosaic GPU backward in its interpreter: (out
  [B, T, H, Dv] in q.dtype, lse [B, H, T] fp32, +inf where a query sees nothing). A query sees
  the keys of its run of equal segment ids (padding runs included, as the backward's ranges)."""
  h, hk = q.shape[2], k.shape[2]
  k, v = (jnp.repeat(x.astype(jnp.float32), h // hk, axis=2) for x in (k, v))
  t = q.shape[1]
  mask = segment_ids[:, :, None] == segment_ids[:, None, :]
  if causal:
    mask &= jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
  logits = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k,
                      precision=jax.lax.Precision.HIGHEST) * scale
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - jnp.where(jnp.isneginf(lse), 0.0, lse)[..., None])
  out = jnp.einsum("bhts,bshv->bthv", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out.astype(q.dtype), jnp.where(jnp.isneginf(lse), jnp.inf, lse)


def variant_fns(name: str, seg, scale: float, args) -> list[tuple[str, object]]:
  """[(label, f(q, k, v) -> out)] for one variant (several for the Mosaic configurations)."""
  seg = jnp.asarray(seg)
  if name == "cudnn_causal":
    return [(name, lambda q, k, v: attention_gpu.cudnn_causal_attention(q, k, v, scale=scale,
                                                                          causal=True))]
  if name == "tokamax":
    return [(name, lambda q, k, v: attention_gpu.tokamax_attention(q, k, v, seg, scale=scale,
                                                                     causal=True))]
  if name == "tokamax_mosaic_bwd":
    # --smoke (CPU): the backward in Mosaic GPU's interpreter behind the dense forward.
    forward, suffix = ((dense_forward_lse, "+dense_fwd") if args.smoke
                       else (attention_gpu.tokamax_forward_lse, ""))
    return [(f"{name}[{spec}]{suffix}", functools.partial(
        lambda q, k, v, cfg: attention_gpu.mosaic_backward_attention(
            q, k, v, seg, scale=scale, causal=True, backward=cfg, forward=forward),
        cfg=mosaic_config(spec, interpret=args.smoke)))
        for spec in args.mosaic_configs.split(";")]
  if name == "xla":
    return [(name, lambda q, k, v: attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg,
                                             scale=scale, implementation="xla"))]
  raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")


def inputs(t: int, h: int, d: int, dv: int, seed: int = 0, batch: int = 1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  mk = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
  return (mk(ks[0], (batch, t, h, d)), mk(ks[1], (batch, t, h, d)), mk(ks[2], (batch, t, h, dv)),
          mk(ks[3], (batch, t, h, dv)))


def vjp_fn(f):
  def run(q, k, v, do):
    out, pull = jax.vjp(f, q, k, v)
    return (out, *pull(do))
  return run


def time_ms(fn, args, reps: int = 20, warmup: int = 3, min_warmup_s: float = 0.3,
            batches: int = 5) -> float:
  t0, n = time.perf_counter(), 0
  while n < warmup or time.perf_counter() - t0 < min_warmup_s:
    jax.block_until_ready(fn(*args))
    n += 1
  ts = []
  for _ in range(batches):
    t = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) * 1e3 / reps)
  return statistics.median(ts)


def error_ratio(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
    return float("nan")
  denom = np.sqrt(np.mean(b * b))
  num = np.sqrt(np.mean((a - b) ** 2))
  return float(num / denom) if denom > 0 else float(num)


def dense_reference(q, k, v, seg, *, scale):
  """fp32 dense masked attention (HIGHEST precision), zeros at padding queries."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  t = q.shape[1]
  mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  mask &= jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
  logits = jnp.einsum("bthd,bshd->bhts", q, k, precision=jax.lax.Precision.HIGHEST) * scale
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True)
  p = jnp.exp(logits - jnp.where(jnp.isneginf(m), 0.0, m))
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)
  return jnp.einsum("bhts,bshv->bthv", p, v, precision=jax.lax.Precision.HIGHEST)


def numerics(args, t: int, h: int, d: int, dv: int):
  seg = segments(t, args.numerics_docs, pad=t // 16, seed=1)
  scale = d ** -0.5
  q, k, v, do = inputs(t, h, d, dv, seed=1)
  ref = jax.jit(vjp_fn(functools.partial(dense_reference, seg=jnp.asarray(seg), scale=scale)))
  want = jax.block_until_ready(ref(q, k, v, do.astype(jnp.float32)))
  for name in args.variants.split(","):
    if name == "cudnn_causal":
      continue  # not document attention
    try:
      fns = variant_fns(name, seg, scale, args)
    except Exception as e:  # pylint: disable=broad-except
      emit(kind="numerics", variant=name, T=t, error=f"{type(e).__name__}: {e}")
      continue
    for label, f in fns:
      try:
        got = jax.block_until_ready(jax.jit(vjp_fn(f))(q, k, v, do))
        ratios = {n: error_ratio(g.astype(jnp.float32), w) for n, g, w in
                  zip(("out", "dq", "dk", "dv"), got, want)}
        emit(kind="numerics", variant=label, T=t, docs=doc_lengths(seg), **ratios,
             ok=all(r <= 0.01 for r in ratios.values()))
      except Exception as e:  # pylint: disable=broad-except
        emit(kind="numerics", variant=label, T=t, error=f"{type(e).__name__}: {e}"[:2000],
             trace=traceback.format_exc()[-1500:])


def timings(args, t: int, n_docs: int, h: int, d: int, dv: int):
  seg = segments(t, n_docs, pad=0, seed=0, batch=args.batch)
  scale = d ** -0.5
  q, k, v, do = inputs(t, h, d, dv, batch=args.batch)
  for name in args.variants.split(","):
    if name == "xla" and t > args.xla_max_t:
      continue
    try:
      fns = variant_fns(name, seg, scale, args)
    except Exception as e:  # pylint: disable=broad-except
      emit(kind="time", variant=name, T=t, error=f"{type(e).__name__}: {e}")
      continue
    for label, f in fns:
      for mode in args.modes.split(","):
        try:
          # --smoke: one timed call after one warm-up (the interpreter takes seconds a call).
          timing = (dict(reps=1, warmup=1, min_warmup_s=0.0, batches=1) if args.smoke
                    else dict(reps=args.reps))
          if mode == "fwd":
            ms = time_ms(jax.jit(f), (q, k, v), **timing)
          else:
            ms = time_ms(jax.jit(vjp_fn(f)), (q, k, v, do), **timing)
          emit(kind="time", variant=label, mode=mode, B=args.batch, T=t, H=h, D=d, Dv=dv,
               docs=doc_lengths(seg[:1]),
               ms=round(ms, 4))
          if args.kernel_times:
            fn, fargs = (jax.jit(f), (q, k, v)) if mode == "fwd" else (jax.jit(vjp_fn(f)),
                                                                       (q, k, v, do))
            emit(kind="kernels", variant=label, mode=mode, T=t,
                 ms_per_call=kernel_times_ms(fn, fargs, label))
        except Exception as e:  # pylint: disable=broad-except
          emit(kind="time", variant=label, mode=mode, T=t, error=f"{type(e).__name__}: {e}"[:2000],
               trace=traceback.format_exc()[-1500:])


def kernel_times_ms(fn, args, label: str, calls: int = 10) -> dict:
  """{kernel: ms per call} of `calls` calls of the compiled `fn` from a profiler trace (the ten
  longest kernels; GPU only): which of a backward's kernels holds the time."""
  if jax.default_backend() != "gpu":
    raise ValueError("--kernel-times reads a GPU trace; the backend is " + jax.default_backend())
  import trace_times  # pylint: disable=import-outside-toplevel  (beside this script)
  jax.block_until_ready(fn(*args))
  logdir = os.path.join("/tmp", "attention_bench_trace", label.replace(",", "_"))
  with jax.profiler.trace(logdir):
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  times = trace_times.stream_kernel_times(trace_times.device_line_times(logdir))
  return {name: round(ns / calls / 1e6, 4) for name, ns in times.most_common(10)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--shapes", default="8192x1,65536x8", help="TxDOCS,... for the timings ('' for none)")
  p.add_argument("--numerics-t", default="2048,8192", help="T of the numerics rows ('' for none)")
  p.add_argument("--numerics-docs", type=int, default=8)
  p.add_argument("--heads", type=int, default=6)
  p.add_argument("--batch", type=int, default=1, help="rows of the timings (each its own documents)")
  p.add_argument("--head-dim", type=int, default=192)
  p.add_argument("--v-dim", type=int, default=128)
  p.add_argument("--mosaic-configs", default=";".join(MOSAIC_CONFIGS),
                 help="';'-separated bq_dq,bk_dq,bq_dkv,bk_dkv,stages,wgs[,smem] (mosaic_config)")
  p.add_argument("--xla-max-t", type=int, default=8192)
  p.add_argument("--reps", type=int, default=20)
  p.add_argument("--kernel-times", action="store_true",
                 help="after each timing, each kernel's ms per call from a profiler trace (GPU)")
  p.add_argument("--smoke", action="store_true",
                 help="small shapes on CPU: xla, and tokamax_mosaic_bwd's backward in the "
                      "interpreter behind a dense forward")
  args = p.parse_args()
  if args.smoke:
    args.variants = "xla,tokamax_mosaic_bwd"
    args.shapes, args.numerics_t, args.numerics_docs = "256x1,512x4", "256", 4
    args.heads, args.head_dim, args.v_dim = 2, 48, 32
    args.xla_max_t = 512
  emit(kind="setup", backend=jax.default_backend(), devices=[str(x) for x in jax.devices()],
       jax=jax.__version__, variants=args.variants)
  for t in (int(x) for x in args.numerics_t.split(",") if x):
    numerics(args, t, args.heads, args.head_dim, args.v_dim)
  for shape in (x for x in args.shapes.split(",") if x):
    t, n_docs = (int(x) for x in shape.split("x"))
    timings(args, t, n_docs, args.heads, args.head_dim, args.v_dim)


if __name__ == "__main__":
  main()
