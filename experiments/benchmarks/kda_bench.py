"""KDA kernels on one GPU: k3jax Pallas vs k3jax XLA chunked vs fla 0.6.0 `chunk_kda` (Triton).

Same inputs for all (bf16 q, k, v, raw gate, beta; A_log = dt_bias = 0; bounded gate lower_bound -5;
q/k L2-norm in the op). Prints one JSON line per measurement:
- correctness at a small shape vs the fp32 `recurrent_kda` (RMS error ratio of o, final state, grads);
- timings (ms, median of timed runs after warm-up) of forward and forward+backward;
- TFLOP/s by the chunk FLOP count of the Kimi Linear paper (eq. 13: per head 6·T·d² + 3·T·C·d + T·C²,
  forward; forward+backward counted as 3× that);
- peak GPU memory of forward+backward at the largest T (separate process per framework is not
  needed: JAX's allocator stats and torch's max_memory_allocated are read separately).

Run: XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/benchmarks/kda_bench.py
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.ops import kda as kda_ops  # noqa: E402
from pallas_kernels.kda import chunk_kda as pallas_chunk_kda  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (1, 131072, 16, 128), (2, 8192, 32, 128)]
LB = -5.0


_T0 = time.time()


def emit(**row):
  row["wall_s"] = round(time.time() - _T0, 1)
  print(json.dumps(row), flush=True)


def make_inputs(B, T, H, D, seed=0):
  rng = np.random.default_rng(seed)
  f = lambda *s: rng.standard_normal(s, dtype=np.float32)
  return dict(q=f(B, T, H, D), k=f(B, T, H, D), v=f(B, T, H, D), graw=f(B, T, H, D),
              beta=rng.random((B, T, H), dtype=np.float32), do=f(B, T, H, D),
              A_log=np.zeros((H,), np.float32), dt_bias=np.zeros((H * D,), np.float32))


def jax_fns(impl):
  """fwd(q,k,v,graw,beta,A_log,dt_bias) -> o, for impl in {'pallas', 'xla'}."""
  if impl == "pallas":
    def fwd(q, k, v, graw, beta, a_log, dt):
      return pallas_chunk_kda(q, k, v, graw, beta, use_qk_l2norm=True, A_log=a_log, dt_bias=dt,
                              lower_bound=LB)[0]
  else:
    def fwd(q, k, v, graw, beta, a_log, dt):
      g = kda_ops.kda_gate(graw, a_log, dt, lower_bound=LB)
      return kda_ops.chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, backend="xla")[0]

  def fwdbwd(q, k, v, graw, beta, a_log, dt, do):
    o, vjp = jax.vjp(fwd, q, k, v, graw, beta, a_log, dt)
    return vjp(do)
  return jax.jit(fwd), jax.jit(fwdbwd)


def time_jax(fn, args, reps=20, warmup=3):
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append((time.perf_counter() - t) * 1e3)
  return statistics.median(ts)


def flops_fwd(B, T, H, D, C=64):
  return B * H * (6 * T * D * D + 3 * T * C * D + T * C * C)


def rr(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def correctness(B=2, T=1000, H=4, D=128, with_fla=True):
  """bf16 kernels vs fp32 recurrent reference (and fla vs the same reference)."""
  x = make_inputs(B, T, H, D, seed=1)
  rng = np.random.default_rng(2)
  x["A_log"] = rng.standard_normal(H).astype(np.float32) * 0.5
  x["dt_bias"] = rng.standard_normal(H * D).astype(np.float32)
  h0 = rng.standard_normal((B, H, D, D)).astype(np.float32)
  dht = rng.standard_normal((B, H, D, D)).astype(np.float32)
  names = ["q", "k", "v", "graw", "beta", "A_log", "dt_bias", "h0"]

  def ref_loss(q, k, v, graw, beta, a_log, dt, h0):
    g = kda_ops.kda_gate(graw, a_log, dt, lower_bound=LB)
    o, ht = kda_ops.recurrent_kda(kda_ops.l2_normalize(q), kda_ops.l2_normalize(k), v, g, beta,
                                  initial_state=h0, output_final_state=True)
    return jnp.sum(o * x["do"]) + jnp.sum(ht * dht), (o, ht)

  def pal_loss(q, k, v, graw, beta, a_log, dt, h0):
    bf = lambda t: t.astype(jnp.bfloat16)
    o, ht = pallas_chunk_kda(bf(q), bf(k), bf(v), bf(graw), bf(beta), use_qk_l2norm=True,
                             A_log=a_log, dt_bias=dt, lower_bound=LB, initial_state=h0,
                             output_final_state=True)
    return jnp.sum(o.astype(jnp.float32) * x["do"]) + jnp.sum(ht * dht), (o, ht)

  args = [jnp.asarray(x[n]) if n != "h0" else jnp.asarray(h0) for n in names]
  # The reference sees the same bf16-rounded inputs.
  args = [a.astype(jnp.bfloat16).astype(jnp.float32) if n in ("q", "k", "v", "graw", "beta") else a
          for n, a in zip(names, args)]
  gr, (o_r, ht_r) = jax.jit(jax.grad(ref_loss, argnums=range(8), has_aux=True))(*args)
  gp, (o_p, ht_p) = jax.jit(jax.grad(pal_loss, argnums=range(8), has_aux=True))(*args)
  row = dict(kind="correctness", impl="pallas", B=B, T=T, H=H, D=D, o=rr(o_p, o_r),
             ht=rr(ht_p, ht_r))
  row.update({f"d{n}": rr(a, b) for n, a, b in zip(names, gp, gr)})
  row["finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in gp))
  emit(**row)
  if not with_fla:
    return
  import torch
  from fla.ops.kda import chunk_kda as fla_chunk_kda
  dev = "cuda"
  tt = lambda a, dt=torch.bfloat16: torch.tensor(np.asarray(a, np.float32), device=dev).to(dt)
  ti = [tt(args[0]), tt(args[1]), tt(args[2]), tt(args[3]), tt(args[4]),
        tt(args[5], torch.float32), tt(args[6], torch.float32), tt(args[7], torch.float32)]
  for t in ti:
    t.requires_grad_(True)
  o, ht = fla_chunk_kda(ti[0], ti[1], ti[2], ti[3], ti[4], A_log=ti[5], dt_bias=ti[6],
                        initial_state=ti[7], output_final_state=True, use_qk_l2norm_in_kernel=True,
                        use_gate_in_kernel=True, safe_gate=True, lower_bound=LB)
  loss = (o.float() * tt(x["do"], torch.float32)).sum() + (ht * tt(dht, torch.float32)).sum()
  loss.backward()
  row = dict(kind="correctness", impl="fla", B=B, T=T, H=H, D=D,
             o=rr(o.detach().float().cpu().numpy(), o_r), ht=rr(ht.detach().cpu().numpy(), ht_r))
  row.update({f"d{n}": rr(t.grad.float().cpu().numpy(), b) for n, t, b in zip(names, ti, gr)})
  emit(**row)


def bench_jax(impl, B, T, H, D, modes):
  x = make_inputs(B, T, H, D)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = [bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["graw"]), bf(x["beta"]),
          jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"])]
  fwd, fwdbwd = jax_fns(impl)
  row = dict(kind="time", impl=impl, B=B, T=T, H=H, D=D)
  fl = flops_fwd(B, T, H, D)
  try:
    if "fwd" in modes:
      row["fwd_ms"] = round(time_jax(fwd, args), 3)
      row["fwd_tflops"] = round(fl / row["fwd_ms"] / 1e9, 1)
    if "fwdbwd" in modes:
      row["fwdbwd_ms"] = round(time_jax(fwdbwd, args + [bf(x["do"])]), 3)
      row["fwdbwd_tflops"] = round(3 * fl / row["fwdbwd_ms"] / 1e9, 1)
      stats = jax.devices()[0].memory_stats() or {}
      row["peak_gib_process"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 2)
  except Exception as e:  # record and go on (e.g. out of memory for XLA at long T)
    row["error"] = repr(e)[:300]
  emit(**row)


def bench_fla(B, T, H, D, modes):
  import torch
  from triton.testing import do_bench
  from fla.ops.kda import chunk_kda as fla_chunk_kda
  x = make_inputs(B, T, H, D)
  tt = lambda a, dt=torch.bfloat16: torch.tensor(a, device="cuda").to(dt)
  q, k, v, graw, beta = (tt(x[n]).requires_grad_(True) for n in ("q", "k", "v", "graw", "beta"))
  a_log = tt(x["A_log"], torch.float32).requires_grad_(True)
  dt = tt(x["dt_bias"], torch.float32).requires_grad_(True)
  do = tt(x["do"])
  kw = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt,
            safe_gate=True, lower_bound=LB)
  fwd = lambda: fla_chunk_kda(q, k, v, graw, beta, **kw)[0]

  def fb():
    fwd().backward(do)
  row = dict(kind="time", impl="fla", B=B, T=T, H=H, D=D)
  fl = flops_fwd(B, T, H, D)
  if "fwd" in modes:
    row["fwd_ms"] = round(do_bench(fwd, warmup=25, rep=100), 3)
    row["fwd_tflops"] = round(fl / row["fwd_ms"] / 1e9, 1)
  if "fwdbwd" in modes:
    torch.cuda.reset_peak_memory_stats()
    row["fwdbwd_ms"] = round(do_bench(fb, warmup=25, rep=100), 3)
    row["fwdbwd_tflops"] = round(3 * fl / row["fwdbwd_ms"] / 1e9, 1)
    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
  emit(**row)
  del q, k, v, graw, beta
  torch.cuda.empty_cache()


def bench_stages(B, T, H, D):
  """Forward / backward kernels one at a time (bounded fused gate, bf16): where the time goes."""
  from pallas_kernels.kda import kernels as kk
  from pallas_kernels.kda import ops as kops
  x = make_inputs(B, T, H, D)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k, v, graw, beta, do = (bf(x[n]) for n in ("q", "k", "v", "graw", "beta", "do"))
  q, k = kops._l2norm(q), kops._l2norm(k)
  a_log, dt = jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"]).reshape(H, D)
  cfg = kk.KernelConfig(chunk=64, scale=D ** -0.5, mm_dtype=jnp.bfloat16, exact_diag=False,
                        gate="bounded", lower_bound=LB, interpret=False, state_dtype=jnp.bfloat16)
  nt = T // 64
  seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, nt))
  first = jnp.broadcast_to((jnp.arange(nt) == 0).astype(jnp.int32), (B, nt))
  last = jnp.broadcast_to((jnp.arange(nt) == nt - 1).astype(jnp.int32), (B, nt))
  h0 = jnp.zeros((B + 1, H, D, D), jnp.float32)
  row = dict(kind="stages", B=B, T=T, H=H, D=D)
  def stage(name, fn, *args):
    f = jax.jit(functools.partial(fn, cfg))
    out = f(*args)
    row[name + "_ms"] = round(time_jax(f, list(args)), 3)
    return out

  G, X, P, Dm = stage("intra_fwd", kk.intra_fwd, q, k, graw, beta, a_log, dt)
  M, W, U = stage("wy_fwd", kk.wy_fwd, k, v, beta, G, X, Dm)
  o, hs, ht = stage("scan_fwd", functools.partial(kk.scan_fwd, out_dtype=v.dtype), q, k, G, W, U,
                    P, h0, seq, first, last)
  dhs, dvn, _ = stage("scan_bwd", kk.scan_bwd, q, k, G, W, P, do, jnp.zeros_like(h0), seq, first,
                      last)
  dP, dX, dq, dk, dG, dv, db = stage("dense_bwd", kk.dense_bwd, q, k, v, beta, G, W, U, M, X, hs,
                                     dhs, dvn, do)
  stage("intra_bwd", kk.intra_bwd, q, k, graw, G, dP, dX, dq, dk, dG, a_log, dt)
  emit(**row)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--impls", default="pallas,xla,fla")
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--shapes", default="all", help="'all' or e.g. 8x4096x16x128,1x32768x16x128")
  p.add_argument("--skip-correctness", action="store_true")
  p.add_argument("--stages", action="store_true", help="also time each kernel alone")
  p.add_argument("--xla-max-tokens", type=int, default=65536,
                 help="skip the XLA path above this many tokens per row (memory / time)")
  a = p.parse_args()
  impls = a.impls.split(",")
  modes = a.modes.split(",")
  shapes = SHAPES if a.shapes == "all" else [tuple(int(t) for t in s.split("x"))
                                             for s in a.shapes.split(",")]
  emit(kind="env", device=str(jax.devices()[0]), jax=jax.__version__)
  if not a.skip_correctness:
    correctness(with_fla="fla" in impls)
  for shape in shapes:
    if a.stages:
      bench_stages(*shape)
    for impl in impls:
      if impl == "fla":
        bench_fla(*shape, modes)
      elif impl == "xla" and shape[1] > a.xla_max_tokens:
        emit(kind="time", impl="xla", B=shape[0], T=shape[1], H=shape[2], D=shape[3],
             skipped=f"T > {a.xla_max_tokens}")
      else:
        bench_jax(impl, *shape, modes)


if __name__ == "__main__":
  main()
