"""``lab/probe_analysis.py``: the readings of an overhead probe's run, and runs pooled."""

from __future__ import annotations

import json

import pytest

from tests.factories import load_script


@pytest.fixture(scope="module")
def analysis():
    return load_script("lab/probe_analysis.py")


def test_quiet_rounds_are_chosen_by_the_untraced_pass_alone(analysis):
    assert analysis.quiet_rounds([2.0, 1.6, 1.62, 1.7, 1.64], 0.03) == [1, 2, 4]


def test_decode_steps_leave_out_each_batchs_prefill(analysis):
    steps = [[float(i), 0.001 * i] for i in range(130)]
    kept = analysis.decode_steps(steps)
    assert len(kept) == 126 and 0.0 not in kept and 0.001 not in kept and 0.065 not in kept and 0.066 not in kept


def test_a_passs_prefill_and_decode_seconds_are_summed_apart(analysis):
    steps = [[float(i), 0.001 * i] for i in range(130)]  # two batches of 65 steps
    prefill, decode = analysis.phase_sums(steps)
    assert prefill == pytest.approx(0.001 * (0 + 1 + 65 + 66))
    assert prefill + decode == pytest.approx(sum(d for _, d in steps))


def test_slow_steps_count_the_share_and_the_time_over_the_bar(analysis):
    fast, slow = [0.0, 0.005], [0.0, 0.010]
    passes = [[fast, fast] + [fast] * 6 + [slow, slow], [fast, fast] + [fast] * 8]  # prefill steps first
    share, extra = analysis.slow_steps(passes, 0.006)
    assert share == pytest.approx(2 / 16) and extra == pytest.approx(2 * 0.004 / 2)


def test_round_lines_give_each_pass_its_figures(analysis):
    text = (
        "round 0 untraced       1.614 s at 1796284662.9 {'gc_s': 0.0008, 'host': {'vol': 4}}\n"
        "round 0 metadata       1.723 s at 1796284664.9 {'error': None, 'host': {'vol': 440}}\n"
        "PIECEWISE: median of 1 rounds\n"
    )
    stats = analysis.pass_stats_from_text(text)
    assert stats == {
        "untraced": [{"gc_s": 0.0008, "host": {"vol": 4}}],
        "metadata": [{"error": None, "host": {"vol": 440}}],
    }


def test_a_run_reads_into_one_table(analysis, tmp_path, capsys):
    step = [[0.0, 0.005]] * 65
    run = {
        "summary": {"untraced": {"all_s": [1.6, 2.0, 1.61]}, "metadata": {"all_s": [1.62, 2.2, 1.63]}},
        "pass_steps": {"untraced": [step] * 3, "metadata": [step] * 3},
        "pass_stats": {"untraced": [{"host": {"vol": 4}}] * 3, "metadata": [{"host": {"vol": 450}}] * 3},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert analysis.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "quiet (untraced within 3% of its best, 1.600 s): 2" in out
    assert "450/pass" in out and "4/pass" in out


def test_the_table_gives_each_variants_cpu_and_idle_looks_a_pass(analysis, tmp_path, capsys):
    step = [[0.0, 0.005]] * 65
    host = {"vol": 9, "proc_cpu_ms": 2100, "child_cpu_ms": 35}
    run = {
        "summary": {"untraced": {"all_s": [1.6, 2.0]}, "metadata": {"all_s": [1.62, 2.2]}},
        "pass_steps": {"untraced": [step] * 2, "metadata": [step] * 2},
        "pass_stats": {
            "untraced": [{"host": {"vol": 4, "proc_cpu_ms": 2000, "child_cpu_ms": 0}}] * 2,
            "metadata": [
                {"host": host, "idle_looks": 2, "idle_hand_overs": 1},
                {"host": host, "idle_looks": 4, "idle_hand_overs": 3},
            ],
        },
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert analysis.main([str(path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("metadata "))
    assert line.split()[-4:] == ["9/pass", "2100ms", "35ms", "3/2"]  # the medians of the looks and hand-overs


def test_the_idle_column_names_the_hand_over_where_the_probe_recorded_it(analysis, tmp_path, capsys):
    step = [[0.0, 0.005]] * 65
    host = {"vol": 4, "proc_cpu_ms": 2000, "child_cpu_ms": 30}
    engine = {"host": host, "idle": "engine", "idle_looks": 0, "idle_hand_overs": 4}
    run = {
        "summary": {v: {"all_s": [1.6, 2.0]} for v in ("untraced", "metadata", "metadata-timer")},
        "pass_steps": {v: [step] * 2 for v in ("untraced", "metadata", "metadata-timer")},
        "pass_stats": {
            "untraced": [{"host": host}] * 2,
            "metadata": [engine, engine],
            "metadata-timer": [{**engine, "idle": "timer", "idle_hand_overs": 0}, {**engine, "idle": "off"}],
        },
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    assert analysis.main([str(path)]) == 0
    lines = {x.split()[0]: x.split() for x in capsys.readouterr().out.splitlines() if x.startswith("metadata")}
    assert lines["metadata"][-2:] == ["engine", "0/4"] and lines["metadata-timer"][-2:] == ["mixed", "0/2"]
    assert lines["metadata"][-3] == "30ms"


def test_a_run_without_untraced_passes_is_one_line(analysis, tmp_path, capsys):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"summary": {"metadata": {"all_s": [1.0]}}}))
    assert analysis.main([str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"probe_analysis: the run has no untraced passes ({path})"


def _run(tmp_path, name: str, untraced: list[float], **variants: list[float]):
    path = tmp_path / name
    path.write_text(
        json.dumps({"summary": {"untraced": {"all_s": untraced}} | {v: {"all_s": s} for v, s in variants.items()}})
    )
    return str(path)


def test_runs_pool_every_round_as_one_sample(analysis, tmp_path, capsys):
    one = _run(tmp_path, "one.json", [1.0, 2.0], metadata=[1.1, 2.2], inline=[1.05, 2.1])
    two = _run(tmp_path, "two.json", [1.5, 1.5, 3.0], inline=[1.5, 1.5, 3.0])
    assert analysis.main([one, two, "--pair", "inline/metadata"]) == 0
    pooled = capsys.readouterr().out.split("pooled over 2 runs")[1].splitlines()
    assert pooled[1].split()[:3] == ["metadata", "/", "untraced"] and "1.100x" in pooled[1]
    assert "2 rounds, 1 runs" in pooled[1]
    # inline: 1.05 twice, 1.0 three times -> geometric mean 1.05 ** (2 / 5)
    assert f"{1.05**0.4:.3f}x" in pooled[2] and "5 rounds, 2 runs" in pooled[2]
    assert f"{1.05 / 1.1:.3f}x" in pooled[3] and "2 rounds, 1 runs" in pooled[3]


def test_a_printed_output_belongs_to_the_json_before_it(analysis, tmp_path):
    a, t, b = tmp_path / "a.json", tmp_path / "a.txt", tmp_path / "b.json.xz"
    assert analysis.runs_of([a, t, b]) == [(a, t), (b, None)]
    with pytest.raises(ValueError, match="goes right after its JSON file"):
        analysis.runs_of([t, a])


def test_a_bad_pair_is_one_line(analysis, tmp_path, capsys):
    assert analysis.main([_run(tmp_path, "r.json", [1.0]), "--pair", "metadata"]) == 2
    assert capsys.readouterr().err.strip() == "probe_analysis: --pair 'metadata': expected TOP/BOTTOM, two variants"


def test_the_probe_rejects_an_unknown_variant_before_it_starts_an_engine():
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parent.parent / "lab" / "h200_overhead_probe.py"
    proc = subprocess.run(
        [sys.executable, str(probe), "--variants", "untraced,metadata-inlien"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].startswith(
        "h200_overhead_probe.py: error: --variants: unknown metadata-inlien ("
    )


def test_a_timed_variants_pieces_are_the_medians_over_its_passes(analysis):
    passes = [
        {"parts_us_per_step": {"queue_host_copies": 40.0, "submit": 30.0}, "main_us_per_step": 150.0},
        {"parts_us_per_step": {"queue_host_copies": 60.0, "submit": 10.0}, "main_us_per_step": 170.0},
        {"parts_us_per_step": {"queue_host_copies": 50.0}, "main_us_per_step": 160.0},
    ]
    line = analysis.pieces_line(passes)
    assert line == (
        "pieces, median µs a step over 3 passes: queue_host_copies 50, submit 10; "
        "tracer calls 160 µs a step (median of 3 passes)"
    )
    assert analysis.pieces_line([{"host": {"vol": 4}}]) == ""


def test_the_blocks_inside_each_piece_are_the_medians_over_its_passes(analysis):
    passes = [
        {"parts_us_per_step": {"submit": 30.0}, "parts_blocks_per_pass": {"submit": 24, "_end": 22, "_req_ids": 0}},
        {"parts_us_per_step": {"submit": 20.0}, "parts_blocks_per_pass": {"submit": 30, "_end": 2, "_req_ids": 0}},
        {"parts_us_per_step": {"submit": 10.0}, "parts_blocks_per_pass": {"submit": 26, "_end": 20, "_req_ids": 0}},
    ]
    assert analysis.pieces_line(passes) == (
        "pieces, median µs a step over 3 passes: submit 20; blocked inside, median a pass: submit 26, _end 20"
    )
    quiet = [{"parts_us_per_step": {"submit": 1.0}, "parts_blocks_per_pass": {"submit": 0}}]
    assert analysis.pieces_line(quiet).endswith("blocked inside, median a pass: none")


def test_the_probe_counts_the_blocks_inside_a_timed_piece():
    """``_timed`` with ``blocks``: a call that sleeps blocks the thread at least once; a pure one not."""
    import resource
    import time

    if not hasattr(resource, "RUSAGE_THREAD"):
        pytest.skip("RUSAGE_THREAD is Linux's")
    probe = load_script("lab/h200_overhead_probe.py")
    spent, blocks = {"sleep": 0.0, "sum": 0.0}, {"sleep": 0, "sum": 0}
    sleep = probe._timed(lambda: time.sleep(0.01), spent, "sleep", blocks)
    add = probe._timed(lambda: sum(range(1000)), spent, "sum", blocks)
    for _ in range(3):
        sleep()
        add()
    assert blocks["sleep"] >= 3 and blocks["sum"] == 0
    assert spent["sleep"] >= 0.03
