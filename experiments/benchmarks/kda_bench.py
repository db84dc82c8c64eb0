"""KDA kernels on one GPU: k3jax Pallas vs k3jax XLA chunked vs fla 0.6.0 `chunk_kda` (Triton).

Same inputs for all (bf16 q, k, v, raw gate, beta; A_log = dt_bias = 0; bounded gate lower_bound -5;
q/k L2-norm in the op). Prints one JSON line per measurement:
- correctness at a small shape vs the fp32 `recurrent_kda` (RMS error ratio of o, final state,
  grads; o_fwd / ht_fwd: those of the call without a gradient, whose kernels differ);
- timings (ms per call; JAX: median over 5 batches of calls dispatched back to back, see `time_jax`;
  fla: triton's do_bench) of forward and forward+backward. The forward is the call without a
  gradient: for Pallas the kernels that store nothing for a backward (`ops._forward`), for fla the
  same kernels as under autograd (its forward does not depend on it);
- TFLOP/s by the chunk FLOP count of the Kimi Linear paper (`k3jax.model.flops.kda_chunk_flops`,
  eq. 13: per head 6·T·d² + 3·T·C·d + T·C², forward; forward+backward counted as 3× that);
- memory of forward+backward at every shape: for JAX the compiled step's inputs + outputs +
  temporaries (XLA's memory analysis), for fla torch's max_memory_allocated after a reset.

With --stages, each Pallas kernel is first timed alone over launch candidates and block sizes
(`STAGE_LAUNCHES`, `INTRA_BK`, `GATE_BK`, `DENSE_BLOCKS`, the scans' V blocks; --sweep picks the
kernels; `gate_fwd_alone`, `intra_fwd_alone` and `scan_out_fwd` are the kernels of the forward
alone, whose scan forms the outputs) and the end-to-end timings use the fastest
(`config.Tuning`); --tuning overrides fields;
--segments adds the segment-id path. Correctness runs with and without segment ids.
--gate=softplus times the unbounded gate g = −exp(A_log)·softplus(x + dt_bias) instead of the bounded
one (k3jax and its Pallas kernels only: their exact diagonal-tile path, which any gate needs).

Run: XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/benchmarks/kda_bench.py
fla's first call autotunes for minutes: give it its own call, or put it first in --impls.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from k3jax.model.flops import kda_chunk_flops  # noqa: E402
from k3jax.ops import kda as kda_ops  # noqa: E402
from k3jax.ops import kda_inputs  # noqa: E402
from pallas_kernels.kda import chunk_kda as pallas_chunk_kda  # noqa: E402
from pallas_kernels.kda.backward import dense_bwd, intra_bwd, scan_bwd  # noqa: E402
from pallas_kernels.kda.config import KernelConfig, Tuning, default_tuning  # noqa: E402
from pallas_kernels.kda.gate import gate_fwd  # noqa: E402
from pallas_kernels.kda.intra_chunk import intra_fwd, wy_fwd  # noqa: E402
from pallas_kernels.kda.output import out_fwd  # noqa: E402
from pallas_kernels.kda.scan import scan_fwd, scan_out_fwd  # noqa: E402

SHAPES = [(8, 4096, 16, 128), (1, 32768, 16, 128), (1, 131072, 16, 128), (2, 8192, 32, 128)]
LB = -5.0   # the bounded gate's lower bound; None with --gate=softplus (set in `main`)


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


def jax_args(B, T, H, D):
  """`make_inputs` as the arguments of `jax_fns`' fwd and fwdbwd (bf16 tensors, fp32 gate
  parameters): (fwd_args, fwdbwd_args)."""
  x = make_inputs(B, T, H, D)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  args = [bf(x["q"]), bf(x["k"]), bf(x["v"]), bf(x["graw"]), bf(x["beta"]),
          jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"])]
  return args, args + [bf(x["do"])]


def jax_fns(impl, tuning=None, segment_ids=None):
  """fwd(q,k,v,graw,beta,A_log,dt_bias) -> o, for impl in {'pallas', 'xla'}."""
  if impl == "pallas":
    def fwd(q, k, v, graw, beta, a_log, dt):
      return pallas_chunk_kda(q, k, v, graw, beta, use_qk_l2norm=True, A_log=a_log, dt_bias=dt,
                              lower_bound=LB, tuning=tuning, segment_ids=segment_ids)[0]
  else:
    def fwd(q, k, v, graw, beta, a_log, dt):
      g = kda_inputs.kda_gate(graw, a_log, dt, lower_bound=LB)
      return kda_ops.chunk_kda(q, k, v, g, beta, use_qk_l2norm=True, backend="xla")[0]

  def fwdbwd(q, k, v, graw, beta, a_log, dt, do):
    o, vjp = jax.vjp(fwd, q, k, v, graw, beta, a_log, dt)
    return vjp(do)
  return jax.jit(fwd), jax.jit(fwdbwd)


def time_jax(fn, args, reps=20, warmup=3, min_warmup_s=0.3, batches=5):
  """ms per call: the median over `batches` of the mean of `reps` calls dispatched back to back and
  synchronised once (device time without a host round trip per call, as triton's do_bench measures
  fla). The warm-up lasts at least `min_warmup_s`, so that the GPU clocks are up again after a
  compilation (short timings right after one read up to 20% slow)."""
  t0, n = time.perf_counter(), 0
  while n < warmup or time.perf_counter() - t0 < min_warmup_s:
    jax.block_until_ready(fn(*args))
    n += 1
  ts = []
  for _ in range(batches):
    t = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)  # the previous output is freed: one result live at a time
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t) * 1e3 / reps)
  return statistics.median(ts)


def rr(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def random_segments(B, T, mean_len, seed=0):
  """[B, T] int32 segment ids: documents of random lengths (mean ~mean_len), some padding."""
  rng = np.random.default_rng(seed)
  out = np.zeros((B, T), np.int32)
  for b in range(B):
    t, sid = 0, 1
    while t < T:
      n = int(rng.integers(1, 2 * mean_len))
      out[b, t:t + n] = sid if rng.random() > 0.1 else 0
      t, sid = t + n, sid + 1
  return jnp.asarray(out)


def correctness(B=2, T=1000, H=4, D=128, with_fla=True, tuning=None, segments=False):
  """bf16 kernels vs fp32 recurrent reference (and fla vs the same reference)."""
  seg = random_segments(B, T, 150, seed=3) if segments else None
  x = make_inputs(B, T, H, D, seed=1)
  rng = np.random.default_rng(2)
  x["A_log"] = rng.standard_normal(H).astype(np.float32) * 0.5
  x["dt_bias"] = rng.standard_normal(H * D).astype(np.float32)
  h0 = rng.standard_normal((B, H, D, D)).astype(np.float32)
  dht = rng.standard_normal((B, H, D, D)).astype(np.float32)
  names = ["q", "k", "v", "graw", "beta", "A_log", "dt_bias", "h0"]

  def ref_loss(q, k, v, graw, beta, a_log, dt, h0):
    g = kda_inputs.kda_gate(graw, a_log, dt, lower_bound=LB)
    o, ht = kda_ops.recurrent_kda(kda_inputs.l2_normalize(q), kda_inputs.l2_normalize(k), v, g,
                                  beta, initial_state=h0, output_final_state=True,
                                  segment_ids=seg)
    return jnp.sum(o * x["do"]) + jnp.sum(ht * dht), (o, ht)

  def pal_loss(q, k, v, graw, beta, a_log, dt, h0):
    bf = lambda t: t.astype(jnp.bfloat16)
    o, ht = pallas_chunk_kda(bf(q), bf(k), bf(v), bf(graw), bf(beta), use_qk_l2norm=True,
                             A_log=a_log, dt_bias=dt, lower_bound=LB, initial_state=h0,
                             output_final_state=True, tuning=tuning, segment_ids=seg)
    return jnp.sum(o.astype(jnp.float32) * x["do"]) + jnp.sum(ht * dht), (o, ht)

  args = [jnp.asarray(x[n]) if n != "h0" else jnp.asarray(h0) for n in names]
  # The reference sees the same bf16-rounded inputs.
  args = [a.astype(jnp.bfloat16).astype(jnp.float32) if n in ("q", "k", "v", "graw", "beta") else a
          for n, a in zip(names, args)]
  gr, (o_r, ht_r) = jax.jit(jax.grad(ref_loss, argnums=range(8), has_aux=True))(*args)
  gp, (o_p, ht_p) = jax.jit(jax.grad(pal_loss, argnums=range(8), has_aux=True))(*args)
  # Without a gradient the kernels differ (nothing stored for a backward): o_fwd, ht_fwd.
  _, (o_f, ht_f) = jax.jit(pal_loss)(*args)
  row = dict(kind="correctness", impl="pallas", B=B, T=T, H=H, D=D, segments=segments,
             o=rr(o_p, o_r), ht=rr(ht_p, ht_r), o_fwd=rr(o_f, o_r), ht_fwd=rr(ht_f, ht_r))
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


def bench_jax(impl, B, T, H, D, modes, tuning=None, segments=False):
  args, bwd_args = jax_args(B, T, H, D)
  seg = random_segments(B, T, 1000) if segments else None
  fwd, fwdbwd = jax_fns(impl, tuning, seg)
  row = dict(kind="time", impl=impl, B=B, T=T, H=H, D=D, segments=segments)
  fl = kda_chunk_flops(B, T, H, D)
  try:
    if "fwd" in modes:
      row["fwd_ms"] = round(time_jax(fwd, args), 3)
      row["fwd_tflops"] = round(fl / row["fwd_ms"] / 1e9, 1)
    if "fwdbwd" in modes:
      row["fwdbwd_ms"] = round(time_jax(fwdbwd, bwd_args), 3)
      row["fwdbwd_tflops"] = round(3 * fl / row["fwdbwd_ms"] / 1e9, 1)
      # Inputs + outputs + XLA's temporaries of the compiled step (what torch's
      # max_memory_allocated counts for fla: the process peak would carry earlier shapes).
      ma = fwdbwd.lower(*bwd_args).compile().memory_analysis()
      row["peak_gib"] = round((ma.argument_size_in_bytes + ma.output_size_in_bytes
                               + ma.temp_size_in_bytes) / 2**30, 2)
  except Exception as e:  # record and go on (e.g. out of memory for XLA at long T)
    row["error"] = repr(e)[:300]
  emit(**row)


def fla_calls(B, T, H, D):
  """fla's forward and forward+backward on `make_inputs` (bf16; the Pallas path's options: q/k
  L2-norm, gate in the kernel, safe bounded gate): (fwd() -> o, fwdbwd() -> None)."""
  import torch
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

  def fwdbwd():
    fwd().backward(do)
  return fwd, fwdbwd


def bench_fla(B, T, H, D, modes):
  import torch
  from triton.testing import do_bench
  fwd, fb = fla_calls(B, T, H, D)
  row = dict(kind="time", impl="fla", B=B, T=T, H=H, D=D)
  fl = kda_chunk_flops(B, T, H, D)
  if "fwd" in modes:
    row["fwd_ms"] = round(do_bench(fwd, warmup=25, rep=100), 3)
    row["fwd_tflops"] = round(fl / row["fwd_ms"] / 1e9, 1)
  if "fwdbwd" in modes:
    torch.cuda.reset_peak_memory_stats()
    row["fwdbwd_ms"] = round(do_bench(fb, warmup=25, rep=100), 3)
    row["fwdbwd_tflops"] = round(3 * fl / row["fwdbwd_ms"] / 1e9, 1)
    row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
  emit(**row)
  del fwd, fb  # the closures hold the inputs
  torch.cuda.empty_cache()


STAGE_LAUNCHES = {  # candidates swept by --stages: (num_warps, num_stages)
    "gate_fwd": [(4, 1), (8, 1)],
    "intra_fwd": [(1, 1), (2, 1)],  # (4, 1) was the slowest in every sweep (runs 4, 5)
    "wy_fwd": [(4, 1), (8, 1)],
    "scan_fwd": [(4, 1), (4, 3), (8, 3)],
    "out_fwd": [(4, 1), (8, 1)],
    "scan_out_fwd": [(4, 1), (4, 3), (8, 3)],  # the forward-alone scan (outputs formed inside)
    "scan_bwd": [(4, 1), (4, 3), (8, 3)],
    "dense_bwd": [(8, 1)],  # (4, 1) measured 1.8x slower in runs 3 and 4
    "intra_bwd": [(1, 1), (2, 1), (4, 1), (8, 1)],
}
INTRA_BK = [16, 32, 64]  # K blocks of the intra-chunk kernels
GATE_BK = [32, 64, 128]  # K blocks of gate_fwd
DENSE_BLOCKS = [(bv, bk) for bv in (32, 64) for bk in (32, 64, 128)]  # dense_bwd's (V, K) blocks
SCAN_BV = [32, 64]
SCAN_BV_NARROW = [16, 32, 64]  # few rows × heads: smaller V blocks give more programs


STAGES = ("gate_fwd", "intra_fwd", "wy_fwd", "scan_fwd", "out_fwd", "gate_fwd_alone",
          "intra_fwd_alone", "scan_out_fwd", "scan_bwd", "dense_bwd", "intra_bwd")


def bench_stages(B, T, H, D, scans_only=False, base=None, sweep=STAGES):
  """Times each kernel alone (bounded fused gate, q/k norm in gate_fwd, bf16) over the launch
  candidates; returns the fastest `Tuning` (scans_only: sweep only the two sequential scans, keep
  `base` for the rest). Kernels not in `sweep` run once with `base` (default:
  `config.default_tuning`)."""
  x = make_inputs(B, T, H, D)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  q, k, v, graw, beta, do = (bf(x[n]) for n in ("q", "k", "v", "graw", "beta", "do"))
  a_log, dt = jnp.asarray(x["A_log"]), jnp.asarray(x["dt_bias"]).reshape(H, D)
  nt = T // 64
  seq = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, nt))
  first = jnp.broadcast_to((jnp.arange(nt) == 0).astype(jnp.int32), (B, nt))
  last = jnp.broadcast_to((jnp.arange(nt) == nt - 1).astype(jnp.int32), (B, nt))
  h0 = jnp.zeros((B + 1, H, D, D), jnp.float32)
  best = dict(dataclasses.asdict(base or default_tuning(B * H, D, D)))
  row = dict(kind="stages", B=B, T=T, H=H, D=D)

  def cfg_for(**over):
    return KernelConfig(chunk=64, scale=D ** -0.5, mm_dtype=jnp.bfloat16, exact_diag=False,
                        gate="bounded", lower_bound=LB, interpret=False,
                        state_dtype=jnp.bfloat16, qk_l2norm=True,
                        tuning=Tuning(**dict(best, **over)))

  def stage(name, fn, args, variants, keep_pick=True):
    """variants: list of Tuning overrides; keeps the fastest in `best` (unless not `keep_pick`: a
    kernel timed on another's Tuning fields), returns its outputs."""
    if name not in sweep:
      variants = [{}]
    times, outs, fastest = {}, None, float("inf")
    for over in variants:
      key = ",".join(f"{v}" for v in over.values()) or "base"
      try:
        f = jax.jit(functools.partial(fn, cfg_for(**over)))
        out = f(*args)
        t = time_jax(f, list(args), reps=10, warmup=2)
      except Exception as e:  # a variant that does not compile: record, try the others
        row[f"{name}[{key}]_error"] = repr(e)[:200]
        continue
      times[key] = round(t, 3)
      if t < fastest:
        outs, pick, fastest = out, over, t
    row[name + "_ms"] = times
    if not times:
      raise RuntimeError(f"no variant of {name} ran: {row}")
    if keep_pick:
      best.update(pick)
    return outs

  launches = lambda name: [{f"{name}_launch": l} for l in STAGE_LAUNCHES[name]]
  blocked = lambda name, bk_name, **fixed: [  # launches × K blocks of an intra-chunk kernel
      {f"{name}_launch": l, bk_name: bk, **fixed} for l in STAGE_LAUNCHES[name]
      for bk in INTRA_BK if bk <= D]
  scan_variants = lambda name, bvk, field=None: [
      {field or f"{name}_launch": l, bvk: bv} for bv in (SCAN_BV_NARROW if scans_only else SCAN_BV)
      for l in (STAGE_LAUNCHES[name][:2] if scans_only else STAGE_LAUNCHES[name])]
  keep = lambda name: launches(name) if not scans_only else [{}]
  gate_variants = [{"gate_fwd_launch": l, "gate_fwd_bk": bk}
                   for l in STAGE_LAUNCHES["gate_fwd"] for bk in GATE_BK if bk <= D]
  # q, k are raw: gate_fwd normalises them; in a training forward it also writes the normalised
  # qn, kn, which the backward's kernels (run with qk_l2norm off) read.
  G, qg, kb, kg, rq, rk, qn, kn = stage(
      "gate_fwd", functools.partial(gate_fwd, normalized=True), (q, k, graw, beta, a_log, dt),
      gate_variants if not scans_only else [{}])
  X, P, M = stage("intra_fwd", functools.partial(intra_fwd, rq=rq, rk=rk), (q, k, G, beta),
                  blocked("intra_fwd", "intra_fwd_bk") if not scans_only else [{}])
  W, U = stage("wy_fwd", wy_fwd, (kb, v, beta, M), keep("wy_fwd"))
  vn, hs, ht = stage("scan_fwd", scan_fwd, (kg, G, W, U, h0, seq, first, last),
                     scan_variants("scan_fwd", "bv_fwd"))
  stage("out_fwd", functools.partial(out_fwd, out_dtype=v.dtype), (qg, hs, P, vn),
        keep("out_fwd"))
  # The forward alone: gate_fwd without qn, kn (on the training forward's launch and K block),
  # intra_fwd without X (M in bf16), then the scan that forms the outputs and stores no residuals
  # (it shares scan_fwd's launch and V block, which stay scan_fwd's pick).
  stage("gate_fwd_alone", gate_fwd, (q, k, graw, beta, a_log, dt), [{}])
  P1, M1 = stage("intra_fwd_alone",
                 functools.partial(intra_fwd, residuals=False, rq=rq, rk=rk), (q, k, G, beta),
                 [{}])
  W1, U1 = wy_fwd(cfg_for(), kb, v, beta, M1)
  stage("scan_out_fwd", functools.partial(scan_out_fwd, out_dtype=v.dtype),
        (kg, G, W1, U1, qg, P1, h0, seq, first, last),
        scan_variants("scan_out_fwd", "bv_fwd", "scan_fwd_launch"), keep_pick=False)
  cfg_bwd = lambda cfg: dataclasses.replace(cfg, qk_l2norm=False)
  dhs, dvn, _ = stage("scan_bwd", scan_bwd,
                      (qg, kg, G, W, P, do, jnp.zeros_like(h0), seq, first, last),
                      scan_variants("scan_bwd", "bv_bwd"))
  dP, dX, dq, dk, dG, dv, db = stage(
      "dense_bwd", lambda cfg, *a: dense_bwd(cfg_bwd(cfg), *a),
      (qn, kn, v, beta, G, vn, M, X, hs, dhs, dvn, do),
      [{"dense_bwd_launch": l, "dense_bwd_bv": bv, "dense_bwd_bk": bk}
       for l in STAGE_LAUNCHES["dense_bwd"] for bv, bk in DENSE_BLOCKS if bv <= D and bk <= D]
      if not scans_only else [{}])
  stage("intra_bwd", lambda cfg, *a: intra_bwd(cfg_bwd(cfg), *a[:-4], norm=a[-4:]),
        (qn, kn, graw, G, dP, dX, dq, dk, dG, a_log, dt, q, k, rq, rk),
        blocked("intra_bwd", "intra_bwd_bk") if not scans_only else [{}])
  tuning = Tuning(**best)
  row["best"] = {n: list(v) if isinstance(v, tuple) else v for n, v in best.items()}
  fwd_sum = lambda names: round(sum(min(row[n + "_ms"].values()) for n in names), 3)
  row["sum_best_train_fwd_ms"] = fwd_sum(("gate_fwd", "intra_fwd", "wy_fwd", "scan_fwd",
                                          "out_fwd"))
  row["sum_best_fwd_ms"] = fwd_sum(("gate_fwd_alone", "intra_fwd_alone", "wy_fwd",
                                    "scan_out_fwd"))
  row["sum_best_bwd_ms"] = round(sum(min(row[n + "_ms"].values()) for n in
                                     ("scan_bwd", "dense_bwd", "intra_bwd")), 3)
  emit(**row)
  return tuning


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--impls", default="pallas,xla,fla", help="run in this order")
  p.add_argument("--modes", default="fwd,fwdbwd")
  p.add_argument("--shapes", default="all", help="'all' or e.g. 8x4096x16x128,1x32768x16x128")
  p.add_argument("--skip-correctness", action="store_true")
  p.add_argument("--stages", action="store_true",
                 help="time each kernel alone over launch candidates and use the fastest")
  p.add_argument("--segments", action="store_true",
                 help="also time the Pallas path with segment ids (~1000-token documents)")
  p.add_argument("--xla-max-tokens", type=int, default=65536,
                 help="skip the XLA path above this many tokens per row (memory / time)")
  p.add_argument("--sweep", default=",".join(STAGES),
                 help="with --stages, the kernels whose launch candidates are swept (the others "
                      "run once with config.default_tuning)")
  p.add_argument("--tuning", default="",
                 help="JSON of config.Tuning fields that replace config.default_tuning's at "
                      "every shape (e.g. '{\"bv_fwd\": 16}', or the 'best' of an earlier "
                      "--stages run)")
  p.add_argument("--gate", choices=("bounded", "softplus"), default="bounded",
                 help="the decay gate: bounded (lower bound -5) or the unbounded softplus form")
  a = p.parse_args()
  impls = a.impls.split(",")
  if a.gate == "softplus":
    if "fla" in impls or a.stages:
      raise SystemExit("--gate=softplus: only --impls=pallas,xla without --stages (fla's timed "
                       "path and the stage sweep are the bounded gate's)")
    global LB
    LB = None
  modes = a.modes.split(",")
  shapes = SHAPES if a.shapes == "all" else [tuple(int(t) for t in s.split("x"))
                                             for s in a.shapes.split(",")]
  emit(kind="env", device=str(jax.devices()[0]), jax=jax.__version__, gate=a.gate)
  tuned = {}
  if a.tuning:
    fields = {n: tuple(v) if isinstance(v, list) else v for n, v in json.loads(a.tuning).items()}
    tuned = {s: dataclasses.replace(default_tuning(s[0] * s[2], s[3], s[3]), **fields)
             for s in shapes}
  if a.stages:
    sweep = tuple(a.sweep.split(","))
    unknown = set(sweep) - set(STAGES)
    if unknown:
      raise SystemExit(f"--sweep: unknown kernels {sorted(unknown)}; allowed: {', '.join(STAGES)}")
    wide = bench_stages(*shapes[0], sweep=sweep)
    if {"scan_fwd", "scan_out_fwd", "scan_bwd"} & set(sweep):
      narrow = wide
      if any(B * H < 64 for B, _, H, _ in shapes):  # few rows × heads: sweep the scans there too
        B, T, H, D = next(s for s in shapes if s[0] * s[2] < 64)
        narrow = bench_stages(B, min(T, 32768), H, D, scans_only=True, base=wide)
      tuned = {s: (wide if s[0] * s[2] >= 64 else narrow) for s in shapes}
    else:  # the scans keep their per-shape defaults
      scan_fields = ("scan_fwd_launch", "scan_bwd_launch", "bv_fwd", "bv_bwd")
      tuned = {}
      for B, T, H, D in shapes:
        default = default_tuning(B * H, D, D)
        tuned[(B, T, H, D)] = dataclasses.replace(
            wide, **{f: getattr(default, f) for f in scan_fields})
  if not a.skip_correctness:
    correctness(with_fla=False, tuning=tuned.get(shapes[0]))
    correctness(with_fla=False, tuning=tuned.get(shapes[0]), segments=True)
  for impl in impls:  # in the order given: fla's first call autotunes for minutes
    for shape in shapes:
      if impl == "fla":
        bench_fla(*shape, modes)
      elif impl == "xla" and shape[1] > a.xla_max_tokens:
        emit(kind="time", impl="xla", B=shape[0], T=shape[1], H=shape[2], D=shape[3],
             skipped=f"T > {a.xla_max_tokens}")
      else:
        bench_jax(impl, *shape, modes, tuning=tuned.get(shape))
        if impl == "pallas" and a.segments and shape == shapes[0]:
          bench_jax(impl, *shape, modes, tuning=tuned.get(shape), segments=True)


if __name__ == "__main__":
  main()
