"""reports.attention_pages and reports.png: the report's attention pages, built from a committed H200 trace,
drawn over the physical blocks, linked from the step pages, and opened in headless Chromium."""

from __future__ import annotations

import dataclasses
import re
import struct
import zlib

import pytest

from pagedtrace.cli import main
from reports.attention_pages import _request_maps, attention_page_name
from reports.png import heat_png
from reports.step_pages import step_view
from tests.conftest import FIXTURES, fixture_path
from tests.test_reports import CHROMIUM, chromium, png_is_blank
from tracer.format import Trace
from tracer.format.attention import AttentionMap, summarize_row
from tracer.format.groups import trace_groups

GEMMA = fixture_path("h200-gemma2-softcap-window")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention") / "site"
    assert main(["report", str(GEMMA), "-o", str(out), "--attention"]) == 0
    return out


def test_a_page_per_captured_step_and_layer_linked_from_its_step(site):
    names = sorted(p.name for p in site.glob("attention-*.html"))
    assert names == [attention_page_name(s, f"model.layers.{i}.self_attn.attn") for s in (4, 5) for i in (0, 1)]
    step = (site / "step-000005.html").read_text()
    assert 'href="attention-000005-L0.html"' in step and 'href="attention-000005-L1.html"' in step
    page = (site / "attention-000005-L0.html").read_text()
    assert page.count('<img src="data:image/png;base64,') == 2 * 16  # two requests, sixteen heads
    assert "KV-cache group 0: sliding window 64 tokens" in page
    # Request 1's row is [1, 5, 6, 7, 8]: each block labelled with its physical id; the window edge drawn.
    assert all(f">{b}</text>" in page for b in (1, 5, 6, 7, 8))
    assert '<polyline class="edge window"' in page and '<polyline class="edge causal"' in page
    assert "Downsampled" not in page  # 76 keys: one column each
    assert '<polyline class="edge window"' not in (site / "attention-000005-L1.html").read_text()  # full layer


def test_step_page_draws_a_grid_per_group_and_marks_null_blocks():
    trace = Trace.open(FIXTURES / "h200-gemma2-default-v3")
    groups = trace_groups(trace)
    first, second = [r for r in trace.records if r.kind == "request"][:2]
    page = step_view(first, trace.run, (first.layer, second.layer), [], None, None, (), groups=groups,
                     group_records=[second])  # fmt: skip
    assert [g.label.split(":")[0] for g in page.grids] == ["KV-cache group 0", "KV-cache group 1"]
    assert page.grids[1].explain.startswith("layer 0 is in group 0") and page.rows == page.grids[0].rows
    dropped = dataclasses.replace(first, block_table=((0, *first.block_table[0][1:]), *first.block_table[1:]))
    cells = step_view(dropped, trace.run, (first.layer,), [], None, None, (), groups=groups).grids[0].rows[0].cells
    assert cells[0].null and "the null block" in cells[0].title and not cells[1].null


def _map(seq_len: int, rows: int, cols: int) -> AttentionMap:
    edges = tuple(round(i * seq_len / cols) for i in range(cols + 1))
    heads = ((tuple(1.0 / cols for _ in range(cols)),) * rows,)
    return AttentionMap(
        step=1, layer="model.layers.0.self_attn.attn", request=0, request_id="r", seq_len=seq_len, block_size=16,
        physical=tuple(range(1, seq_len // 16 + 2)), null_block=0, group="", causal=True, window=None,
        positions=tuple(range(seq_len - rows, seq_len)), rows_total=4 * rows, col_edges=edges, heads=heads,
        summaries=(summarize_row(0, [1.0 / seq_len] * seq_len),),
    )  # fmt: skip


def test_a_long_context_is_downsampled_and_says_so():
    maps = _request_maps(_map(8192, 256, 512))
    assert maps.width <= 720 and "8192 key positions binned into 512 columns" in maps.note
    assert "256 of 1024 query rows drawn" in maps.note
    assert sum(1 for b in maps.blocks if b.label) < len(maps.blocks) == 512  # labels thinned, boundaries all drawn


def test_png_writer_writes_a_valid_png():
    data = heat_png([[0.0, 1.0], [0.5, 0.25], [1.0, 0.0]], 1.0)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (2, 3)
    idat = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[idat - 4 : idat])
    raw = zlib.decompress(data[idat + 4 : idat + 4 + length])
    assert raw[:7] == bytes([0, 255, 255, 255, 8, 48, 107])  # filter 0, white (0.0), dark blue (1.0)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium")
def test_attention_page_in_headless_chromium(site, tmp_path):
    page = (site / "attention-000004-L0.html").as_uri()
    proc = chromium(["--enable-logging=stderr", "--v=0", "--dump-dom", page], tmp_path / "profile")
    assert [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line] == []
    assert len(re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]+"', proc.stdout)) == 32
    shot = tmp_path / "attention.png"
    proc = chromium(["--window-size=1400,1100", f"--screenshot={shot}", page], tmp_path / "profile")
    assert shot.is_file(), proc.stderr[-2000:]
    assert not png_is_blank(shot)
