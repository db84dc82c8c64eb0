"""k3jax: the Kimi K3 architecture in JAX/Flax."""

__version__ = "0.1.0"
