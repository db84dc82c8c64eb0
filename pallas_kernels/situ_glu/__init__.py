"""The MoE experts' SiTU-GLU activation, forward and backward, as Pallas kernels (`situ_glu_fused`)."""
from pallas_kernels.situ_glu.kernels import SituGluConfig, situ_glu_fused, situ_glu_grads

__all__ = ["SituGluConfig", "situ_glu_fused", "situ_glu_grads"]
