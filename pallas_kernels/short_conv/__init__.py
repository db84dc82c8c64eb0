"""The KDA short convolution + SiLU as Pallas kernels: `conv_silu_fwd`, `conv_silu_bwd`."""
from pallas_kernels.short_conv.kernels import ConvConfig, conv_silu_bwd, conv_silu_fwd

__all__ = ["ConvConfig", "conv_silu_bwd", "conv_silu_fwd"]
