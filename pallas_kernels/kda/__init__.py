"""Chunked Kimi Delta Attention as Pallas kernels (forward and backward)."""
from pallas_kernels.kda.ops import chunk_kda

__all__ = ["chunk_kda"]
