"""Block AttnRes's depth mix, forward and backward, as Pallas kernels (`depth_mix_fused`)."""
from pallas_kernels.depth_mix.kernels import DepthMixConfig, depth_mix_fused

__all__ = ["DepthMixConfig", "depth_mix_fused"]
