"""reference_impl.layouts: exact round trips, real strides, element offsets against memory."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_impl import layouts as L

SETTINGS = settings(max_examples=25, deadline=None)
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.uint8)
ROOT = Path(__file__).resolve().parents[1]


def _random_kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distinct random caches ``[nb, bs, H_kv, D]``; uint8 stands for fp8 bytes."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return (
            torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
            torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8),
        )
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def _memory(t: torch.Tensor) -> torch.Tensor:
    """All elements of ``t``'s storage in address order, whatever ``t``'s strides."""
    return torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


@st.composite
def cache_shapes(draw, multiple_of_16: bool = False):
    step = 16 if multiple_of_16 else 1
    num_blocks = draw(st.integers(1, 4))
    block_size = step * draw(st.integers(1, 3)) if multiple_of_16 else draw(st.sampled_from([1, 2, 4, 16]))
    num_kv_heads = draw(st.integers(1, 3))
    head_size = draw(st.sampled_from([16, 32, 48])) if multiple_of_16 else draw(st.sampled_from([16, 32]))
    return num_blocks, block_size, num_kv_heads, head_size


# --------------------------------------------------------------------------- flash


@SETTINGS
@given(
    shape=cache_shapes(),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(["NHD", "HND"]),
    seed=st.integers(0, 2**16),
)
def test_flash_round_trip_has_vllm_strides(shape, dtype, layout, seed):
    key, value = _random_kv(shape, dtype, seed)
    nb, bs, nh, d = shape
    kv = L.kv_to_flash(key, value, layout)
    assert kv.shape == (nb, nh, bs, 2 * d)
    assert kv.stride() == L.flash_strides(nb, nh, bs, d, layout)
    # FlashAttentionImpl's own view of the packed cache.
    k_view, v_view = kv.transpose(1, 2).split(d, dim=-1)
    assert torch.equal(k_view, key) and torch.equal(v_view, value)
    back_k, back_v = L.flash_to_kv(kv, d)
    assert torch.equal(back_k, key) and torch.equal(back_v, value)


def test_flash_strides_match_stride_order():
    # NHD: memory (blocks, tokens, heads, K|V); HND: (blocks, heads, tokens, K|V).
    nb, nh, bs, d = 3, 4, 16, 8
    assert L.flash_strides(nb, nh, bs, d, "NHD") == (bs * nh * 2 * d, 2 * d, nh * 2 * d, 1)
    assert L.flash_strides(nb, nh, bs, d, "HND") == (nh * bs * 2 * d, bs * 2 * d, 2 * d, 1)
    assert L.flash_strides(nb, nh, bs, d, L.LAYOUT_FLASH_NHD) == L.flash_strides(nb, nh, bs, d, "NHD")
    with pytest.raises(ValueError):
        L.flash_strides(nb, nh, bs, d, "NDH")


# --------------------------------------------------------------------------- cpu


@SETTINGS
@given(shape=cache_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_cpu_round_trip_and_backend_view(shape, dtype, seed):
    key, value = _random_kv(shape, dtype, seed)
    nb, bs, nh, d = shape
    kv = L.kv_to_cpu(key, value)
    assert kv.shape == (nb, nh, bs, 2 * d) and kv.is_contiguous()
    # The backend's view: view(nb, H, 2*bs, D).chunk(2, dim=2); K is stored transposed.
    k_half, v_half = kv.view(nb, nh, 2 * bs, d).chunk(2, dim=2)
    assert torch.equal(k_half.reshape(nb, nh, d, bs), key.permute(0, 2, 3, 1))
    assert torch.equal(v_half, value.permute(0, 2, 1, 3))
    back_k, back_v = L.cpu_to_kv(kv, d)
    assert torch.equal(back_k, key) and torch.equal(back_v, value)


@SETTINGS
@given(shape=cache_shapes(multiple_of_16=True), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_cpu_amx_round_trip(shape, dtype, seed):
    key, value = _random_kv(shape, dtype, seed)
    kv = L.kv_to_cpu_amx(key, value)
    assert kv.shape == (shape[0], shape[2], shape[1], 2 * shape[3]) and kv.is_contiguous()
    back_k, back_v = L.cpu_amx_to_kv(kv, shape[3])
    assert torch.equal(back_k, key) and torch.equal(back_v, value)


def test_cpu_layouts_are_not_interchangeable():
    key, value = _random_kv((2, 32, 2, 32), torch.float32, 0)
    cpu = L.kv_to_cpu(key, value)
    as_flash = L.flash_to_kv(cpu, 32)
    as_amx = L.cpu_amx_to_kv(cpu, 32)
    assert not torch.equal(as_flash[0], key) and not torch.equal(as_flash[1], value)
    assert not torch.equal(as_amx[0], key) and not torch.equal(as_amx[1], value)
    assert torch.equal(L.read_kv(cpu, L.LAYOUT_CPU, 32)[0], key)


def test_cpu_layout_for_follows_get_attn_isa():
    assert L.cpu_layout_for(torch.bfloat16, 32, 64, amx_supported=True) == L.LAYOUT_CPU_AMX
    assert L.cpu_layout_for(torch.bfloat16, 16, 64, amx_supported=True) == L.LAYOUT_CPU
    assert L.cpu_layout_for(torch.float16, 32, 64, amx_supported=True) == L.LAYOUT_CPU
    assert L.cpu_layout_for(torch.bfloat16, 32, 80, amx_supported=True) == L.LAYOUT_CPU  # vec16
    assert L.cpu_layout_for(torch.bfloat16, 32, 64, amx_supported=False) == L.LAYOUT_CPU


# --------------------------------------------------------------------------- legacy


@SETTINGS
@given(shape=cache_shapes(), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_legacy_round_trip_matches_split_kv_cache(shape, dtype, seed):
    key, value = _random_kv(shape, dtype, seed)
    nb, bs, nh, d = shape
    x = L.legacy_x(dtype)
    assert x == 16 // key.element_size()
    key_legacy, value_legacy = L.kv_to_legacy(key, value)
    assert key_legacy.shape == (nb, nh, d // x, bs, x)
    assert value_legacy.shape == (nb, nh, d, bs)
    # The reading vLLM's kernels do: key[b, h, d // x, t, d % x], value[b, h, d, t].
    b, t, h, i = nb - 1, bs - 1, nh - 1, d - 1
    assert torch.equal(key_legacy[b, h, i // x, t, i % x], key[b, t, h, i])
    assert torch.equal(value_legacy[b, h, i, t], value[b, t, h, i])
    back_k, back_v = L.legacy_to_kv(key_legacy, value_legacy)
    assert torch.equal(back_k, key) and torch.equal(back_v, value)
    # PagedAttention.split_kv_cache's input: one (2, num_blocks, ...) tensor.
    stacked = torch.stack([key_legacy.reshape(nb, -1), value_legacy.reshape(nb, -1)])
    read_k, read_v = L.read_kv(stacked, L.LAYOUT_LEGACY, d, num_kv_heads=nh)
    assert torch.equal(read_k, key) and torch.equal(read_v, value)


def test_legacy_x_by_dtype():
    assert [L.legacy_x(t) for t in (torch.float32, torch.bfloat16, torch.float16, torch.uint8)] == [4, 8, 8, 16]
    with pytest.raises(ValueError):
        L.kv_to_legacy(*_random_kv((1, 4, 1, 12), torch.uint8, 0))  # 12 is not a multiple of 16


# --------------------------------------------------------------------------- offsets


@SETTINGS
@given(
    layout=st.sampled_from(L.LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    shape=cache_shapes(multiple_of_16=True),
    which=st.sampled_from(["k", "v"]),
    where=st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
)
def test_element_offset_points_at_the_element_in_memory(layout, dtype, shape, which, where):
    nb, bs, nh, d = shape
    block, token, head, dim = where[0] % nb, where[1] % bs, where[2] % nh, where[3] % d
    key = torch.zeros(shape, dtype=dtype)
    value = torch.zeros(shape, dtype=dtype)
    (key if which == "k" else value)[block, token, head, dim] = 1
    stored = {
        L.LAYOUT_FLASH_NHD: lambda: {"kv_cache": L.kv_to_flash(key, value, "NHD")},
        L.LAYOUT_FLASH_HND: lambda: {"kv_cache": L.kv_to_flash(key, value, "HND")},
        L.LAYOUT_CPU: lambda: {"kv_cache": L.kv_to_cpu(key, value)},
        L.LAYOUT_CPU_AMX: lambda: {"kv_cache": L.kv_to_cpu_amx(key, value)},
        L.LAYOUT_LEGACY: lambda: dict(zip(("key_cache", "value_cache"), L.kv_to_legacy(key, value), strict=False)),
    }[layout]()
    desc = L.describe_layout(layout, nb, nh, bs, d, key.element_size())
    view = desc.k_view if which == "k" else desc.v_view
    offset = L.element_offset(
        layout,
        block,
        head,
        token,
        dim,
        which,
        num_kv_heads=nh,
        block_size=bs,
        head_size=d,
        element_size=key.element_size(),
    )
    hits = _memory(stored[view.tensor]).nonzero().flatten().tolist()
    assert hits == [offset]
    # The description's tensors are the ones in memory, with their real strides.
    for t in desc.tensors:
        assert tuple(stored[t.name].shape) == t.logical_shape
        assert stored[t.name].stride() == t.strides
        assert stored[t.name].numel() == t.numel
    assert desc.total_bytes == sum(v.numel() * v.element_size() for v in stored.values())


def test_describe_layout_reads_like_the_backend():
    nhd = L.describe_layout(L.LAYOUT_FLASH_NHD, 10, 8, 16, 128, 2)
    assert nhd.memory_order == "(blocks, tokens, heads, K|V)"
    assert nhd.tensors[0].logical_shape == (10, 8, 16, 256)
    assert nhd.bytes_per_block == 2 * 16 * 8 * 128 * 2
    assert L.describe_layout(L.LAYOUT_FLASH_HND, 10, 8, 16, 128).memory_order == "(blocks, heads, tokens, K|V)"
    legacy = L.describe_layout(L.LAYOUT_LEGACY, 10, 8, 16, 128, 2)
    assert legacy.tensors[0].logical_shape == (10, 8, 16, 16, 8)
    assert legacy.k_view.dims == ("block", "head", "dim // x", "token", "dim % x")
    with pytest.raises(ValueError):
        L.describe_layout("paged", 1, 1, 16, 16)
    with pytest.raises(IndexError):
        L.element_offset(L.LAYOUT_CPU, 0, 0, 16, 0, num_kv_heads=1, block_size=16, head_size=16)


# --------------------------------------------------------------------------- fp8 + dispatch


def test_dequant_fp8_reads_e4m3_bytes():
    values = torch.tensor([1.0, -2.0, 0.5, 448.0, 0.0])
    raw = values.to(torch.float8_e4m3fn).view(torch.uint8)
    out = L.dequant_fp8(raw, 0.25)
    assert out.dtype == torch.float32
    assert torch.equal(out, values * 0.25)
    # The same bytes read as integers would be a different cache.
    assert not torch.equal(raw.float() * 0.25, out)
    with pytest.raises(TypeError):
        L.dequant_fp8(values, 1.0)


@pytest.mark.parametrize("layout", L.LAYOUTS)
def test_read_kv_dispatches_every_layout(layout):
    key, value = _random_kv((3, 16, 2, 32), torch.bfloat16, 1)
    stored = {
        L.LAYOUT_FLASH_NHD: lambda: L.kv_to_flash(key, value, "NHD"),
        L.LAYOUT_FLASH_HND: lambda: L.kv_to_flash(key, value, "HND"),
        L.LAYOUT_CPU: lambda: L.kv_to_cpu(key, value),
        L.LAYOUT_CPU_AMX: lambda: L.kv_to_cpu_amx(key, value),
        L.LAYOUT_LEGACY: lambda: L.kv_to_legacy(key, value),
    }[layout]()
    read_k, read_v = L.read_kv(stored, layout, 32)
    assert torch.equal(read_k, key) and torch.equal(read_v, value)
    with pytest.raises(ValueError):
        L.read_kv(stored, "paged", 32)


def test_every_registry_layout_has_a_reader_and_a_writer():
    """The torch side registers against the bottom layer's names, no more and no fewer."""
    from tracer.format import REGISTRY

    assert set(L.READERS) == set(REGISTRY), "readers missing or not in the registry"
    assert set(L.WRITERS) == set(REGISTRY), "writers missing or not in the registry"
    key, value = _random_kv((2, 32, 2, 32), torch.bfloat16, 2)
    for name in REGISTRY:
        read_k, read_v = L.read_kv(L.WRITERS[name](key, value), name, 32)
        assert torch.equal(read_k, key) and torch.equal(read_v, value), name


# --------------------------------------------------------------------------- vLLM itself

#: Runs in a subprocess (vLLM's import has global side effects): writes K/V through the
#: CPU backend's own cache op and checks this module reads back exactly what was written.
_VLLM_CHECK = """
import torch
import vllm._custom_ops as ops
from reference_impl import layouts as L

def check(isa, dtype, block_size, head_size, reader):
    nb, nh = 3, 2
    cache = torch.zeros(nb, nh, block_size, 2 * head_size, dtype=dtype)
    key_half, value_half = cache.view(nb, nh, 2 * block_size, head_size).chunk(2, dim=2)
    tokens = nb * block_size
    key = torch.randn(tokens, nh, head_size).to(dtype)
    value = torch.randn(tokens, nh, head_size).to(dtype)
    slots = torch.randperm(tokens)
    ops.cpu_attn_reshape_and_cache(key, value, key_half, value_half, slots, isa)
    read_k, read_v = reader(cache, head_size)
    flat_k = read_k.reshape(tokens, nh, head_size)
    flat_v = read_v.reshape(tokens, nh, head_size)
    assert torch.equal(flat_k[slots], key), (isa, "K")
    assert torch.equal(flat_v[slots], value), (isa, "V")
    print("ok", isa, dtype, block_size, head_size)

check("vec", torch.bfloat16, 16, 64, L.cpu_to_kv)
check("vec", torch.float32, 32, 128, L.cpu_to_kv)
check("vec16", torch.float16, 16, 80, L.cpu_to_kv)
if torch.cpu._is_amx_tile_supported():
    assert L.cpu_layout_for(torch.bfloat16, 32, 64, True) == L.LAYOUT_CPU_AMX
    check("amx", torch.bfloat16, 32, 64, L.cpu_amx_to_kv)
    check("amx", torch.bfloat16, 64, 128, L.cpu_amx_to_kv)
"""


def test_cpu_layouts_match_vllm_cache_writer():
    """Ground truth: vLLM's ``cpu_attn_reshape_and_cache`` writes what we read."""
    try:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vllm is not installed")
    except ValueError:
        pytest.skip("vllm is not importable")
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_VLLM_CHECK)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") >= 3
