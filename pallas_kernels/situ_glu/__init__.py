"""The MoE experts' SiTU-GLU activation, forward and backward, as Pallas kernels (`situ_glu_fused`)."""
from pallas_kernels.situ_glu.kernels import SituGluConfig, situ_glu_fused

__all__ = ["SituGluConfig", "situ_glu_fused"]
