"""`python -m k3jax.convert ...`: the convert command (k3jax/convert/command.py)."""
from absl import app, flags

from k3jax.convert import command

__doc__ = command.__doc__  # what --help prints
command.define_flags()
flags.adopt_module_key_flags(command)
app.run(command.main)
