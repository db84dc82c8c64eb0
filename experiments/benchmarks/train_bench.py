r"""The real training step of a gin config on one device: time, MFU, memory, compile and start-up.

Each case is a gin config (+ --gin_bindings), a row length and a batch of rows, run by the training
step of `k3jax.training` (`init_train_state` + `make_train_step`: the config's optimizer, QB,
micro-batching) on random tokens. Rows are 'packed' (documents of geometric length, mean --doc_len
tokens: a BOS starts each, segment ids 1, 2, ... and loss mask as `k3jax.data.packing.make_batch`
builds them from text) or 'single' (one document per row).

The driver runs every case in a child process of its own (memory, compiled programs and JAX's
in-memory caches do not leak from one case into the next) with JAX's persistent compilation cache
in a folder per config, shared by that config's cases; a case marked for it runs twice in a row,
so that the second run shows start-up with a warm cache. One JSON line per event, printed as soon
as it is known:

  progress  compile_s etc. as soon as known (a case that later fails or times out still says how
            far it got);
  result    step_ms (median of --steps timed steps after --warmup), tokens_per_s, tflops and mfu
            (k3jax.model.flops.flops_per_token at the row length, against --peak_tflops), peak_gib
            (the device allocator's peak_bytes_in_use), temp_gib (compiled step's temporaries),
            shapes_s (the state's shapes), init_s (initialisation: compile and run),
            trace_lower_s, compile_s (the step), first_step_s, startup_s (process start ->
            first step finished; the step is traced in a background thread, then compiled
            there while the state initialises, as `python -m k3jax.train` starts:
            step_ready_after_init_s is when it was compiled, counted from the initialisation's
            start, handoff_s its read back from the caches; with --sequential_startup one after
            the other),
            cache_entries_before / _after (the persistent cache folder; equal when everything
            was read from it),
            loss_first / loss_last;
  memory    with --memory_report: the largest buffers alive at the compiled step's memory peak
            and the peak summed by model scope (hlo_memory.py);
  startup_profile  with --profile_startup DIR: the cold start-up's top host events after the
            initialisation (tracing, lowering, XLA's compile phases);
  profile_scopes   with --profile and --memory_report: the step's kernel time by model scope and
            by module kind, and the MoE's share of it against its share of the FLOPs;
  gemms     with --profile and --memory_report: each matmul's FLOPs, time and TFLOP/s
            (gemm_rates.py; with XLA's command buffers on, cuBLAS's GEMMs are not matched);
  profile   with --profile DIR: the top kernels by device time per step, from a jax.profiler
            trace of --profile_steps steps written under DIR/<case>;
  error     the case's error (first line), or its timeout; the driver goes on with the next case.

Case sets (--cases):
  throughput  small.gin at 4 x 8192 and medium.gin at 4 x 8192 (its 16K-token micro-batches: two
              per step), packed, each run cold and then warm;
  curriculum  small.gin, one row of --seq_lens tokens (8192, 65536, 262144, 1048576), single then
              packed (same shapes: the packed run finds the step compiled); the first case is
              re-run warm;
  one         --gin_file, --seq_len, --batch, --rows, once cold and once warm.
--no_warm_rerun runs every case once; --compile_only stops each case after compiling its step.
--smoke: tiny.gin, one case of 2 x 128 tokens (two micro-batches of one row), 2 steps (CPU).

  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python experiments/benchmarks/train_bench.py \
      --cases=throughput [--profile=/tmp/prof] [--gin_bindings="ImplConfig.remat = 'dots'"]

--budget_s (default 570) bounds the whole driver: each case gets at most what is left, and cases
that cannot start in time are reported as errors.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

_PROCESS_START = time.time()
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

import numpy as np  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
from gemm_rates import PEAK_TFLOPS_H200  # noqa: E402  (the MFU denominator, one definition)
ROWS = ("packed", "single")


def emit(**row):
  print(json.dumps(row), flush=True)


def _sig(x: float) -> float:
  """x to 4 significant digits (a tiny CPU model's TFLOP/s are not rounded away to 0)."""
  return float(f"{x:.4g}")


def first_line(error: BaseException) -> str:
  text = str(error).strip()
  return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def random_rows(batch: int, seq_len: int, rows: str, vocab_size: int, bos_id: int,
                doc_len: int, seed: int = 0) -> dict:
  """A batch of random-token rows as `packing.make_batch` makes them: dict of [batch, seq_len]
  arrays inputs, targets (int32), segment_ids (int32, documents numbered from 1 in each row),
  loss_mask (float32, 0 where the target is a BOS).

  rows='packed': every token is a document start (BOS) with probability 1/doc_len, so document
  lengths are geometric with mean doc_len; 'single': no BOS, one document per row.
  """
  from k3jax.data import packing
  if rows not in ROWS:
    raise ValueError(f"rows = {rows!r} must be one of {ROWS}")
  if doc_len < 1:
    raise ValueError(f"doc_len = {doc_len} must be a positive integer")
  if not 0 <= bos_id < vocab_size:
    raise ValueError(f"bos_id = {bos_id} must be a token id below vocab_size = {vocab_size}")
  rng = np.random.default_rng(seed)
  window = rng.integers(0, vocab_size - 1, size=batch * seq_len + 1, dtype=np.int32)
  window = np.where(window >= bos_id, window + 1, window).astype(np.int32)  # no BOS by chance
  if rows == "packed":
    window[rng.random(window.size) < 1.0 / doc_len] = bos_id
  return packing.make_batch(window, seq_len, bos_id)


def case_sets(smoke: bool, args) -> list[dict]:
  """The cases of --cases (or of --smoke): dicts of name, gin_files, seq_len, batch, rows,
  warm_rerun, steps, warmup."""
  def case(gin, seq_len, batch, rows, warm_rerun):
    tokens = seq_len * batch
    # Long rows take seconds a step: fewer steps keep each case set within the time budget.
    steps = args.steps or (8 if tokens <= 65536 else 4 if tokens <= 262144 else 2)
    warmup = args.warmup if args.warmup is not None else (2 if tokens <= 65536 else 1)
    name = f"{os.path.basename(gin[0]).removesuffix('.gin')}_{rows}_{batch}x{seq_len}"
    return dict(name=name, gin_files=gin, seq_len=seq_len, batch=batch, rows=rows,
                warm_rerun=warm_rerun, steps=steps, warmup=warmup)

  small, medium = ["gin_configs/small.gin"], ["gin_configs/medium.gin"]
  if smoke:
    return [dict(case(["gin_configs/tiny.gin"], 128, 2, "packed", True), steps=2, warmup=1)]
  if args.cases == "throughput":
    return [case(small, 8192, 4, "packed", True), case(medium, 8192, 4, "packed", True)]
  if args.cases == "curriculum":
    out = []
    for seq_len in args.seq_lens:
      for rows in ("single", "packed"):
        out.append(case(small, seq_len, 1, rows, not out))
    return out
  if args.cases == "one":
    return [case(args.gin_file or small, args.seq_len, args.batch, args.rows, True)]
  raise ValueError(f"--cases = {args.cases!r} must be one of ('throughput', 'curriculum', 'one')")


# ------------------------------------------------------------------------------------------------
# One case (child process)
# ------------------------------------------------------------------------------------------------

def _cache_entries(folder: str) -> int:
  return len(os.listdir(folder)) if folder and os.path.isdir(folder) else 0


def _peak_gib():
  import jax
  stats = jax.devices()[0].memory_stats()
  if not stats or "peak_bytes_in_use" not in stats:
    return None  # CPU devices keep no allocator statistics
  return round(stats["peak_bytes_in_use"] / 2**30, 2)


def top_kernels(logdir: str, steps: int, top: int = 15) -> dict:
  """{'kernel_ms_per_step', 'top': [[kernel name, ms per step], ...]} of the trace in `logdir`
  (GPU stream lines, through trace_times.py), or {'note': ...} when it has no device plane."""
  sys.path.insert(0, _HERE)
  import trace_times
  lines = trace_times.device_line_times(logdir)
  if lines is None:
    return {"note": "no GPU device plane in the trace (on CPU ops run on host threads)"}
  kernels = trace_times.stream_kernel_times(lines)
  total = sum(kernels.values())
  return {"kernel_ms_per_step": round(total / steps / 1e6, 3),
          "top": [[name[:160], round(ns / steps / 1e6, 3)]
                  for name, ns in kernels.most_common(top)]}


def top_host_events(logdir: str, top: int = 40) -> dict:
  """{'xla': [[event name, seconds], ...], 'python': [...]}: where the start-up's host time went
  (XLA's compile phases are host events; '$file:line function' events are Python frames; nested
  events overlap)."""
  sys.path.insert(0, _HERE)
  import trace_times
  events = trace_times.host_event_times(logdir).most_common()
  row = lambda n, ns: [n[:160], round(ns / 1e9, 2)]
  return {"xla": [row(n, ns) for n, ns in events if not n.startswith("$")][:top],
          "python": [row(n, ns) for n, ns in events if n.startswith("$")][:top]}


def profiled_step(logdir: str, dump_dir: str) -> tuple[dict, str]:
  """(the trace's kernel time per HLO instruction of the step's largest program, that program's
  optimised HLO text): what `scope_kernel_times` and gemm_rates.py read, loaded once
  (medium.gin's HLO is ~30 MB). The times count that program's kernels only (by the trace's
  'hlo_module' stat, `trace_times.stream_hlo_op_times`: the host loop's programs reuse
  instruction names); they are also written to `logdir`/op_times.json for gemm_rates.py's
  command line."""
  sys.path.insert(0, _HERE)
  import hlo_memory
  import trace_times
  _, hlo = hlo_memory.module_files(dump_dir, "train_step")
  # module_<id>.<name>.<target>_after_optimizations.txt -> <name>, e.g. jit_train_step_microbatch.
  program = os.path.basename(hlo).split(".")[1]
  ops = trace_times.stream_hlo_op_times(logdir, module=program)
  with open(os.path.join(logdir, "op_times.json"), "w") as f:
    json.dump(ops, f)
  with open(hlo) as f:
    return ops, f.read()


def scope_kernel_times(ops: dict, hlo_text: str, steps: int, model_cfg, seq_len: int,
                       depth: int = 4, top: int = 40) -> dict:
  """{'top_scopes': [[scope, ms per step], ...], 'by_module': [[kind, ms per step, share], ...],
  'moe_time_share', 'moe_time_share_max', 'moe_flop_share'}: the step's kernel time attributed
  through each kernel's HLO instruction to the model (kernel_scopes.py), and the MoE layers' share
  of it against their share of the forward FLOPs (k3jax.model.flops.forward_flops_breakdown; the
  backward's FLOPs are in the same proportion). Kernels that neither their instruction nor their
  name tie to a module (cuBLAS GEMMs launched from command buffers) count in moe_time_share_max,
  the share's upper bound, and not in moe_time_share."""
  sys.path.insert(0, _HERE)
  import hlo_memory
  import kernel_scopes
  from k3jax.model import flops as flops_lib
  if not ops:
    return {"note": "no GPU kernels in the trace"}
  info = hlo_memory.instruction_info(hlo_text)
  by_scope, by_kind = kernel_scopes.attribute(ops, info, depth)
  total = sum(ops.values())
  flops = flops_lib.forward_flops_breakdown(model_cfg, seq_len)
  moe_flops = sum(v for k, v in flops.items() if k.startswith("moe_"))
  ms = lambda ns: round(ns / steps / 1e6, 3)
  return {"kernel_ms_per_step": ms(total),
          "by_module": [[k, ms(ns), round(ns / total, 3)] for k, ns in by_kind.most_common()],
          "moe_time_share": round(by_kind["moe"] / total, 3),
          "moe_time_share_max": round((by_kind["moe"] + by_kind["gemm (module unknown)"]
                                       + by_kind["unattributed kernels"]) / total, 3),
          "moe_flop_share": round(moe_flops / sum(flops.values()), 3),
          "top_scopes": [[k, ms(ns)] for k, ns in by_scope.most_common(top)]}


def config_at_length(cfg, seq_len: int):
  """`cfg` with the implementation settings the training loop uses at rows of `seq_len` tokens:
  those of the stage of this length (`Config.stage_impl`: ImplConfig.stage_remat per stage),
  stage 0's for a length no stage has. The step's model is `K3Model(cfg.model, cfg.impl)`."""
  stage_lens = [length for length, _ in cfg.stages.stages]
  stage = stage_lens.index(seq_len) if seq_len in stage_lens else 0
  return dataclasses.replace(cfg, impl=cfg.stage_impl(stage))


def lower_and_compile(step_fn, state, batch) -> tuple:
  """(compiled step, seconds to trace and lower it, seconds to compile it) for `make_train_step`'s
  step on (state, batch)."""
  t0 = time.perf_counter()
  lowered = step_fn.lower(state, batch)
  trace_lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  compiled = lowered.compile()
  return compiled, trace_lower_s, time.perf_counter() - t0


def run_case(case: dict, args, process_start: float) -> dict:
  """Runs one case in this process; returns its result row (progress lines are emitted)."""
  from k3jax.runtime import compiler
  compiler.enable_compilation_cache(args.cache_dir)
  import jax

  from k3jax import cli
  from k3jax import training as train_lib
  from k3jax.model import K3Model
  from k3jax.model import flops as flops_lib
  from k3jax.runtime import Runtime
  from k3jax.runtime import precompile

  name = case["name"]
  entries_before = _cache_entries(args.cache_dir)
  batch, seq_len = case["batch"], case["seq_len"]
  cfg = config_at_length(cli.config_from_flags(case["gin_files"], args.gin_bindings), seq_len)
  mcfg = cfg.model
  startup_trace = None
  # Traced and lowered programs kept beside the compiled ones, as `python -m k3jax.train` does.
  runtime = Runtime.for_run(cfg, args.cache_dir)
  # The state's shapes, placed where the initialisation puts the state (the first device).
  t0 = time.perf_counter()
  shapes, optimizer, schedule = train_lib.placed_train_state_shapes(
      cfg, cfg.stages.total_steps, runtime=runtime)
  shapes_s = time.perf_counter() - t0
  step_fn = train_lib.make_train_step(cfg, K3Model(mcfg, cfg.impl), optimizer, schedule, runtime,
                                      total_steps=cfg.stages.total_steps)
  host = [random_rows(batch, seq_len, case["rows"], mcfg.vocab_size, mcfg.vocab_size - 1,
                      args.doc_len, seed=i) for i in range(2)]
  # Committed to device 0, as the training loop places its batches: a compile-only case's
  # program is then the one a later run of the case finds in the compile cache.
  device0 = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  batches = [jax.device_put(b, device0) for b in host]
  docs = float(np.mean([b["segment_ids"].max(axis=1).mean() for b in host]))
  overlap = not (args.compile_only or args.profile_startup or args.sequential_startup
                 or not args.cache_dir)   # the compiled step is handed over through the cache
  init_s = 0.0
  if overlap:
    # As `python -m k3jax.train` starts (RuntimeConfig.precompile): the step is traced in a
    # background thread from the state's shapes, then compiled there while the state
    # initialises; the step is then read back from the caches (handoff_s).
    precompiler = precompile.Precompiler(1)
    precompiler.submit("step", lambda: step_fn.lower(shapes, precompile.batch_shapes(
        batch, seq_len, device0)))
    precompiler.wait_lowered("step")   # the tracing alone first, as the CLI does
    t0 = time.perf_counter()
    state, _, _ = train_lib.init_train_state(cfg, cfg.stages.total_steps, runtime=runtime)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    report = precompiler.wait("step")
    if "error" in report:
      raise RuntimeError(f"the background compile failed: {report['error']}")
    ready_s = time.perf_counter() - t0
    trace_lower_s, compile_s = report["lower_s"], report["compile_s"]
    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batches[0]).compile()
    handoff_s = time.perf_counter() - t0
    precompiler.close()
  else:
    if args.compile_only:
      # Nothing runs on the device, so a compile-only case can run beside a training process
      # without competing for its memory, and starts faster.
      state = shapes
    else:
      t0 = time.perf_counter()
      state, _, _ = train_lib.init_train_state(cfg, cfg.stages.total_steps, runtime=runtime)
      jax.block_until_ready(state)
      init_s = time.perf_counter() - t0
    if args.profile_startup:
      # From after the initialisation: with the profiler started before it, the
      # initialisation's threefry kernel failed with 'unspecified launch failure' on the H200
      # (3 runs of 3, one of them alone on the GPU; RESULTS.md, run 12).
      startup_trace = os.path.join(args.profile_startup, f"{name}_run{args.run}_startup")
      jax.profiler.start_trace(startup_trace)
    compiled, trace_lower_s, compile_s = lower_and_compile(step_fn, state, batches[0])
    ready_s = handoff_s = None
  if startup_trace:
    jax.profiler.stop_trace()
    emit(event="startup_profile", case=name, logdir=startup_trace,
         **top_host_events(startup_trace))
  # RuntimeConfig.microbatch_loop = 'host' compiles several programs (k3jax.runtime.host_loop)
  # that run one after the other: the step's temporaries are the largest of theirs.
  programs = getattr(compiled, "programs", {"train_step": compiled})
  memories = {k: c.memory_analysis() for k, c in programs.items()}
  temp_by_program = {k: round(m.temp_size_in_bytes / 2**30, 2) for k, m in memories.items()
                     if m is not None}
  temp_gib = max(temp_by_program.values()) if temp_by_program else None
  overlapped = ({} if ready_s is None else
                dict(step_ready_after_init_s=round(ready_s, 2), handoff_s=round(handoff_s, 2)))
  emit(event="progress", case=name, shapes_s=round(shapes_s, 2), init_s=round(init_s, 2),
       trace_lower_s=round(trace_lower_s, 2), compile_s=round(compile_s, 2), **overlapped,
       temp_gib=temp_gib, temp_gib_by_program=temp_by_program)
  if args.memory_report:
    sys.path.insert(0, _HERE)
    import hlo_memory
    emit(event="memory", case=name, **hlo_memory.peak_report(
        os.environ["K3JAX_BENCH_DUMP"], "train_step", top=args.memory_top,
        depth=args.memory_depth))
  if args.compile_only:
    return dict(case=name, compile_only=True, shapes_s=round(shapes_s, 2),
                trace_lower_s=round(trace_lower_s, 2), compile_s=round(compile_s, 2),
                temp_gib=temp_gib)

  t0 = time.perf_counter()
  state, m = compiled(state, batches[0])
  loss_first = float(m["loss"])  # blocks on the step
  first_step_s = time.perf_counter() - t0
  startup_s = time.time() - process_start
  emit(event="progress", case=name, first_step_s=round(first_step_s, 2),
       startup_s=round(startup_s, 2))
  for i in range(1, case["warmup"]):
    state, m = compiled(state, batches[i % 2])
  jax.block_until_ready(m)
  times = []
  for i in range(case["steps"]):
    t0 = time.perf_counter()
    state, m = compiled(state, batches[i % 2])
    loss_last = float(m["loss"])
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = batch * seq_len
  flops_per_token = flops_lib.flops_per_token(cfg, seq_len)
  tflops = flops_per_token * tokens / step_s / 1e12
  row = dict(case=name, gin_files=case["gin_files"], bindings=args.gin_bindings, rows=case["rows"],
             batch=batch, seq_len=seq_len, docs_per_row=round(docs, 2),
             microbatches=batch // cfg.stages.microbatch_rows(seq_len, batch),
             steps=case["steps"], step_ms=round(step_s * 1e3, 2),
             step_ms_min=round(min(times) * 1e3, 2), tokens_per_s=round(tokens / step_s),
             gflops_per_token=_sig(flops_per_token / 1e9), tflops=_sig(tflops),
             mfu=_sig(tflops / args.peak_tflops), peak_tflops=args.peak_tflops,
             peak_gib=_peak_gib(), temp_gib=temp_gib, temp_gib_by_program=temp_by_program,
             shapes_s=round(shapes_s, 2), init_s=round(init_s, 2),
             trace_lower_s=round(trace_lower_s, 2), compile_s=round(compile_s, 2), **overlapped,
             first_step_s=round(first_step_s, 2), startup_s=round(startup_s, 2),
             cache_entries_before=entries_before,
             cache_entries_after=_cache_entries(args.cache_dir),
             loss_first=round(loss_first, 4), loss_last=round(loss_last, 4),
             backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))
  if args.profile:
    logdir = os.path.join(args.profile, f"{name}_run{args.run}")
    with jax.profiler.trace(logdir):
      for i in range(args.profile_steps):
        state, m = compiled(state, batches[i % 2])
      jax.block_until_ready(m)
    emit(event="profile", case=name, logdir=logdir,
         **top_kernels(logdir, args.profile_steps, args.profile_top))
    if args.gaps:
      sys.path.insert(0, _HERE)
      import gpu_gaps
      emit(event="gaps", case=name, steps=args.profile_steps, **gpu_gaps.gpu_gaps(logdir))
    if args.memory_report:
      ops, hlo_text = profiled_step(logdir, os.environ["K3JAX_BENCH_DUMP"])
      emit(event="profile_scopes", case=name, **scope_kernel_times(
          ops, hlo_text, args.profile_steps, mcfg, seq_len, top=max(40, args.profile_top)))
      import gemm_rates   # on sys.path since profiled_step
      # The profiled program's matmuls run once per micro-batch: the host loop's micro-batch
      # program is called, and the scan loop's body iterates, `microbatches` times a step.
      runs = row["microbatches"]
      emit(event="gemms", case=name, program_runs_per_step=runs, **gemm_rates.gemm_rates(
          ops, hlo_text, args.profile_steps * runs, args.peak_tflops,
          top=max(40, args.profile_top)))
  return row


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------

def _child(case: dict, args, run: int, cache_dir: str, timeout_s: float) -> None:
  """Runs `case` in a child process; passes its JSON lines through as they come and reports a
  death or timeout as an error line."""
  cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(case),
         f"--run={run}", f"--cache_dir={cache_dir}", f"--doc_len={args.doc_len}",
         f"--peak_tflops={args.peak_tflops}", f"--profile_steps={args.profile_steps}",
         f"--profile_top={args.profile_top}",
         f"--spawn_time={time.time()!r}"]
  cmd += [f"--gin_bindings={b}" for b in args.gin_bindings]
  if args.profile and run == 1:  # the warm re-run runs the same executable
    cmd.append(f"--profile={args.profile}")
    if args.gaps:
      cmd.append("--gaps")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p))
  if args.memory_report and run == 1:  # the warm re-run compiles nothing to dump
    cmd += ["--memory_report", f"--memory_top={args.memory_top}",
            f"--memory_depth={args.memory_depth}"]
    # XLA writes the buffers live at the step's memory peak (hlo_memory.py reads them).
    dump = tempfile.mkdtemp(prefix=f"xla_dump_{case['name']}_")
    env["K3JAX_BENCH_DUMP"] = dump
    env["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), f"--xla_dump_to={dump}",
                                 "--xla_dump_hlo_as_text",
                                 "--xla_dump_hlo_module_re=.*train_step.*"]).strip()
  if args.compile_only:
    cmd.append("--compile_only")
  if args.profile_startup and run == 1:
    cmd.append(f"--profile_startup={args.profile_startup}")
  with tempfile.TemporaryFile(mode="w+") as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=_REPO,
                            env=env)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    finished = False
    for line in proc.stdout:
      if line.startswith("{"):
        print(line, end="", flush=True)
        finished |= '"event": "result"' in line or '"event": "error"' in line
    returncode = proc.wait()
    timed_out = not timer.is_alive() and returncode != 0
    timer.cancel()
    if timed_out:
      emit(event="error", case=case["name"], run=run, error=f"timed out after {timeout_s:.0f} s")
    elif not finished:
      err.seek(0)
      lines = [ln for ln in err.read().splitlines() if ln.strip()]
      emit(event="error", case=case["name"], run=run,
           error=f"exit {returncode}: {lines[-1] if lines else 'no output'}")


def drive(args) -> int:
  cases = case_sets(args.smoke, args)
  deadline = time.time() + args.budget_s
  root = args.cache_dir or tempfile.mkdtemp(prefix="train_bench_cache_")
  emit(event="start", cases=[c["name"] for c in cases], cache_root=root,
       bindings=args.gin_bindings, budget_s=args.budget_s)
  for case in cases:
    # One cache folder per config (+ bindings): its cases share the initialisation's entries.
    key = "_".join(os.path.basename(g).removesuffix(".gin") for g in case["gin_files"])
    cache_dir = os.path.join(root, key)
    rerun = case["warm_rerun"] and not (args.compile_only or args.no_warm_rerun)
    for run in (1, 2) if rerun else (1,):
      left = deadline - time.time()
      if left < 30:
        emit(event="error", case=case["name"], run=run,
             error=f"not started: the --budget_s of {args.budget_s} s is spent")
        continue
      _child(case, args, run, cache_dir, min(args.case_timeout, left))
  return 0


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="throughput",
                 help="'throughput', 'curriculum' or 'one' (module docstring)")
  p.add_argument("--smoke", action="store_true", help="tiny.gin, 2 x 128 tokens, 2 steps (CPU)")
  p.add_argument("--gin_file", action="append", default=None, help="--cases=one: the config")
  p.add_argument("--gin_bindings", action="append", default=[],
                 help="applied to every case's config, e.g. \"ImplConfig.remat = 'full'\"")
  p.add_argument("--seq_len", type=int, default=8192, help="--cases=one: tokens per row")
  p.add_argument("--seq_lens", type=lambda text: [int(x) for x in text.split(",")],
                 default=[8192, 65536, 262144, 1048576],
                 help="--cases=curriculum: row lengths, in the order to run them")
  p.add_argument("--batch", type=int, default=4, help="--cases=one: rows per step")
  p.add_argument("--rows", default="packed", choices=ROWS, help="--cases=one: row kind")
  p.add_argument("--doc_len", type=int, default=8192, help="mean document length of packed rows")
  p.add_argument("--steps", type=int, default=0, help="timed steps (0: by tokens per step)")
  p.add_argument("--warmup", type=int, default=None, help="steps before timing, the first included")
  p.add_argument("--peak_tflops", type=float, default=PEAK_TFLOPS_H200)
  p.add_argument("--profile", default="", help="folder for jax.profiler traces (off if empty)")
  p.add_argument("--profile_steps", type=int, default=3)
  p.add_argument("--gaps", action="store_true",
                 help="with --profile: the GPU's idle time per program and its largest gaps "
                      "(gpu_gaps.py)")
  p.add_argument("--profile_top", type=int, default=15,
                 help="--profile: how many kernels (and, with --memory_report, at least 40 "
                      "scopes) to list, by device time")
  p.add_argument("--memory_report", action="store_true",
                 help="print the buffers alive at the compiled step's memory peak (an XLA dump "
                      "read by hlo_memory.py) as a 'memory' line")
  p.add_argument("--profile_startup", default="",
                 help="folder for a jax.profiler trace of the cold start-up after the "
                      "initialisation (lowering and compiling the step); prints its top host "
                      "events")
  p.add_argument("--memory_top", type=int, default=25,
                 help="--memory_report: how many of the largest buffers and scopes to print")
  p.add_argument("--memory_depth", type=int, default=4,
                 help="--memory_report: path parts of a scope (4: model/period/layer/module)")
  p.add_argument("--no_warm_rerun", action="store_true",
                 help="run each case once (cold); long cases take minutes a step")
  p.add_argument("--sequential_startup", action="store_true",
                 help="initialise the state, then trace and compile the step (the start-up "
                      "before the training CLI overlapped them); --profile_startup implies it")
  p.add_argument("--compile_only", action="store_true",
                 help="stop each case after compiling the step against the state's shapes (no "
                      "state is initialised, no step runs)")
  p.add_argument("--cache_dir", default="",
                 help="driver: root of the per-config persistent cache folders (default: a new "
                      "temporary folder, so that the first run is cold); child: the folder")
  p.add_argument("--case_timeout", type=float, default=360.0, help="seconds per child process")
  p.add_argument("--budget_s", type=float, default=570.0, help="seconds for the whole driver")
  p.add_argument("--child", default="", help=argparse.SUPPRESS)
  p.add_argument("--run", type=int, default=1, help=argparse.SUPPRESS)
  p.add_argument("--spawn_time", type=float, default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.gaps and not args.profile:
    p.error("--gaps reads the profile: give --profile=FOLDER too")
  if args.smoke:
    args.doc_len = min(args.doc_len, 48)  # several documents in a 128-token row
    # Two micro-batches of one row (RuntimeConfig.microbatch_loop has a loop to run); a later
    # --gin_bindings wins.
    args.gin_bindings = ["StagesConfig.microbatch_tokens = 128"] + args.gin_bindings
  if not args.child:
    return drive(args)
  case = json.loads(args.child)
  try:
    emit(event="result", run=args.run,
         **run_case(case, args, args.spawn_time or _PROCESS_START))
  except Exception as e:  # an OOM or a compile failure: one line, the driver goes on
    emit(event="error", case=case["name"], run=args.run, error=first_line(e))
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
