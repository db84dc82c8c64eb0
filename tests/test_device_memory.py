"""k3jax.runtime.device_memory: which fraction of the GPU the CLIs give XLA, and the errors for bad
ones."""
import pytest

from k3jax.runtime import device_memory


def test_default_is_095_when_neither_flag_nor_environment():
  assert device_memory.fraction_to_use(None, {}) == "0.95"


def test_environment_is_kept_when_no_flag():
  assert device_memory.fraction_to_use(None, {device_memory.ENV: "0.8"}) == "0.8"


def test_flag_wins_over_environment():
  assert device_memory.fraction_to_use(0.5, {device_memory.ENV: "0.8"}) == "0.5"


@pytest.mark.parametrize("flag, env, message", [
    (0.0, {}, "--device_memory_fraction=0.0 is not allowed: a fraction in (0, 1]"),
    (1.01, {}, "--device_memory_fraction=1.01 is not allowed"),
    (None, {device_memory.ENV: "lots"},
     "XLA_PYTHON_CLIENT_MEM_FRACTION=lots is not allowed: a fraction in (0, 1]"),
    (None, {device_memory.ENV: "2"}, "XLA_PYTHON_CLIENT_MEM_FRACTION=2 is not allowed"),
])
def test_bad_values_name_their_source(flag, env, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
    device_memory.fraction_to_use(flag, env)


def test_current_fraction_says_when_it_is_jax_default():
  assert device_memory.current_fraction({device_memory.ENV: "0.9"}) == "0.9"
  assert device_memory.current_fraction({}) == "0.75 (JAX's default)"
