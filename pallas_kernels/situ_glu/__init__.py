"""The MoE experts' SiTU-GLU (or SwiGLU) activation, forward and backward, as Pallas kernels
(`situ_glu_fused`)."""
from pallas_kernels.situ_glu.kernels import (SituGluConfig, check_bounds, situ_glu_fused,
                                             situ_glu_grads, situ_glu_value)

__all__ = ["SituGluConfig", "check_bounds", "situ_glu_fused", "situ_glu_grads", "situ_glu_value"]
