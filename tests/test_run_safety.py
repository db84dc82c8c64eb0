"""A run directory has one writer, a refused write is one line, and a failed start-up leaves
nothing behind: the train command in subprocesses, each case as a user would meet it.

Every case trains the tests' tiny config for a step or none (--max_steps=0: set-up, restore and the
config, no step), with the suite's compilation cache (conftest.py). Exit codes: 2 a bad setting or
a directory in use, 3 a write the filesystem refused (README.md).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from k3jax.training import run_dir
from testlib import TINY_RUN_BINDINGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [f"--gin_bindings={b}" for b in TINY_RUN_BINDINGS + [
    "EvalConfig.num_batches = 1", "EvalConfig.passkey_multipliers = ()",
    "EvalConfig.every_steps = 0", "CheckpointConfig.every_steps = 1",
    "CheckpointConfig.async_save = False"]]


def train(workdir, *args, patch: str = "", timeout: int = 600):
  """`k3jax train` on the tiny config; `patch`: Python run in the process first (an injected
  failure)."""
  script = textwrap.dedent(patch) + textwrap.dedent("""
      import sys
      from k3jax import cli
      cli.main(["k3jax", "train"] + sys.argv[1:])
  """)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", script, f"--workdir={workdir}", "--noprogress",
                         "--notensorboard", *TINY, *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def one_line(proc, code: int, *parts: str) -> str:
  """Exit code `code` and stderr exactly one line 'error: ...' holding every part."""
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  for part in parts:
    assert part in lines[0], (part, lines[0])
  return lines[0]


def listing(folder) -> dict:
  """{relative path: (size, mtime)} of every file under `folder`."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      out[os.path.relpath(path, folder)] = (os.path.getsize(path), os.path.getmtime(path))
  return out


def lock_file(workdir, **holder):
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, run_dir.LOCK_FILE), "w") as f:
    json.dump({"started": "2026-01-01 00:00:00", "command": "k3jax train ...", **holder}, f)


def dead_pid() -> int:
  """The pid of a process that has ended."""
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)


# ------------------------------------------------------------------------------------------------
# One writer per run directory
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_trainer_stops_at_once_and_the_first_runs_alone(tmp_path):
  """While a first trainer holds the directory (its lock file exists), a second one with another
  learning rate exits 2 with one line naming the holder; the first finishes as if alone: its own
  config, each step logged once, its checkpoints."""
  workdir = tmp_path / "run"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
             JAX_PLATFORMS="cpu")
  first = subprocess.Popen(
      [sys.executable, "-m", "k3jax.train", f"--workdir={workdir}", "--noprogress",
       "--notensorboard", *TINY, "--max_steps=3"],
      cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lock = workdir / run_dir.LOCK_FILE
  while not lock.exists() and first.poll() is None:
    time.sleep(0.05)
  assert first.poll() is None, first.communicate()
  holder = json.loads(lock.read_text())
  second = train(workdir, "--gin_bindings=OptimizerConfig.learning_rate = 0.5",
                 "--max_steps=3")
  out, err = first.communicate(timeout=600)
  assert holder["pid"] == first.pid
  one_line(second, 2, f"--workdir={workdir} is in use by another training run",
           f"pid {first.pid}")
  assert first.returncode == 0, err[-3000:]
  assert "learning_rate = 0.5" not in (workdir / "config.gin").read_text()
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records if r["kind"] == "train"]
  assert steps == sorted(set(steps)) and steps[-1] == 3
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]   # keep_last 2
  assert not lock.exists()            # released at the end


@pytest.mark.parametrize("holder,args,code,message", [
    # A lock left by a process of this host that is gone: taken over, and said.
    ("dead_here", [], 0, "taking over the lock"),
    # Held from another host: not checkable from here, so only an explicit flag takes it.
    ("other_host", [], 2, "--take_over_lock"),
    ("other_host", ["--take_over_lock"], 0, "(--take_over_lock)"),
    # A live process of this host (this test's own): the directory is in use.
    ("alive_here", [], 2, "is in use by another training run"),
], ids=["stale_here", "other_host", "other_host_taken", "alive_here"])
def test_a_lock_left_behind(tmp_path, holder, args, code, message):
  workdir = tmp_path / "run"
  host = run_dir.socket.gethostname()
  lock_file(workdir, **{"dead_here": dict(host=host, pid=dead_pid()),
                        "other_host": dict(host="another-host", pid=os.getpid()),
                        "alive_here": dict(host=host, pid=os.getpid())}[holder])
  before = listing(workdir)
  proc = train(workdir, "--max_steps=0", *args)
  if code:
    one_line(proc, code, message)
    assert listing(workdir) == before       # nothing touched
  else:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert message in proc.stderr and "note: taking over the lock" in proc.stderr
    assert not (workdir / run_dir.LOCK_FILE).exists() and (workdir / "config.gin").exists()


def test_lock_unit():
  """The lock's own rules, in process: exclusive, released only by its holder."""
  import tempfile
  with tempfile.TemporaryDirectory() as workdir:
    with run_dir.RunLock(workdir) as lock:
      assert json.load(open(lock.path))["pid"] == os.getpid()
      with pytest.raises(run_dir.RunLockedError, match="in use by another training run"):
        run_dir.RunLock(workdir).acquire()
    assert not os.path.exists(lock.path)
    # The holder's command is named by its gist: a long command line is cut at 120 characters.
    lock_file(workdir, host=run_dir.socket.gethostname(), pid=os.getpid(),
              command="k3jax train " + "--gin_bindings=x " * 50)
    with pytest.raises(run_dir.RunLockedError) as raised:
      run_dir.RunLock(workdir).acquire()
    assert len(str(raised.value)) < 400 and "k3jax train --gin_bindings=x" in str(raised.value)


# ------------------------------------------------------------------------------------------------
# Writes the filesystem refuses
# ------------------------------------------------------------------------------------------------

_ENOSPC = "OSError(errno.ENOSPC, 'No space left on device', {path!r})"
# Where a run writes, each made to fail as the disk would (the module patched, the step at which it
# fails): a checkpoint (ENOSPC as orbax reports it, the OSError inside its own error), a metrics
# record (EACCES), the config and the end-of-run report (ENOSPC).
WRITE_SITES = {
    "checkpoint": f"""
        import errno
        from k3jax.training import checkpoint
        save = checkpoint.Checkpointer.save
        def failing(self, step, **kw):
          if step == 2:
            raise ValueError('RESOURCE_EXHAUSTED: Error writing local file "' + self.directory +
                             '/2.orbax-checkpoint-tmp/x": No space left on device')
          return save(self, step, **kw)
        checkpoint.Checkpointer.save = failing
    """,
    # A permission error (a run directory whose permissions changed under the run).
    "metrics_permission": f"""
        import errno
        from k3jax.training import metrics
        write = metrics.MetricsWriter.write
        def failing(self, step, kind, values):
          if step == 3:
            raise PermissionError(errno.EACCES, 'Permission denied', 'metrics.jsonl')
          return write(self, step, kind, values)
        metrics.MetricsWriter.write = failing
    """,
    "config": f"""
        import errno
        from k3jax.training import run_dir
        def failing(workdir, cfg):
          raise {_ENOSPC.format(path='config.gin')}
        run_dir.write_config = failing
    """,
    "report": f"""
        import errno
        from k3jax.training import loop
        def failing(*args, **kwargs):
          raise {_ENOSPC.format(path='plots/loss.png')}
        loop.write_report = failing
    """,
}


@pytest.mark.parametrize("site", list(WRITE_SITES))
def test_a_refused_write_is_one_line_and_the_last_checkpoint_restores(tmp_path, site):
  workdir = tmp_path / "run"
  proc = train(workdir, "--max_steps=3", patch=WRITE_SITES[site])
  if site == "metrics_permission":
    line = one_line(proc, 3, "permission denied: writing metrics.jsonl failed", "Nothing was lost",
                    "give this user write access to the run directory")
  else:
    line = one_line(proc, 3, "no space left on the device", "Nothing was lost", "make room")
  checkpoints = workdir / "checkpoints"
  if site == "config":     # before any step: no checkpoint, and the new directory is removed
    assert "no checkpoint was written yet" in line and not workdir.exists()
    return
  last = {"checkpoint": 1, "metrics_permission": 2, "report": 3}[site]   # checkpoints every step
  assert f"the last complete checkpoint is step {last}" in line
  assert not [n for n in os.listdir(checkpoints) if "tmp" in n]
  assert not (workdir / run_dir.LOCK_FILE).exists()
  if site != "checkpoint":
    return   # resuming after a refused write is the same for every site (the suite's time)
  # The same command resumes from that checkpoint once the disk has room again: the half-written
  # checkpoint is gone.
  again = train(workdir, "--max_steps=3")
  assert again.returncode == 0, again.stderr[-3000:]
  assert (f"resuming from step {last}" in again.stdout or last == 3), again.stdout


def test_a_full_disk_stops_before_the_checkpoint(tmp_path, monkeypatch):
  """The space check before a checkpoint: too little room is one RunWriteError naming the
  checkpoint, the sizes and the last complete step."""
  monkeypatch.setattr(run_dir, "free_bytes", lambda path: 3 * 2**20)
  with pytest.raises(run_dir.RunWriteError, match=r"checkpoint step 14 in .*needs about 5\.0 MiB, "
                     r"3\.0 MiB are free\. Nothing was lost: the last complete checkpoint is step "
                     r"12"):
    run_dir.check_space(str(tmp_path), 5 * 2**20, "checkpoint step 14", 12)
  run_dir.check_space(str(tmp_path), 2 * 2**20, "checkpoint step 14", 12)


@pytest.mark.parametrize("error,what", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    (ValueError('RESOURCE_EXHAUSTED: Failed to write 26199 bytes to file 8: No space left on '
                'device [os_error_code=\'28\']'), "no space left on the device"),
    (RuntimeError("Save Finalize thread failed"), None),
])
def test_write_failure_reads_the_errors_that_orbax_raises(error, what):
  wrapped = RuntimeError("wait_until_finished failed")
  wrapped.__cause__ = error
  assert run_dir.write_failure(error) == what
  assert run_dir.write_failure(wrapped) == what


# An 8 MiB disk in the process, where the machine does not let a test mount one: the free space
# that the run sees is 8 MiB less what its directory holds.
_SMALL_DISK = """
    import os
    from k3jax.training import run_dir
    def free_bytes(path):
      root = path
      while not os.path.basename(root) == "run":
        root = os.path.dirname(root)
      used = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
      return 8 * 2**20 - used
    run_dir.free_bytes = free_bytes
"""


@pytest.mark.slow
def test_a_small_disk_that_fills(tmp_path):
  """On an 8 MiB filesystem (a tmpfs where this machine lets a test mount one, else one simulated
  in the process): the run stops at the checkpoint that no longer fits, in one line, and the last
  complete one restores."""
  mount = tmp_path / "disk"
  mount.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
                           capture_output=True).returncode == 0
  try:
    proc = train(mount / "run", "--max_steps=40",
                 "--gin_bindings=StagesConfig.stages = ((16, 40),)",
                 "--gin_bindings=CheckpointConfig.keep_last = 100",
                 patch="" if mounted else _SMALL_DISK)
    line = one_line(proc, 3, "no space left for checkpoint step", "Nothing was lost")
    last = int(line.split("the last complete checkpoint is step ")[1].split(";")[0])
    assert last >= 2 and str(last) in os.listdir(mount / "run" / "checkpoints")
    from k3jax.training import checkpoint
    _, _, _, meta = checkpoint.restore_run(str(mount / "run"), log=lambda _: None)
    assert meta["step"] == last
  finally:
    if mounted:
      subprocess.run(["umount", str(mount)], check=False)


# ------------------------------------------------------------------------------------------------
# Start-ups that fail
# ------------------------------------------------------------------------------------------------

def test_a_schedule_that_no_longer_reaches_the_checkpoint(tmp_path):
  """A run at step 3 restarted with stages of 2 steps in all: one line naming the step and the
  stages, and the run directory untouched."""
  workdir = tmp_path / "run"
  assert train(workdir, "--max_steps=3").returncode == 0
  before = listing(workdir)
  proc = train(workdir, "--gin_bindings=StagesConfig.stages = ((16, 2),)")
  one_line(proc, 2, "holds checkpoint step 3, past the end of StagesConfig.stages = ((16, 2),)",
           "(2 steps)")
  assert listing(workdir) == before


@pytest.mark.parametrize("case", ["bad_data", "init_fails"])
def test_a_failed_start_up_leaves_no_workdir(tmp_path, case):
  """Data that cannot be read stops before any directory is made; a start-up that fails later
  (here the state's initialisation) removes the directory it made."""
  workdir = tmp_path / "run"
  if case == "bad_data":
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "latin1.txt").write_bytes("café".encode("latin-1") * 100)
    proc = train(workdir, "--gin_bindings=DataConfig.source = 'text'",
                 f"--gin_bindings=DataConfig.path = '{corpus}'")
    one_line(proc, 2, "latin1.txt")
  else:
    proc = train(workdir, patch="""
        from k3jax.training import loop
        def failing(*args, **kwargs):
          raise RuntimeError("the initialisation failed")
        loop.init_train_state = failing
    """)
    assert proc.returncode == 1 and "the initialisation failed" in proc.stderr
  assert not workdir.exists()
