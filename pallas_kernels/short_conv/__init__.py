"""The KDA short convolution's backward as a Pallas kernel (`conv_silu_bwd`)."""
from pallas_kernels.short_conv.kernels import ConvConfig, conv_silu_bwd

__all__ = ["ConvConfig", "conv_silu_bwd"]
