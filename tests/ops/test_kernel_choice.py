"""k3jax.ops.kernel_choice: the kernel settings' shared rule, and each setting's error naming it."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from k3jax import config as config_lib
from k3jax.layers import attnres, common, conv
from k3jax.layers.moe import LatentMoE
from k3jax.ops.kernel_choice import pallas_or_xla


def test_auto_is_pallas_on_a_gpu_only():
  on_gpu = jax.default_backend() == "gpu"
  assert pallas_or_xla("auto", "F") == ("pallas" if on_gpu else "xla")
  assert pallas_or_xla("pallas", "F") == "pallas"
  assert pallas_or_xla("xla", "F") == "xla"
  with pytest.raises(ValueError, match=r"ImplConfig\.x = 'triton': expected one of \('auto', "
                                       r"'xla', 'pallas'\)"):
    pallas_or_xla("triton", "ImplConfig.x")


@pytest.mark.parametrize("field", ["moe_situ_glu", "attnres_kernel", "kda_conv_kernel",
                                   "norm_kernel"])
def test_each_setting_is_validated_and_named(field):
  with pytest.raises(config_lib.ConfigError, match=rf"ImplConfig\.{field} = 'cuda'"):
    dataclasses.replace(config_lib.ImplConfig(), **{field: "cuda"}).validate()


def test_the_call_sites_name_their_setting():
  """A bad value that bypasses the config's validation still fails with the setting's name."""
  with pytest.raises(ValueError, match=r"ImplConfig\.kda_conv_kernel = 'cuda'"):
    conv.conv_silu(jnp.zeros((1, 4, 2)), jnp.zeros((4, 2)), None, jnp.float32, "cuda")
  with pytest.raises(ValueError, match=r"ImplConfig\.norm_kernel = 'cuda'"):
    common.rms_norm(jnp.zeros((2, 8)), 1e-6, kernel="cuda")
  with pytest.raises(ValueError, match=r"ImplConfig\.attnres_kernel = 'cuda'"):
    attnres.depth_mix([jnp.zeros((2, 8))], jnp.zeros(8), None, 1e-6, kernel="cuda")
  cfg = config_lib.ModelConfig()
  impl = dataclasses.replace(config_lib.ImplConfig(), moe_situ_glu="cuda")
  with pytest.raises(ValueError, match=r"ImplConfig\.moe_situ_glu = 'cuda'"):
    LatentMoE(cfg, impl).init(jax.random.key(0), jnp.zeros((1, 4, cfg.d_model)))
