"""`python -m k3jax.compare ...`: the compare command (k3jax/compare/command.py)."""
from absl import app, flags

from k3jax.compare import command

__doc__ = command.__doc__  # what --help prints
command.define_flags()
flags.adopt_module_key_flags(command)
app.run(command.main)
