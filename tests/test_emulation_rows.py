"""reference_impl.emulation_rows: decode rows batched by length equal each row emulated alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

from reference_impl.emulation import CPU_VEC_TOWARD_ZERO, FLASH, FLEX_EAGER, TRITON, Emulation
from reference_impl.emulation_rows import StepRounding, emulate_decode, emulate_sequence


def _rounding(h: int, g: int, d: int, variant: str, emulation: Emulation, gen: torch.Generator) -> StepRounding:
    fp8 = variant in ("fp8", "fp8-query")
    return StepRounding(
        num_kv_heads=h,
        group=g,
        head_size=d,
        score_scale=d**-0.5 * (0.6 if variant == "fp8-query" else 1.0),
        causal=True,
        window=(40, -1) if variant == "window" else (-1, -1),
        softcap=30.0 if variant == "softcap" else 0.0,
        alibi_slopes=torch.rand(h * g, generator=gen) if variant == "alibi" else None,
        sinks=torch.randn(h * g, generator=gen) if variant == "sinks" else None,
        k_scale=0.7 if fp8 else 1.0,
        v_scale=1.3 if fp8 else 1.0,
        fp8_query=variant == "fp8-query",
        fp8_cache=fp8,
        element=torch.float16 if variant == "fp16" else torch.bfloat16,
        p_offset=256.0 if variant == "fp8-query" else 1.0,
        emulation=emulation,
    )


@pytest.mark.parametrize(("h", "g", "d"), [(2, 2, 64), (1, 1, 64), (1, 4, 32), (4, 1, 128), (2, 7, 128)])
@pytest.mark.parametrize(
    ("variant", "emulation"),
    [
        ("plain", FLASH),
        ("plain", FLEX_EAGER),
        ("sinks", FLEX_EAGER),
        ("softcap", FLASH),
        ("softcap", TRITON),
        ("alibi", FLASH),
        ("window", FLASH),
        ("sinks", FLASH),
        ("fp16", FLASH),
        ("fp8", FLASH),
        ("fp8", CPU_VEC_TOWARD_ZERO),
        ("fp8-query", FLASH),
    ],
)
def test_decode_rows_batched_equal_each_row_alone(h, g, d, variant, emulation):
    gen = torch.Generator().manual_seed(h * 100 + g * 10 + d)
    r = _rounding(h, g, d, variant, emulation, gen)
    block_size, num_blocks = 16, 200
    # Rows of equal length share a batch; 33 and 2 keys end inside a block, 48 on its edge.
    lens = [33, 100, 33, 2, 48, 100, 33, 250]
    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    key_cache = torch.randn(num_blocks, block_size, h, d, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, h, d, generator=gen)
    query = torch.randn(len(lens) + 3, h * g, d, generator=gen)
    if r.fp8_cache:
        key_cache = key_cache.to(torch.float8_e4m3fn).view(torch.uint8)
        value_cache = value_cache.to(torch.float8_e4m3fn).view(torch.uint8)
        query = query.to(torch.float8_e4m3fn) if r.fp8_query else query.to(dtype)
    else:
        key_cache, value_cache, query = key_cache.to(dtype), value_cache.to(dtype), query.to(dtype)
    blocks = torch.randperm(num_blocks, generator=gen).tolist()
    table = [blocks[16 * b : 16 * b + -(-n // block_size)] for b, n in enumerate(lens)]
    decode = [(b, b + 2, n) for b, n in enumerate(lens)]  # query rows 2.. (rows 0, 1 are another sequence's)

    batched = emulate_decode(query, key_cache, value_cache, table, decode, r)

    stored = (key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)) if r.fp8_cache else None
    for i, (b, row, n) in enumerate(decode):
        ids = torch.tensor(table[b])
        k, v = (
            (c if stored is None else stored[j]).index_select(0, ids).flatten(0, 1)[:n]
            for j, c in enumerate((key_cache, value_cache))
        )
        alone = emulate_sequence(query, k, v, row, 1, r)
        assert torch.equal(batched[i].view(torch.int32), alone[0].view(torch.int32)), f"row {i} ({n} keys)"
