"""The routed experts' grouped-matmul weight gradient as a Pallas kernel (`grouped_weight_grad`)."""
from pallas_kernels.grouped_matmul.kernels import GroupedGradConfig, grouped_weight_grad

__all__ = ["GroupedGradConfig", "grouped_weight_grad"]
