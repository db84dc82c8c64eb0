"""Test-wide set-up: 8 virtual CPU devices so that mesh tests can run anywhere.

This must run before JAX initialises its backends, hence at conftest import time.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # backends already initialised (e.g. on GPU); the XLA flag above then applies.
  pass
jax.config.update("jax_default_matmul_precision", "highest")
