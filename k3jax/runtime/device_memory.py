"""How much of an accelerator's memory the CLIs let XLA's allocator use (--device_memory_fraction).

JAX's GPU allocator takes 75 % of the device by default (XLA_PYTHON_CLIENT_MEM_FRACTION): on an
H200 that is 104.9 of its 139.8 GiB, and small.gin's 1M-token stage, whose step needs 114.4 GiB,
ran out of memory under it (RESULTS.md, run 13), while the same step ran with 0.95. The CLIs
therefore default to 0.95. The setting is read when JAX creates its GPU client, so it must be made
before anything touches a device: the CLIs apply it first thing in `main`. A library user sets
XLA_PYTHON_CLIENT_MEM_FRACTION in the environment instead.

Precedence: the flag where given; else XLA_PYTHON_CLIENT_MEM_FRACTION where set; else 0.95.
"""
from __future__ import annotations

import os
from typing import Optional

ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
DEFAULT_FRACTION = 0.95


def define_flag() -> None:
  """Defines --device_memory_fraction (once per process: several CLI modules may be imported)."""
  from absl import flags
  if "device_memory_fraction" not in flags.FLAGS:
    flags.DEFINE_float(
        "device_memory_fraction", None,
        f"Fraction of each GPU's memory that XLA may allocate, in (0, 1] (default: "
        f"${ENV} if set, else {DEFAULT_FRACTION}; JAX's own default, 0.75, leaves a quarter of "
        "the device unused).")


def fraction_to_use(flag_value: Optional[float], environ=None) -> str:
  """The value to put in XLA_PYTHON_CLIENT_MEM_FRACTION (see the module's precedence).

  Raises ValueError naming the flag or the variable when the value is not a number in (0, 1].
  """
  environ = os.environ if environ is None else environ
  if flag_value is not None:
    source, value = "--device_memory_fraction", flag_value
  elif environ.get(ENV):
    source, value = ENV, environ[ENV]
  else:
    return str(DEFAULT_FRACTION)
  try:
    number = float(value)
  except ValueError:
    number = float("nan")
  if not 0.0 < number <= 1.0:
    raise ValueError(f"{source}={value} is not allowed: a fraction in (0, 1], e.g. 0.95")
  return str(number) if flag_value is not None else str(value)


def current_fraction(environ=None) -> str:
  """The fraction this process's GPU allocator was given: XLA_PYTHON_CLIENT_MEM_FRACTION, or
  JAX's default where it is not set (a library use without the CLIs)."""
  environ = os.environ if environ is None else environ
  return environ.get(ENV) or "0.75 (JAX's default)"


def apply_flag() -> None:
  """Sets XLA_PYTHON_CLIENT_MEM_FRACTION from --device_memory_fraction (call before JAX touches a
  device). Raises ValueError for a value outside (0, 1]."""
  from absl import flags
  os.environ[ENV] = fraction_to_use(flags.FLAGS.device_memory_fraction)
