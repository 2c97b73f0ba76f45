"""Device check of ``tracer.shared_host``'s memory, and what single CUDA calls cost on this host.

A ``memfd`` mapped, ``torch.frombuffer`` over it, page-locked with ``cudaHostRegister``: is it
pinned, does a device copy into it land, does a child process see it, is ``copy_(non_blocking=True)``
into it asynchronous (with kernels queued before it); then the CPU time a call takes (``cat`` +
``copy_``, ``Event.record`` / ``query``, ``cudaMemcpyAsync`` through ctypes). Needs a CUDA device.

    python3 lab/h200_shared_host_check.py
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import subprocess
import sys
import time

import torch

SIZE = 1 << 20
CHILD = (
    "import mmap, struct, sys; m = mmap.mmap(int(sys.argv[1]), int(sys.argv[2])); "
    "print(struct.unpack_from('<4i', m, 400))"
)


def per_call(f, n: int = 2000) -> float:
    """CPU µs one call of ``f`` takes on this thread (``time.thread_time``), after 50 untimed."""
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    t0 = time.thread_time()
    for _ in range(n):
        f()
    spent = (time.thread_time() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(spent, 2)


def main() -> None:
    dev = torch.device("cuda")
    fd = os.memfd_create("pagedtrace-check")
    os.ftruncate(fd, SIZE)
    mm = mmap.mmap(fd, SIZE)
    host = torch.frombuffer(mm, dtype=torch.int32)
    print("frombuffer ok", host.numel(), "pinned before", host.is_pinned())
    rc = int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), SIZE, 0))
    print("cudaHostRegister rc", rc, "pinned after", host.is_pinned())
    src = torch.arange(SIZE // 4, dtype=torch.int32, device=dev)
    big = torch.empty(1 << 28, dtype=torch.int8, device=dev)
    torch.cuda.synchronize()
    host[: SIZE // 4].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print("values ok", bool((host[: SIZE // 4] == torch.arange(SIZE // 4, dtype=torch.int32)).all()))
    argv = [sys.executable, "-c", CHILD, str(fd), str(SIZE)]
    print("child sees", subprocess.run(argv, pass_fds=(fd,), capture_output=True, text=True).stdout.strip())

    table = torch.randint(0, 1000, (512, 256), dtype=torch.int32, device=dev)
    slots = torch.arange(8192, dtype=torch.int64, device=dev)
    seq_lens = torch.arange(512, dtype=torch.int32, device=dev)
    starts = torch.arange(513, dtype=torch.int32, device=dev)
    parts = [slots[:32].view(torch.int32), starts[:33], seq_lens[:32], table[:32].reshape(-1)]
    n = sum(p.numel() for p in parts)
    dst = host[:n]
    print("cat+copy_ us", per_call(lambda: dst.copy_(torch.cat(parts), non_blocking=True)))
    pinned = torch.empty(n, dtype=torch.int32, pin_memory=True)
    print("cat+copy_ into torch-pinned us", per_call(lambda: pinned.copy_(torch.cat(parts), non_blocking=True)))
    event = torch.cuda.Event(blocking=True)
    print("event.record us", per_call(event.record))
    print("event.query us", per_call(event.query))
    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
    runtime = None
    for name in ["libcudart.so.13", "libcudart.so.12", *sorted(libs)]:
        try:
            runtime = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if runtime is not None:
        memcpy = runtime.cudaMemcpyAsync
        memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        stream = torch.cuda.current_stream().cuda_stream
        offsets = [0, 64, 97, 129]
        pieces = [(host.data_ptr() + 4 * o, p.data_ptr(), p.numel() * 4) for o, p in zip(offsets, parts, strict=True)]
        print(
            "ctypes cudaMemcpyAsync us", per_call(lambda: memcpy(host.data_ptr(), table.data_ptr(), 32768, 2, stream))
        )

        def four() -> None:
            for to, source, size in pieces:
                memcpy(to, source, size, 2, stream)

        print("4x ctypes cudaMemcpyAsync us", per_call(four))
    # Asynchronous? Queue kernels first: the copy must return before they end.
    for _ in range(3):
        for _ in range(20):
            big.add_(1)
        t0 = time.perf_counter()
        host[: 32 * 256].copy_(table[:32].reshape(-1), non_blocking=True)
        t1 = time.perf_counter()
        done = torch.cuda.Event()
        done.record()
        fired = done.query()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        waited = time.perf_counter() - t2
        print(
            f"copy_ call {1e6 * (t1 - t0):.1f} us, event done right after: {fired}, sync waited {1e6 * waited:.0f} us"
        )
    torch.cuda.synchronize()
    print("unregister rc", int(torch.cuda.cudart().cudaHostUnregister(host.data_ptr())))


if __name__ == "__main__":
    main()
