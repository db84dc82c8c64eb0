"""`python -m k3jax.plan ...`: the plan command (k3jax/plan/command.py)."""
from absl import app, flags

from k3jax.plan import command

__doc__ = command.__doc__  # what --help prints
command.define_flags()
flags.adopt_module_key_flags(command)
app.run(command.main)
