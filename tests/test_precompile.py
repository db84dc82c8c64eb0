"""k3jax.runtime.precompile: programs compiled in background threads are what the caller's own
calls then read from the persistent compilation cache (no second compile in the calling thread);
failures are reported and left to the caller; a run with RuntimeConfig.precompile = 'on' trains
the losses of a run without it. Each test runs in a subprocess: JAX's persistent cache is set up
once per process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Records which thread compiled or read each program ('jax._src.compiler' logs both at DEBUG).
_LOG_SETUP = """
import logging, threading
EVENTS = []
class Record(logging.Handler):
  def emit(self, r):
    text = r.getMessage()
    for kind, marker in (("hit", "cache hit for '"), ("miss", "CACHE MISS for '")):
      if marker in text:
        EVENTS.append((r.threadName, kind, text.split(marker)[1].split("'")[0]))
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Record())
"""


def _python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.path.join(_REPO, "tests"),
                                         os.environ.get("PYTHONPATH", "")]))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=_REPO)
  assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
  return out


def test_background_compiles_are_read_back_by_the_callers_calls(tmp_path):
  script = _LOG_SETUP + textwrap.dedent("""
      import json, sys
      import jax, jax.numpy as jnp
      from k3jax.runtime import compiler, precompile
      try:
        precompile.Precompiler(1)
      except ValueError as e:
        no_cache = str(e)
      compiler.enable_compilation_cache(sys.argv[1])
      f = jax.jit(lambda x: jnp.sin(x) @ x.T, donate_argnums=0)
      g = jax.jit(lambda x, y: jnp.cumsum(x * y, axis=0))
      x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
      pre = precompile.Precompiler(2)
      pre.submit("f program", lambda: f.lower(x))
      pre.submit("g program", lambda: g.lower(x, x))
      pre.submit("broken program", lambda: g.lower(x, jax.ShapeDtypeStruct((3,), jnp.float32)))
      reports = {n: pre.wait(n) for n in ("f program", "g program", "broken program")}
      small = precompile.Precompiler(1, memory_advice=lambda name: f"(settings for {name})")
      small._limit = 1024   # a device of 1 KiB: every program is too large
      small.submit("h program", lambda: jax.jit(lambda x: x @ x).lower(x))
      small.wait("h program")
      f(jnp.ones((64, 64))).block_until_ready()
      g(jnp.ones((64, 64)), jnp.ones((64, 64))).block_until_ready()
      print(json.dumps({"reports": reports, "events": EVENTS, "no_cache": no_cache,
                        "again": pre.wait("f program")}))
  """)
  out = _python(script, str(tmp_path / "cache"))
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert "persistent compilation cache" in result["no_cache"]
  for name in ("f program", "g program"):
    assert result["reports"][name]["compile_s"] >= 0 and "error" not in result["reports"][name]
  assert "error" in result["reports"]["broken program"]
  assert "compiling the broken program in the background failed" in out.stderr
  assert result["again"] is None
  assert ("the h program needs" in out.stderr and "of the device's 0.0 GiB: it will run out of "
          "memory when the run gets there. (settings for h program)" in out.stderr), out.stderr
  events = [tuple(e) for e in result["events"]]
  # Each program compiled once, in a background thread; the main thread's calls compile nothing
  # (they read the programs back from the persistent cache, or reuse them in memory).
  main = [kind for thread, kind, name in events if thread == "MainThread" and name == "jit__lambda"]
  background = [kind for thread, kind, name in events if thread != "MainThread"]
  assert "miss" not in main and background == ["miss"] * 3, events   # f, g and h


@pytest.mark.slow
def test_run_with_precompile_trains_the_same_losses_and_compiles_its_steps_in_the_background(
    tmp_path):
  """tiny run, two stages, two micro-batches a step: with 'on', the loop's own calls of the
  training steps and validation programs compile nothing (the background threads did), and the
  losses are those of 'off': on one device with the micro-batches in one program a step ('scan'),
  and on a data:2 x expert:4 mesh of CPU devices with the host micro-batch loop, whose losses are
  the one-device scan's up to the summation order (the two loops share their arithmetic,
  test_microbatch_loop). The one-device 'off' run reads the 'on' run's cache folder and must
  compile nothing: the background threads compiled exactly the programs that the plain loop runs
  (and the suite saves that run's compiles). The mesh and the host loop share one run, stopped by
  max_steps in the first stage: the background compiles that stage's programs and none of the
  second's."""
  script = _LOG_SETUP + textwrap.dedent("""
      import json, sys
      import jax
      jax.config.update("jax_num_cpu_devices", 8)
      from k3jax import config as config_lib, training as train_lib
      from k3jax.runtime import compiler
      from k3jax.training import metrics
      from testlib import TINY_RUN_BINDINGS
      compiler.enable_compilation_cache(sys.argv[1])
      mode, axes, loop = (sys.argv[3] + "@scan").split("@")[:3]
      cfg = config_lib.from_gin(["gin_configs/tiny.gin"], TINY_RUN_BINDINGS + [
          f"RuntimeConfig.precompile = '{mode}'", f"MeshConfig.axes = '{axes}'",
          # two micro-batches a step: 16 rows at stage 1 and 8 at stage 2, which the mesh's 8
          # batch shards split
          "StagesConfig.tokens_per_step = 512", "StagesConfig.microbatch_tokens = 256",
          "ModelConfig.moe_num_experts = 8", f"RuntimeConfig.microbatch_loop = '{loop}'",
          # The evaluation's forward programs at 1-8x the length are not what this test checks.
          "EvalConfig.passkey_multipliers = ()", "EvalConfig.log_every_steps = 1"])
      max_steps = int(sys.argv[4]) if len(sys.argv) > 4 else None
      train_lib.train(cfg, sys.argv[2], max_steps=max_steps, progress=False, tensorboard=False)
      losses = [r["loss"] for r in metrics.read_jsonl(sys.argv[2] + "/metrics.jsonl")
                if r["kind"] == "train"]
      print(json.dumps({"events": EVENTS, "losses": losses}))
  """)
  runs = {}
  mesh_host = "on@data:2,expert:4@host"
  folder = lambda mode: mode.replace(":", "").replace(",", "_").replace("@", "_")
  cache_of = {"off@": "on@"}   # the run whose cache folder a run reads (default: its own)
  max_steps = {mesh_host: ("3",)}   # the end of the first stage (3 steps of 16 tokens)
  for mode in ("on@", "off@", mesh_host):
    out = _python(script, str(tmp_path / f"cache_{folder(cache_of.get(mode, mode))}"),
                  str(tmp_path / folder(mode)), mode, *max_steps.get(mode, ()))
    runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    if mode.startswith("on"):
      last = "stage 0 (16 tokens)" if mode in max_steps else "stage 1 (32 tokens)"
      assert f"train step of {last}: compiled in the background" in out.stdout, out.stdout
  assert runs["on@"]["losses"] == runs["off@"]["losses"]
  # On a mesh (training steps only: the evaluation's arguments are placed by its call), with the
  # host micro-batch loop: the one-device scan's first-stage losses up to the summation order
  # (the same schedule: max_steps does not change it).
  assert len(runs["off@"]["losses"]) == 6 and len(runs[mesh_host]["losses"]) == 3
  for got, want in zip(runs[mesh_host]["losses"], runs["off@"]["losses"]):
    assert abs(got - want) <= 1e-5 * abs(want)
  # Two stages: two training steps and two validation programs, compiled once each. 'off@' finds
  # all four in the cache that 'on@' filled. The mesh run stops in the first stage: that stage's
  # prepare, micro-batch and update programs of the host loop, nothing of the second stage (whose
  # prepare and micro-batch programs would make 5).
  host_programs = ("jit_train_step_prepare", "jit_train_step_microbatch", "jit_train_step_update")
  for mode, programs, expect in (("on@", ("jit_train_step", "jit_loss_and_stats"), (0, 4)),
                                 ("off@", ("jit_train_step", "jit_loss_and_stats"), (0, 0)),
                                 (mesh_host, host_programs, (0, 3))):
    events = [tuple(e) for e in runs[mode]["events"] if e[2] in programs]
    main_misses = [e for e in events if e[0] == "MainThread" and e[1] == "miss"]
    other = [e for e in events if e[0] != "MainThread" and e[1] == "miss"]
    assert (len(main_misses), len(other)) == expect, (mode, events)
    if mode == "off@":   # ... and read every one of them
      assert len([e for e in events if e[1] == "hit"]) == 4, events


def test_run_programs_refuse_a_stage_range_outside_the_curriculum():
  """`start_run_programs` names a range of stages that tiny.gin's four do not hold, before it
  starts anything."""
  from k3jax import config as config_lib
  from k3jax.runtime import precompile
  cfg = config_lib.from_gin([os.path.join(_REPO, "gin_configs", "tiny.gin")], [])
  for first, last in ((2, 1), (0, 4), (-1, 3)):
    with pytest.raises(ValueError, match=rf"stages {first} to {last}: not a range of the 4 stages"):
      precompile.start_run_programs(cfg, first, None, None, None, last_stage=last)


def test_close_drops_queued_programs_and_exit_process_leaves_while_one_is_running():
  """After `close`, queued programs are cancelled (nothing compiles them); a process whose
  background thread is still lowering exits at once through `exit_process`, with its code and
  its printed output, instead of finalising the interpreter under the thread (or waiting for it):
  the lowering, which blocks on an event that nobody sets (60 s at most), never gets to print
  that it finished."""
  script = textwrap.dedent("""
      import sys, threading
      import jax, jax.numpy as jnp
      from k3jax.runtime import compiler, precompile
      compiler.enable_compilation_cache(sys.argv[1])
      x = jax.ShapeDtypeStruct((8,), jnp.float32)
      pre = precompile.Precompiler(1)
      started, never = threading.Event(), threading.Event()
      def slow_lower():
        started.set()
        never.wait(60)
        print("slow lowering finished", flush=True)
        return jax.jit(jnp.sin).lower(x)
      pre.submit("slow program", slow_lower)
      pre.submit("queued program", lambda: jax.jit(jnp.cos).lower(x))
      started.wait()
      assert precompile.background_work_running()
      pre.close()
      print("queued program:", pre.wait("queued program"))
      print("before exit", flush=False)
      precompile.exit_process(3)
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
  import tempfile
  with tempfile.TemporaryDirectory() as cache:
    out = subprocess.run([sys.executable, "-c", script, cache], capture_output=True, text=True,
                         timeout=120, env=env, cwd=_REPO)
  assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
  assert ("queued program: {'error': 'cancelled: the precompiler was closed before it started'}"
          in out.stdout and "before exit" in out.stdout), out.stdout
  assert "leaving the programs still compiling in the background unfinished" in out.stderr
  # Did not wait for the lowering: it would have printed this when it ended.
  assert "slow lowering finished" not in out.stdout, out.stdout


def test_idle_precompiler_lets_the_process_exit_normally(tmp_path):
  script = textwrap.dedent("""
      import sys
      import jax, jax.numpy as jnp
      from k3jax.runtime import compiler, precompile
      compiler.enable_compilation_cache(sys.argv[1])
      pre = precompile.Precompiler(2)
      pre.submit("p", lambda: jax.jit(jnp.sin).lower(jax.ShapeDtypeStruct((8,), jnp.float32)))
      pre.wait("p")
      pre.close()
      assert not precompile.background_work_running()
      import atexit
      atexit.register(lambda: print("atexit ran"))
      precompile.exit_process(0)
  """)
  out = _python(script, str(tmp_path / "cache"))
  assert "atexit ran" in out.stdout and "unfinished" not in out.stderr


def test_wait_lowered_returns_once_traced_while_the_compile_goes_on(tmp_path):
  """`wait_lowered` lets the caller start its own tracing as soon as the program is lowered; the
  compile is still running then (its report comes from `wait`): the compile blocks until the
  caller, past `wait_lowered`, releases it (60 s at most), so it cannot have finished before
  `wait_lowered` returned, and it was released rather than timed out."""
  script = textwrap.dedent("""
      import json, sys, threading
      import jax, jax.numpy as jnp
      from k3jax.runtime import compiler, precompile
      compiler.enable_compilation_cache(sys.argv[1])
      x = jax.ShapeDtypeStruct((8,), jnp.float32)
      pre = precompile.Precompiler(1)
      release, compiled = threading.Event(), threading.Event()
      released = []
      class SlowCompile:
        def __init__(self, lowered):
          self.lowered = lowered
        def compile(self):
          released.append(release.wait(60))
          result = self.lowered.compile()
          compiled.set()
          return result
      pre.submit("p", lambda: SlowCompile(jax.jit(jnp.sin).lower(x)))
      pre.wait_lowered("p")
      pre.wait_lowered("never submitted")
      compiled_when_lowered = compiled.is_set()
      release.set()
      report = pre.wait("p")
      print(json.dumps({"compiled_when_lowered": compiled_when_lowered, "released": released,
                        "compiled": compiled.is_set(), "report": report}))
  """)
  out = _python(script, str(tmp_path / "cache"))
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert not result["compiled_when_lowered"] and result["released"] == [True], result
  assert result["compiled"] and "error" not in result["report"], result
