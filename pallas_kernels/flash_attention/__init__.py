"""Flash attention over per-query key ranges (packed documents): a caller's forward, and the
backward as Mosaic GPU kernels that skip the blocks outside the ranges (`mosaic_bwd`)."""
from pallas_kernels.flash_attention.mosaic_bwd import MosaicBwdConfig
from pallas_kernels.flash_attention.ops import flash_attention, reference_attention

__all__ = ["MosaicBwdConfig", "flash_attention", "reference_attention"]
