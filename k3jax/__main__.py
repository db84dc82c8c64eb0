"""`python -m k3jax <command> ...`: the `k3jax` tool (`k3jax.cli.main`)."""

from k3jax import cli

if __name__ == "__main__":
  cli.main()
