"""Device check of deferred copies (``tracer.shared_host``): packed into the device mirror, moved later.

With the device kept busy (a large matmul queued before every step's pack), each of ``--steps``
steps packs other values into the ring's device mirror (``torch.cat(..., out=)``); every
``--every`` steps one ``flush`` moves them to the shared host memory and one event is recorded
after it. Once that event has fired every step's values must be on the host, and none before its
flush; a child process reads them where the record writer process would. Then the CPU time the
engine's thread spends per step, deferred against a copy and an event each step. Needs CUDA.

    python3 lab/h200_defer_check.py [--steps 400] [--every 8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from tracer.shared_host import HEADER_BYTES, SharedHost, finished_counter

CHILD = (
    "import mmap, struct, sys; m = mmap.mmap(int(sys.argv[1]), int(sys.argv[2])); "
    "o, n = int(sys.argv[3]), int(sys.argv[4]); print(list(struct.unpack_from(f'<{n}i', m, o)))"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=8)
    args = ap.parse_args()
    dev = torch.device("cuda")
    host = SharedHost()
    a = torch.randn(4096, 4096, device=dev)
    parts = [torch.zeros(33, dtype=torch.int32, device=dev), torch.zeros(2000, dtype=torch.int32, device=dev)]
    wrong = early = 0
    event = torch.cuda.Event(blocking=True)
    batch: list[tuple[int, int, object]] = []
    message = 0
    for step in range(args.steps):
        a @ a  # keep the device busy: a pack or copy run out of order would show
        for i, p in enumerate(parts):
            p.fill_(1000 + step * 10 + i)
        taken = host.take(sum(p.numel() for p in parts), pin=True, device=dev)
        assert taken is not None and taken[2] is not None, "no deferred stretch"
        offset, view, mirror = taken
        torch.cat(parts, out=mirror)
        batch.append((step, offset, view))
        if len(batch) == args.every or step == args.steps - 1:
            early += sum(int(v[0].item() == 1000 + s * 10) for s, _, v in batch[:-1])  # host before the flush: stale
            host.flush()
            event.record(host.stream)
            event.synchronize()
            for s, _, v in batch:
                got = v.tolist()
                wrong += got[:33] != [1000 + s * 10] * 33 or got[33:] != [1000 + s * 10 + 1] * 2000
            message += 1
            for _, off, _ in batch:
                host.sent(off, message)
            finished_counter(host._map).value = message  # as the child says once it has read them
            last = batch[-1]
            batch = []
    argv = [sys.executable, "-c", CHILD, str(host.fd), str(host.size), str(last[1]), "3"]
    child = subprocess.run(argv, pass_fds=(host.fd,), capture_output=True, text=True, check=True).stdout.strip()
    print(f"steps {args.steps}, every {args.every}: wrong {wrong}, on the host before their flush {early}")
    print(f"flushes {host.flushes}, taken {host.taken}, declined {host.declined}; the child reads {child}")
    # CPU per step on this thread, the device busy: deferred (one cat, a flush + event every `every`)
    # against a copy and an event each step (cat + copy_ + event)
    pinned = torch.empty(sum(p.numel() for p in parts), dtype=torch.int32).pin_memory()
    for mode in ("deferred", "each", "deferred", "each"):
        spent, n = 0.0, 0
        for step in range(400):
            a @ a
            t0 = time.thread_time()
            if mode == "deferred":
                off, view, mirror = host.take(pinned.numel(), pin=True, device=dev)
                torch.cat(parts, out=mirror)
                if step % args.every == args.every - 1:
                    host.flush()
                    event.record(host.stream)
                    event.query()
            else:
                pinned.copy_(torch.cat(parts), non_blocking=True)
                event.record()
            spent += time.thread_time() - t0
            n += 1
            if mode == "deferred":
                host.sent(off, 10**6 + step)
            if step % 64 == 63:
                torch.cuda.synchronize()
                finished_counter(host._map).value = 10**6 + step
        print(f"{mode:9s} engine-thread CPU {spent / n * 1e6:.1f} us/step (device busy)")
    host.close()
    assert wrong == 0 and early == 0, "deferred copies wrong"
    print("defer check ok", HEADER_BYTES)


if __name__ == "__main__":
    main()
