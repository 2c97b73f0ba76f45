"""cProfile of the tracer's calls in ``benchmarks/hot_path.py``'s stand-in engine: where its µs a step go.

python benchmarks/hot_path_profile.py [--device cpu|cuda] [--steps 2000] [--top 45]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--top", type=int, default=45)
    cli = ap.parse_args()
    from tests.factories import load_script
    from tracer.format import parse_layers

    hp = load_script("benchmarks/hot_path.py")
    args = argparse.Namespace(
        layers=28, ops=24, python_us=0.0, reqs=32, context=360, trace_layers=parse_layers("first"), device=cli.device
    )
    step, t = hp._fake_engine(args, tempfile.mkdtemp())
    for _ in range(200):
        step()
    t.drain()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(cli.steps):
        step()
    prof.disable()
    t.drain()
    t._thread.close()
    t._sink.finish()
    print(f"{cli.steps} steps on {cli.device}; per-call figures are totals over them")
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(cli.top)


if __name__ == "__main__":
    main()
