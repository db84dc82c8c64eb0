"""A run directory's own files besides checkpoints and metrics: the operative configuration, the
lock that keeps one writer per directory, and the checks of writes the filesystem refuses.

DIR/config.gin holds `config.to_gin(cfg)` (every field of every part; re-parsable) and
DIR/config.json the same as JSON. A resumed run compares the stored config with its own and names
each changed setting; evaluation and generation rebuild the run's Config from config.gin. A
config.gin written before a setting moved (`config.MOVED_FIELDS`) is read with its new name, and
one written before a setting of `config.ADDED_FIELDS` existed with the value that computes what
the code then did.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import socket
import sys
import time
from typing import Callable

from k3jax import config as config_lib

CONFIG_GIN = "config.gin"


def write_config(workdir: str, cfg: config_lib.Config) -> None:
  """Writes DIR/config.gin (re-parsable with `read_config`) and DIR/config.json."""
  with open(os.path.join(workdir, CONFIG_GIN), "w") as f:
    f.write(config_lib.to_gin(cfg))
  with open(os.path.join(workdir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)


def _stored_text(workdir: str, log: Callable[[str], None]) -> str | None:
  """DIR/config.gin's bindings with moved settings renamed (said once through `log`) and the
  `config.ADDED_FIELDS` it lacks at their old values, or None when the directory has none."""
  path = os.path.join(workdir, CONFIG_GIN)
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    text, renamed = config_lib.renamed_settings(f.read())
  if renamed:
    log(f"{path} was written with settings that have since moved; read as: " + "; ".join(renamed))
  stored = {line.split("=", 1)[0].strip() for line in text.splitlines() if "=" in line}
  for name, value in config_lib.ADDED_FIELDS.items():
    if name not in stored:  # written before the setting existed: what the code then computed
      text += ("" if text.endswith("\n") or not text else "\n") + f"{name} = {value!r}\n"
  return text


def read_config(workdir: str, log: Callable[[str], None] = lambda line: print(
    f"note: {line}", file=sys.stderr)) -> config_lib.Config:
  """The Config of the run in `workdir` (its config.gin, `from_gin`-validated).

  Raises FileNotFoundError when the directory holds no config.gin (not a k3jax run).
  """
  text = _stored_text(workdir, log)
  if text is None:
    raise FileNotFoundError(f"--workdir={workdir!r} has no {CONFIG_GIN} (not a k3jax training "
                            "run?)")
  bindings = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
  return config_lib.from_gin([], bindings)


def gin_settings(gin_text: str) -> dict[str, str]:
  """{'Configurable.field': value text} of a config text as `config.to_gin` writes it (one
  'Name.field = value' per line; comments and blank lines skipped)."""
  out = {}
  for line in gin_text.splitlines():
    if "=" in line and not line.lstrip().startswith("#"):
      name, value = line.split("=", 1)
      out[name.strip()] = value.strip()
  return out


def config_differences(old_gin: str, new_gin: str, defaults_gin: str = "") -> list[str]:
  """'Configurable.field: old -> new' for every binding that differs between two config.gin texts
  (as `config.to_gin` writes them, `gin_settings`). A field the old text lacks and the new one
  holds at its value in `defaults_gin` is not a difference: the field is newer than the old
  text, and its default keeps what the old code computed."""
  old, new, defaults = gin_settings(old_gin), gin_settings(new_gin), gin_settings(defaults_gin)
  return [f"{name}: {old.get(name, '(unset)')} -> {new.get(name, '(unset)')}"
          for name in sorted(set(old) | set(new)) if old.get(name) != new.get(name)
          and not (name not in old and name in defaults and new[name] == defaults[name])]


def changed_settings(workdir: str, cfg: config_lib.Config) -> list[str]:
  """'Configurable.field: old -> new' between the run so far (DIR/config.gin) and `cfg`; empty
  for a new run."""
  text = _stored_text(workdir, log=lambda line: None)
  if text is None:
    return []
  return config_differences(text, config_lib.to_gin(cfg), config_lib.to_gin(config_lib.Config()))


# ------------------------------------------------------------------------------------------------
# One writer per run directory
# ------------------------------------------------------------------------------------------------

LOCK_FILE = ".k3jax-run.lock"


class RunLockedError(config_lib.ConfigError):
  """Another training process holds the run directory's lock; nothing was touched."""


class RunLock:
  """The run directory's lock: DIR/.k3jax-run.lock, JSON {'host', 'pid', 'started', 'command'}.

  `acquire` creates the file atomically (O_EXCL), so of two trainers started on one directory only
  one proceeds; the other gets RunLockedError naming the holder. A lock whose process is gone (the
  same host, no such pid: a `kill -9`, a crash) is taken over, and the takeover is said through
  `log`. A lock held from another host cannot be checked from here: it is taken over only with
  `take_over=True` (the train command's --take_over_lock), after its holder is known to be gone.
  `release` removes the file if it is still this process's. Use as a context manager. Only the
  first process of a multi-process run takes the lock (the caller decides).
  """

  def __init__(self, workdir: str, take_over: bool = False,
               log: Callable[[str], None] = lambda line: print(f"note: {line}", file=sys.stderr)):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._take_over = take_over
    self._log = log
    self._mine = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}
    self._held = False

  def __enter__(self) -> "RunLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> bool:
    self.release()
    return False

  def _holder(self) -> dict:
    try:
      with open(self.path) as f:
        return json.load(f)
    except (OSError, ValueError):
      return {}   # unreadable: being written right now, or damaged

  def acquire(self) -> None:
    """Takes the lock, or raises RunLockedError naming its holder."""
    text = json.dumps(self._mine)
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      self._take_over_stale()
    else:
      with os.fdopen(fd, "w") as f:
        f.write(text)
    self._held = True

  def _take_over_stale(self) -> None:
    holder = self._holder()
    command = str(holder.get("command", "?"))
    if len(command) > 120:   # the gist: the program and its first arguments (often --workdir)
      command = command[:117] + "..."
    who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started "
           f"{holder.get('started', '?')}: {command}")
    workdir = os.path.dirname(self.path)
    if holder.get("host") == self._mine["host"]:
      if _process_alive(holder.get("pid")):
        raise RunLockedError(f"--workdir={workdir} is in use by another training run ({who}); "
                             "wait for it to end, or use another --workdir")
      self._log(f"taking over the lock of {workdir}: its run ({who}) is gone")
    elif not self._take_over:
      raise RunLockedError(
          f"--workdir={workdir} is locked by a training run on another host ({who}); if that "
          "run is gone, start again with --take_over_lock")
    else:
      self._log(f"taking over the lock of {workdir} from {who} (--take_over_lock)")
    tmp = f"{self.path}.{os.getpid()}"
    with open(tmp, "w") as f:
      f.write(json.dumps(self._mine))
    os.replace(tmp, self.path)
    # Two processes that found the same stale lock both replaced it: the last one holds it.
    if self._holder().get("pid") != self._mine["pid"] or self._holder().get(
        "host") != self._mine["host"]:
      raise RunLockedError(f"--workdir={workdir} was just taken over by another training run "
                           f"({self._holder().get('pid', '?')} on "
                           f"{self._holder().get('host', '?')}); use another --workdir")

  def release(self) -> None:
    """Removes the lock file if this process holds it."""
    if self._held and self._holder().get("pid") == self._mine["pid"]:
      try:
        os.remove(self.path)
      except OSError:
        pass
    self._held = False


def _process_alive(pid) -> bool:
  """Whether a process with this pid runs on this host (a zombie counts as gone)."""
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True   # someone else's process
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except OSError:
    return True


# ------------------------------------------------------------------------------------------------
# Writes the filesystem refuses
# ------------------------------------------------------------------------------------------------

class RunWriteError(RuntimeError):
  """The filesystem refused a write of the run (no space left, no permission): the message is one
  line naming the path and what to do; the last complete checkpoint is untouched."""


_WRITE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                 errno.EACCES: "permission denied", errno.EPERM: "permission denied",
                 errno.EROFS: "read-only file system"}
_WRITE_TEXTS = {"No space left on device": "no space left on the device",
                "Disk quota exceeded": "disk quota exceeded",
                "Permission denied": "permission denied",
                "Read-only file system": "read-only file system"}


def write_failure(error: BaseException) -> str | None:
  """What the filesystem refused, when `error` (or an exception it was raised from) is a refused
  write: 'no space left on the device', 'permission denied', ...; None otherwise. orbax and
  tensorstore report such errors as text inside their own exception types."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _WRITE_ERRNOS:
      return _WRITE_ERRNOS[error.errno]
    for text, what in _WRITE_TEXTS.items():
      if text in str(error):
        return what
    error = error.__cause__ or error.__context__
  return None


def free_bytes(path: str) -> int:
  """Free bytes on the filesystem of `path` (or of its nearest existing parent)."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return shutil.disk_usage(path).free


def check_space(path: str, needed: int, what: str, last_checkpoint) -> None:
  """RunWriteError when the filesystem of `path` has less than `needed` bytes free."""
  free = free_bytes(path)
  if free < needed:
    raise RunWriteError(
        f"no space left for {what} in {path}: it needs about {needed / 2**20:.1f} MiB, "
        f"{free / 2**20:.1f} MiB are free. {resume_advice(last_checkpoint)}")


def resume_advice(last_checkpoint, what: str = "no space left on the device") -> str:
  """What survived a refused write and how to go on, for `what` (as `write_failure` says it)."""
  where = ("the last complete checkpoint is step " + str(last_checkpoint)
           if last_checkpoint is not None else "no checkpoint was written yet")
  fix = {"permission denied": "give this user write access to the run directory",
         "read-only file system": "make the run directory writable"}.get(what, "make room")
  return f"Nothing was lost: {where}; {fix} and run the same command again to resume."


# ------------------------------------------------------------------------------------------------
# The directory of a training run
# ------------------------------------------------------------------------------------------------

class RunDirectory:
  """A training run's directory while the run writes it: a context manager that creates the
  directory, takes its lock (`RunLock`; only `lock=True`, the first process of a run), and on the
  way out releases the lock and, when the run failed before `started()` in a directory it created,
  removes the directory, so that a start-up that fails leaves nothing behind.

  Raises ConfigError when the path is a file, cannot be created or is not writable, and
  RunLockedError when another run holds it.
  """

  def __init__(self, workdir: str, *, lock: bool = True, take_over_lock: bool = False):
    self.path = workdir
    self._lock = RunLock(workdir, take_over=take_over_lock) if lock else None
    self._created = False
    self._started = False

  def started(self) -> None:
    """The run has written its config: from here on the directory is kept whatever happens."""
    self._started = True

  def __enter__(self) -> "RunDirectory":
    workdir = self.path
    if os.path.exists(workdir) and not os.path.isdir(workdir):
      raise config_lib.ConfigError(f"--workdir={workdir} is a file, not a directory")
    self._created = not os.path.exists(workdir)
    try:
      os.makedirs(workdir, exist_ok=True)
    except OSError as e:
      raise config_lib.ConfigError(f"--workdir={workdir} cannot be created: {e.strerror}") from e
    try:
      if not os.access(workdir, os.W_OK | os.X_OK):
        raise config_lib.ConfigError(f"--workdir={workdir} is not writable")
      if self._lock is not None:
        self._lock.acquire()
    except BaseException:
      self._remove_if_created()
      raise
    return self

  def __exit__(self, exc_type, exc, tb) -> bool:
    if self._lock is not None:
      self._lock.release()
    if exc_type is not None and not self._started:
      self._remove_if_created()
    return False

  def _remove_if_created(self) -> None:
    if self._created:
      shutil.rmtree(self.path, ignore_errors=True)


def quiet_refused_writes() -> None:
  """For a command's process: when the filesystem refuses a checkpoint's write, orbax's threads
  log the error with its traceback and tensorstore's callbacks raise into an event loop that is
  closed, hundreds of lines before the run's own one-line RunWriteError. This drops those records
  (absl logging records whose message or exception is a refused write) and those unraisable
  exceptions (a write failure, or 'Event loop is closed'); every other record and exception is
  reported as before. Process-wide: call it once, from a command, not from a library."""
  import logging  # pylint: disable=import-outside-toplevel

  class _Filter(logging.Filter):
    def filter(self, record):
      error = record.exc_info[1] if record.exc_info else None
      return not (write_failure(error) if error is not None else None) and not any(
          text in record.getMessage() for text in _WRITE_TEXTS)

  logging.getLogger("absl").addFilter(_Filter())
  previous = sys.unraisablehook

  def hook(unraisable):
    error = unraisable.exc_value
    if write_failure(error) or (isinstance(error, RuntimeError)
                                and "Event loop is closed" in str(error)):
      return
    previous(unraisable)

  sys.unraisablehook = hook
