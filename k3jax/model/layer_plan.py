"""Which decoder layers run unrolled, and which as one `nn.scan` over groups of layers
(ImplConfig.scan_layers).

The layers repeat with a period of lcm(mla_every, attnres_block_size): every group of that many
layers has the same layer kinds, the same dense/MoE choice and the same position relative to the
AttnRes block boundaries. The decoder runs the dense first layers (and any layers before the first
whole group) unrolled, then one `nn.scan` over the groups, then the rest unrolled (what is left,
the final MLA layer included when num_layers is not a multiple of mla_every). What is traced and
compiled is one group, whatever the depth.
"""

from __future__ import annotations

import dataclasses
import math

from k3jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """Which layers run unrolled before the scan, in it, and after it.

  prefix: layer indices run unrolled before the scan (all layers when nothing is scanned).
  start: the first scanned layer; period: layers per group; num_groups: groups (0: no scan).
  suffix: layer indices run unrolled after the scan.
  """
  prefix: tuple[int, ...]
  start: int
  period: int
  num_groups: int
  suffix: tuple[int, ...]

  @property
  def scan_name(self) -> str:
    """The name of the scanned module (it carries the period, see `scanned_to_unrolled`)."""
    return f"scanned_period_{self.period}"

  @property
  def group_layers(self) -> tuple[int, ...]:
    """The layer indices of the first group (their names inside the scanned module)."""
    return tuple(range(self.start, self.start + self.period))

  @property
  def scanned_layers(self) -> tuple[int, ...]:
    return tuple(range(self.start, self.start + self.period * self.num_groups))


def layer_plan(cfg: ModelConfig, scan_layers: bool = True) -> LayerPlan:
  """The split of `cfg`'s layers into unrolled prefix, scanned groups and unrolled suffix.

  The groups start at the first MoE layer (after the first_k_dense dense ones), hold
  lcm(mla_every, attnres_block_size) layers each (mla_every without AttnRes), and stop before the
  final layer when num_layers is not a multiple of mla_every (that layer is MLA out of pattern).
  Fewer than two groups, or scan_layers False (ImplConfig.scan_layers): everything unrolled.
  """
  n = cfg.num_layers
  unrolled = LayerPlan(prefix=tuple(range(n)), start=n, period=1, num_groups=0, suffix=())
  if not scan_layers:
    return unrolled
  period = math.lcm(cfg.mla_every, cfg.attnres_block_size) if cfg.attnres else cfg.mla_every
  start = min(cfg.first_k_dense, n) if cfg.moe_num_experts > 0 else 0
  end = n if n % cfg.mla_every == 0 else n - 1
  groups = max(0, (end - start) // period)
  if groups < 2:
    return unrolled
  stop = start + groups * period
  return LayerPlan(prefix=tuple(range(start)), start=start, period=period, num_groups=groups,
                   suffix=tuple(range(stop, n)))
