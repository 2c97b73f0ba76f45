"""The SM-clock reading side of ``lab/gpu_clocks.py``: each step's clock, the full-clock steps."""

from __future__ import annotations

import pytest

from tests.factories import load_script


@pytest.fixture(scope="module")
def gpu_clocks():
    return load_script("lab/gpu_clocks.py")


def test_load_samples_sorts_and_skips_a_cut_line(gpu_clocks, tmp_path):
    path = tmp_path / "clocks.txt"
    path.write_text("10.04 1980 0x0 61\n10.00 345 0x1 12\n10.02 1965 0x0 58\n10.06 19")
    assert gpu_clocks.load_samples(path) == [(10.0, 345, 1, 12), (10.02, 1965, 0, 58), (10.04, 1980, 0, 61)]


def test_a_step_gets_the_lowest_clock_seen_while_it_ran(gpu_clocks):
    samples = [(10.00, 1980, 0, 60), (10.02, 345, 1, 10), (10.04, 1980, 0, 60), (10.06, 1965, 0, 60)]
    steps = [
        (10.001, 0.005),  # inside 10.00..10.02: the clock it started at
        (10.015, 0.010),  # spans the 345 MHz sample
        (10.041, 0.004),
        (9.5, 0.005),  # before the first sample
        (12.0, 0.005),  # over a second after the last
    ]
    assert gpu_clocks.step_clocks(steps, samples) == [1980, 345, 1980, None, None]


def test_full_clock_steps_keep_only_steps_near_the_top_clock(gpu_clocks):
    steps = [(0.0, 0.005), (1.0, 0.011), (2.0, 0.006), (3.0, 0.007)]
    clocks = [1980, 345, 1785, None]
    # 0.9 x 1980 = 1782: 1785 MHz is full clock, 345 MHz and an unknown clock are not
    assert gpu_clocks.full_clock_steps(steps, clocks, 1980) == [0.005, 0.006]
    assert gpu_clocks.full_clock_steps(steps, clocks, 1980, share=0.95) == [0.005]
