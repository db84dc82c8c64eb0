"""Flash attention over per-query key ranges (packed documents) as Pallas kernels, with a VJP."""
from pallas_kernels.flash_attention.kernels import FlashConfig
from pallas_kernels.flash_attention.mosaic_bwd import MosaicBwdConfig
from pallas_kernels.flash_attention.ops import flash_attention, reference_attention

__all__ = ["FlashConfig", "MosaicBwdConfig", "flash_attention", "reference_attention"]
