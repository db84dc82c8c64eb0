"""The kernel settings' one rule (ImplConfig.moe_situ_glu, attnres_kernel, kda_conv_kernel,
norm_kernel): 'xla' runs XLA's fusions, 'pallas' the Pallas kernels (interpreted on CPU), and
'auto' picks 'pallas' on a GPU and 'xla' elsewhere (where the interpreter would only be slower)."""

from __future__ import annotations

import jax

from k3jax.config import KERNEL_CHOICES


def pallas_or_xla(kind: str, field: str) -> str:
  """'xla' or 'pallas' for the setting `field` (named in the error, e.g. 'ModelConfig.
  attnres_kernel') whose value is `kind`, one of KERNEL_CHOICES."""
  if kind not in KERNEL_CHOICES:
    raise ValueError(f"{field} = {kind!r}: expected one of {KERNEL_CHOICES}")
  if kind == "auto":
    return "pallas" if jax.default_backend() == "gpu" else "xla"
  return kind
