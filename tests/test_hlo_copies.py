"""experiments/benchmarks/hlo_copies.py: the run-time copies of an optimised HLO module, bytes
weighted by the trip counts of the loops around them."""
import json
import os
import sys

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments", "benchmarks"))
import hlo_copies  # noqa: E402

# An outer loop (2 trips) whose body copies one zero broadcast twice into the initial value of an
# inner loop (3 trips); the inner body reads a slice of a stacked weight through an async dynamic
# memcpy, writes a slice in place with a dynamic-update-slice fusion, and holds fusions that are no
# memcpy (a strided slice, a copy inside a fusion that also computes).
_HLO = """\
HloModule jit_step, is_scheduled=true

%fused_zeros (p: f32[]) -> f32[3,4,8] {
  %p = f32[] parameter(0)
  ROOT %b = f32[3,4,8]{2,1,0} broadcast(%p), dimensions={}
}

%fused_ds (p0: f32[3,4,8], p1: s32[]) -> f32[1,4,8] {
  %p0 = f32[3,4,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,4,8]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,4,8}
}

%fused_strided (p0: f32[3,4,8], p1: s32[]) -> f32[3,4,2] {
  %p0 = f32[3,4,8]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[3,4,2]{2,1,0} dynamic-slice(%p0, %z, %z, %p1), dynamic_slice_sizes={3,4,2}
}

%fused_dus (p0: f32[3,4,8], p1: f32[1,4,8], p2: s32[]) -> f32[3,4,8] {
  %p0 = f32[3,4,8]{2,1,0} parameter(0)
  %p1 = f32[1,4,8]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[3,4,8]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}

%fused_exp_copy (p0: f32[1,4,8]) -> f32[1,4,8] {
  %p0 = f32[1,4,8]{2,1,0} parameter(0)
  %e = f32[1,4,8]{2,1,0} exponential(%p0)
  ROOT %c = f32[1,4,8]{2,1,0} copy(%e)
}

%async_ds (a0: f32[3,4,8], a1: s32[]) -> f32[1,4,8] {
  %a0 = f32[3,4,8]{2,1,0} parameter(0)
  %a1 = s32[] parameter(1)
  ROOT %slice_fusion = f32[1,4,8]{2,1,0} fusion(%a0, %a1), kind=kLoop, calls=%fused_ds
}

%inner_cond (ic: (s32[], f32[3,4,8], f32[3,4,8])) -> pred[] {
  %ic = (s32[], f32[3,4,8]{2,1,0}, f32[3,4,8]{2,1,0}) parameter(0)
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%ic#0, %n), direction=LT
}

%inner_body (ib: (s32[], f32[3,4,8], f32[3,4,8])) -> (s32[], f32[3,4,8], f32[3,4,8]) {
  %ib = (s32[], f32[3,4,8]{2,1,0}, /*index=2*/f32[3,4,8]{2,1,0}) parameter(0)
  %start = ((f32[3,4,8]{2,1,0}, s32[]), f32[1,4,8]{2,1,0}, u32[]) async-start(%ib#1, %ib#0), calls=%async_ds, metadata={op_name="jit(step)/while/body/transpose(jvp(Model))/while/body/dynamic_slice"}
  %done = f32[1,4,8]{2,1,0} async-done(%start)
  %exp = f32[1,4,8]{2,1,0} fusion(%done), kind=kLoop, calls=%fused_exp_copy, metadata={op_name="jit(step)/while/body/exp"}
  %strided = f32[3,4,2]{2,1,0} fusion(%ib#1, %ib#0), kind=kLoop, calls=%fused_strided
  %upd = f32[3,4,8]{2,1,0} fusion(%ib#2, %exp, %ib#0), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/while/body/jvp(Model)/while/body/dynamic_update_slice"}
  %one = s32[] constant(1)
  %next = s32[] add(%ib#0, %one)
  ROOT %t = (s32[], f32[3,4,8]{2,1,0}, f32[3,4,8]{2,1,0}) tuple(%next, %ib#1, %upd)
}

%outer_cond (oc: (s32[], f32[3,4,8])) -> pred[] {
  %oc = (s32[], f32[3,4,8]{2,1,0}) parameter(0)
  %n = s32[] constant(2)
  ROOT %lt = pred[] compare(%oc#0, %n), direction=LT
}

%outer_body (ob: (s32[], f32[3,4,8])) -> (s32[], f32[3,4,8]) {
  %ob = (s32[], f32[3,4,8]{2,1,0}) parameter(0)
  %zero = f32[] constant(0)
  %zeros = f32[3,4,8]{2,1,0} fusion(%zero), kind=kLoop, calls=%fused_zeros, metadata={op_name="jit(step)/call_exported"}
  %copy.1 = f32[3,4,8]{2,1,0} copy(%zeros)
  %copy.2 = f32[3,4,8]{2,1,0} copy(%zeros)
  %i0 = s32[] constant(0)
  %init = (s32[], f32[3,4,8]{2,1,0}, f32[3,4,8]{2,1,0}) tuple(%i0, %copy.1, %copy.2)
  %w = (s32[], f32[3,4,8]{2,1,0}, f32[3,4,8]{2,1,0}) while(%init), condition=%inner_cond, body=%inner_body, metadata={op_name="jit(step)/while/body/jvp(Model)/while"}, backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  %one = s32[] constant(1)
  %next = s32[] add(%ob#0, %one)
  %acc = f32[3,4,8]{2,1,0} add(%ob#1, %w#2), metadata={op_name="jit(step)/while/body/add"}
  ROOT %t = (s32[], f32[3,4,8]{2,1,0}) tuple(%next, %acc)
}

ENTRY %main (x: f32[3,4,8]) -> f32[3,4,8] {
  %x = f32[3,4,8]{2,1,0} parameter(0)
  %i0 = s32[] constant(0)
  %init = (s32[], f32[3,4,8]{2,1,0}) tuple(%i0, %x)
  %loop = (s32[], f32[3,4,8]{2,1,0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %out = f32[3,4,8]{2,1,0} copy(%loop#1)
}
"""
_ARRAY_BYTES = 3 * 4 * 8 * 4  # f32[3,4,8]
_SLICE_BYTES = 4 * 8 * 4  # f32[1,4,8]


def test_copies_of_synthetic_module_weighted_by_trip_counts():
  rows = hlo_copies.find_copies(_HLO)
  by_name = {r["name"]: r for r in rows}
  # The inner loop's zero inits: one array each, once per outer trip.
  for name in ("copy.1", "copy.2"):
    assert by_name[name]["kind"] == "copy"
    assert by_name[name]["trips"] == 2
    assert by_name[name]["bytes_per_step"] == 2 * _ARRAY_BYTES
    assert by_name[name]["loops"] == ["loop x2"]
    assert hlo_copies.source_of(by_name[name]) == "init of while/body/jvp(Model)/while"
  # The async slice and the in-place update: one slice each per inner trip (2 x 3).
  assert by_name["slice_fusion"]["kind"] == "dynamic-memcpy"
  assert by_name["slice_fusion"]["bytes_per_step"] == 6 * _SLICE_BYTES
  assert by_name["slice_fusion"]["loops"] == ["loop x2", "w x3"]
  assert by_name["upd"]["kind"] == "dynamic-memcpy?"
  assert by_name["upd"]["bytes_per_step"] == 6 * _SLICE_BYTES
  assert "dynamic_update_slice" in by_name["upd"]["src_op"]
  # The entry's copy of the loop result runs once.
  assert by_name["out"]["trips"] == 1 and by_name["out"]["bytes_per_step"] == _ARRAY_BYTES
  # Not memcpys: the strided slice, the copy inside a computing fusion, the broadcast.
  assert not {"strided", "exp", "zeros", "c"} & set(by_name)
  assert [r["bytes_per_step"] for r in rows] == sorted((r["bytes_per_step"] for r in rows),
                                                       reverse=True)


def test_report_summary_sums_by_kind_and_place():
  rows, summary = hlo_copies.copies_report(_HLO, top=2)
  assert [r["name"] for r in rows] == ["copy.1", "copy.2"]
  total = 2 * 2 * _ARRAY_BYTES + 2 * 6 * _SLICE_BYTES + _ARRAY_BYTES
  assert summary["copies"] == 5 and summary["bytes_per_step"] == total
  assert [k for _, k in summary["by_kind"]] == ["copy", "dynamic-memcpy", "dynamic-memcpy?"]
  _, summary = hlo_copies.copies_report(_HLO, top=10)
  assert [k for _, k in summary["by_place"]] == [
      "copy in loop x2", "dynamic-memcpy in loop x2 > w x3", "dynamic-memcpy? in loop x2 > w x3",
      "copy in no loop"]


def test_carry_copy_names_the_loop_and_what_the_body_writes_back():
  hlo = _HLO.replace("ROOT %t = (s32[], f32[3,4,8]{2,1,0}) tuple(%next, %acc)",
                     "%keep = f32[3,4,8]{2,1,0} copy(%ob#1)\n"
                     "  ROOT %t = (s32[], f32[3,4,8]{2,1,0}) tuple(%next, %acc)")
  row = next(r for r in hlo_copies.find_copies(hlo) if r["name"] == "keep")
  assert row["carry"] == "loop#1"
  assert row["src_op"] == "jit(step)/while/body/add"


def test_while_without_trip_count_raises():
  hlo = _HLO.replace(', backend_config={"known_trip_count":{"n":"2"}}', "")
  with pytest.raises(ValueError, match="known_trip_count"):
    hlo_copies.find_copies(hlo)


@pytest.mark.parametrize("full, part, contiguous", [
    ("f32[3,4,8]{2,1,0}", "f32[1,4,8]", True),
    ("f32[3,4,8]{2,1,0}", "f32[1,2,8]", True),
    ("f32[3,4,8]{2,1,0}", "f32[2,2,8]", False),
    ("f32[3,4,8]{2,1,0}", "f32[3,4,2]", False),
    ("f32[3,4,8]{0,1,2}", "f32[3,4,1]", True),  # column-major: the last dimension is the major one
    ("f32[3,4,8]{0,1,2}", "f32[1,4,8]", False),
])
def test_contiguous_slice(full, part, contiguous):
  assert hlo_copies.is_contiguous_slice(full, part) is contiguous


def test_shape_bytes():
  assert hlo_copies.shape_bytes("bf16[2,3]{1,0}") == 12
  assert hlo_copies.shape_bytes("(f32[], s8[4]{0}, pred[2]{0})") == 4 + 4 + 2


def test_nested_scan_copies_its_shared_zero_inits_per_outer_trip():
  """A compiled grad of a scan inside a scan (the training step's micro-batch loop around the
  decoder's layer scan): XLA merges the layer scan's identical zero inits of its stacked outputs
  and copies them, inside the outer body, once per outer trip."""
  def layer(h, w):
    return jnp.tanh(jnp.tanh(h @ w[0]) @ w[1]), None

  def loss(ws, x):
    return jnp.sum(jax.lax.scan(layer, x, ws)[0] ** 2)

  def step(ws, xs):
    def body(acc, x):
      return acc + jax.grad(loss)(ws, x), None
    return jax.lax.scan(body, jnp.zeros_like(ws), xs)[0]

  ws, xs = jnp.ones((3, 2, 16, 16)), jnp.ones((2, 8, 16))
  rows = hlo_copies.find_copies(jax.jit(step).lower(ws, xs).compile().as_text())
  stacked = [r for r in rows if r["kind"] == "copy" and r["shape"].startswith("f32[3,8,16]")]
  assert stacked, json.dumps(rows, indent=1)
  assert all(r["trips"] == 2 and len(r["loops"]) == 1 for r in stacked)


def test_main_prints_rows_then_summary(tmp_path, capsys):
  path = tmp_path / "module_1.jit_step.sm_9.0a_gpu_after_optimizations.txt"
  path.write_text(_HLO)
  hlo_copies.main([str(tmp_path), "--module=jit_step", "--top=3"])
  lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
  assert len(lines) == 4 and lines[-1]["summary"] and lines[0]["name"] in ("copy.1", "copy.2")
