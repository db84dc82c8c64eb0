"""RMSNorm's backward as one Pallas kernel (`rms_norm_bwd`)."""
from pallas_kernels.rms_norm.kernels import RmsNormConfig, rms_norm_bwd

__all__ = ["RmsNormConfig", "rms_norm_bwd"]
