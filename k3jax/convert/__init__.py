"""Released Kimi models in and out of k3jax: Hugging Face folders <-> k3jax variables and runs.

  load_hf(folder, mesh=None) -> (Config, variables)   `k3jax.model.K3Model(cfg.model).apply(
                                                       variables, tokens)` gives the logits
  save_hf(folder, model_cfg, params, moe_state)        a Hugging Face folder transformers loads
  python -m k3jax.convert --from_hf=DIR --workdir=RUN  a run directory (config.gin, step 0)
  python -m k3jax.convert --to_hf=DIR --workdir=RUN    the reverse (also `k3jax convert ...`)

Modules: `hf` (the two functions), `kimi_linear` and `kimi_k3` (the two formats: config keys and
tensor names), `safetensors_io` (shards read and written one tensor at a time), `mxfp4` (the OCP
MXFP4 codec of K3's routed experts), `command` (run directories and the command).
"""

from k3jax.convert.hf import hf_model_config, load_hf, save_hf
from k3jax.convert.kimi_linear import ConvertError
from k3jax.convert.safetensors_io import CheckpointFormatError

__all__ = ["CheckpointFormatError", "ConvertError", "hf_model_config", "load_hf", "save_hf"]
