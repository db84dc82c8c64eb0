"""The K3 decoder and what describes it.

  decoder      K3Model: embedding, the KDA / gated MLA layers with Block AttnRes and the
               SiTU-GLU FFN or LatentMoE, the LM head
  layer_plan   which layers run unrolled and which as one scan over groups
  layout       variable trees in the per-layer and the scanned layout, and conversion
  params       init_variables, count_params
  flops        model FLOPs per token (for MFU)
  decode       autoregressive decoding: prefill, one-token steps, sampling

The layers live in `k3jax.layers`, their math in `k3jax.ops`. Nothing here imports the training
code or the runtime.
"""

from k3jax.model.decoder import LAYERS_AXIS, K3Model
from k3jax.model.flops import flops_per_token
from k3jax.model.layer_plan import LayerPlan, layer_plan
from k3jax.model.layout import (is_scanned_path, scanned_to_unrolled, to_layout,
                                unrolled_to_scanned)
from k3jax.model.params import count_params, init_variables

__all__ = ["K3Model", "LAYERS_AXIS", "LayerPlan", "count_params", "flops_per_token",
           "init_variables", "is_scanned_path", "layer_plan", "scanned_to_unrolled", "to_layout",
           "unrolled_to_scanned"]
