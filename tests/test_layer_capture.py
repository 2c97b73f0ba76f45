"""``tracer.layer_capture``: the fp8 scales the forward hook captures and how they become record fields."""

from __future__ import annotations

import types

import torch

from tracer.layer_capture import _scale_value, capture_scales, dtype_name


def _layer(**attrs):
    return types.SimpleNamespace(**attrs)


def test_device_scales_are_cloned_then_read_at_flush():
    layer = _layer(_q_scale=torch.tensor(0.5), _k_scale=torch.tensor(2.0), _v_scale=torch.tensor(0.25))
    captured = capture_scales(layer)
    layer._k_scale.fill_(9.0)  # vLLM may update the scale later (calc_kv_scales): the record keeps this step's
    assert {k: _scale_value(v) for k, v in captured.items()} == {"q_scale": 0.5, "k_scale": 2.0, "v_scale": 0.25}


def test_host_floats_and_missing_scales():
    captured = capture_scales(_layer(_q_scale_float=0.75, _k_scale_float=1.0))
    assert captured == {"q_scale": 0.75, "k_scale": 1.0, "v_scale": None}


def test_per_head_scales_become_one_float_only_when_they_agree():
    assert _scale_value(torch.full((8,), 0.125)) == 0.125
    assert _scale_value(torch.tensor([0.125, 0.25])) is None


def test_dtype_name_drops_the_torch_prefix():
    assert dtype_name(torch.zeros(1, dtype=torch.float8_e4m3fn)) == "float8_e4m3fn"
    assert dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"


def test_a_layers_block_size_follows_its_cache():
    """Read once from the cache's shape, kept when vLLM replaces the cache; the profile run's
    empty placeholder (no block dimension) reads 0 rather than failing the step."""
    from tracer.layer_capture import LayerStatic

    static = LayerStatic("model.layers.0.self_attn.attn", impl=None, module=None, kv_cache=torch.empty(0))
    assert static.block_size == 0
    static.geometry = object()
    static.set_cache(torch.zeros(8, 2, 16, 64))
    assert static.block_size == 16 and static.geometry is None
    assert LayerStatic("x", None, None, torch.zeros(4, 2, 32, 64)).block_size == 32
