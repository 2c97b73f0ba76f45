"""Builders for tests: records, manifests, kernel batches and the engine subprocess.

One home for what several test files build, so a new required field is added once.
Each record builder gives a small, self-consistent default and takes keyword overrides::

    run_info(kv_cache=kv_spec(), options={"layers": "all"})
    run_info("flash", model=model_summary(num_layers=2))
    scheduled_step(3, query_lens=[1, 8], seq_lens=[21, 24], block_table=[[1, 2], [1, 3]])

Nothing here imports torch at module level: tests of reports and annotations run
without it. ``make_batch`` imports it when called.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tracer.format import FORMAT_VERSION, MANIFEST, SOURCES_DIR, KVCacheSpec, ModelSummary, RunInfo, StepRecord

if TYPE_CHECKING:
    import torch

#: The attention layer of the one-layer synthetic traces.
LAYER = "model.layers.0.self_attn.attn"


# -- vLLM sources and the engine subprocess ------------------------------------------------


def load_script(relpath: str) -> Any:
    """A benchmark or script of the repository (``benchmarks/hot_path.py``) as a module: they are not a package."""
    path = Path(__file__).resolve().parent.parent / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site_packages() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


#: site-packages holding the installed vLLM 0.26 (its sources are read, never imported).
SITE = _site_packages()
needs_vllm_sources = pytest.mark.skipif(SITE is None, reason="vLLM 0.26 sources not installed")

#: The session every engine test reads: tiny preset, tensors on, block size 32 on CPU.
RUN_ARGS = [
    "--model", "tiny", "--prompts", "4", "--prompt-len", "20:90", "--shared-prefix", "64",
    "--max-tokens", "12", "--seed", "0", "--kv-check-every", "3",
]  # fmt: skip
#: Query rows a step keeps in ``conftest.cpu_trace_query_rows`` (fewer than the shared prefill's rows).
QUERY_ROWS_KEPT = 5

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TORCH_COMPILE_DISABLE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


def engine_env(**extra: str) -> dict[str, str]:
    """Environment for an engine subprocess (no PAGEDTRACE_* leaking in from the parent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDTRACE_")}
    env.update(ENGINE_ENV)
    env.update(extra)
    return env


def run_engine(
    args: list[str], env: dict[str, str] | None = None, timeout: int = 900, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``args`` with this Python (in ``cwd``); fail the test with the output if it fails."""
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env or engine_env(), timeout=timeout, cwd=cwd
    )
    if proc.returncode != 0:
        pytest.fail(f"{args} exited {proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return proc


#: Prints the generated tokens of the same session, optionally with the tracer pointed elsewhere.
UNTRACED_SNIPPET = """
import json, sys
from tracer.session import run_session
from tracer.session_config import SessionConfig
r = run_session(SessionConfig(trace_dir="unused", trace=False, num_prompts=4, prompt_len=(20, 90),
                              shared_prefix=64, max_tokens=12, seed=0))
print("TOKENS=" + json.dumps(r.outputs))
"""


# -- trace records ---------------------------------------------------------------------------


def kv_spec(**overrides: Any) -> KVCacheSpec:
    """A FlashAttention (NHD) cache: 64 blocks x 16 tokens x 2 KV heads x D=64, bf16, one layer."""
    fields: dict[str, Any] = dict(
        layer_names=(LAYER,), num_blocks=64, block_size=16, num_kv_heads=2, head_size=64, dtype="bfloat16",
        cache_dtype="auto", element_size=2, shape=(64, 2, 16, 128), stride=(4096, 128, 256, 1),
        layout="flash_nhd", physical_order="(blocks, tokens, heads, K|V)", k_scale=1.0, v_scale=1.0,
        backend_kv_cache_shape=(64, 2, 16, 128), backend_stride_order=(0, 2, 1, 3),
    )  # fmt: skip
    fields.update(overrides)
    return KVCacheSpec(**fields)


def model_summary(**overrides: Any) -> ModelSummary:
    """A one-layer dummy Llama whose attention matches :func:`kv_spec` (4 heads, 2 KV heads, D=64)."""
    fields: dict[str, Any] = dict(
        name="tiny", architectures=("LlamaForCausalLM",), num_layers=1, num_attention_heads=4, num_kv_heads=2,
        head_size=64, hidden_size=256, vocab_size=1000, dtype="bfloat16", max_model_len=256, weights="dummy",
    )  # fmt: skip
    fields.update(overrides)
    return ModelSummary(**fields)


#: What differs between a FlashAttention run on an H200 and a vllm-cpu run.
_BACKENDS: dict[str, dict[str, Any]] = {
    "flash": dict(
        platform="CudaPlatform", device="cuda", device_name="NVIDIA H200",
        attention_backend="vllm.v1.attention.backends.flash_attn.FlashAttentionImpl", flash_attn_version=3,
    ),
    "cpu": dict(
        platform="CpuPlatform", device="cpu", device_name="cpu",
        attention_backend="vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl", flash_attn_version=None,
    ),
}  # fmt: skip


def run_info(backend: str = "cpu", **overrides: Any) -> RunInfo:
    """A manifest of the current format for an eager ``backend`` run (``cpu`` or ``flash``).

    No model and no KV cache unless given (``model=model_summary()``, ``kv_cache=kv_spec()``).
    """
    fields: dict[str, Any] = dict(
        format_version=FORMAT_VERSION, pagedtrace_version="0.1.0", vllm_version="0.26.0", torch_version="2.11.0",
        **_BACKENDS[backend], cudagraph_mode="NONE", enforce_eager=True, model=None, kv_cache=None, options={},
        created_at="2026-11-30T00:00:00+00:00",
    )  # fmt: skip
    fields.update(overrides)
    return RunInfo(**fields)


def step_record(**overrides: Any) -> StepRecord:
    """One decode step of one request: token 16 of a 17-token sequence in blocks (3, 5) of size 16.

    Heads as in :func:`kv_spec` (4 query heads, 2 KV heads, D=64).
    """
    fields: dict[str, Any] = dict(
        step=1, layer=LAYER, kind="request", request_ids=("0-a",), num_actual_tokens=1, query_start_loc=(0, 1),
        seq_lens=(17,), block_table=((3, 5),), slot_mapping=(5 * 16 + 0,), max_query_len=1, max_seq_len=17,
        causal=True, sliding_window=(-1, -1), logits_soft_cap=0.0, scale=0.125, use_cascade=False, num_splits=0,
        num_heads=4, num_kv_heads=2, head_size=64,
    )  # fmt: skip
    fields.update(overrides)
    return StepRecord(**fields)


def scheduled_step(
    step: int,
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: Sequence[Sequence[int]],
    *,
    block_size: int = 16,
    request_ids: Sequence[str] | None = None,
    **overrides: Any,
) -> StepRecord:
    """A step record whose ``query_start_loc`` and ``slot_mapping`` follow from the schedule.

    Each request ``b`` has ``query_lens[b]`` new tokens at the end of its ``seq_lens[b]``;
    their slots are ``block_table[b][p // block_size] * block_size + p % block_size``, as
    vLLM computes them. Request ids default to ``req-0``, ``req-1``, ...
    """
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slots = [
        row[p // block_size] * block_size + p % block_size
        for row, q, s in zip(block_table, query_lens, seq_lens, strict=True)
        for p in range(s - q, s)
    ]
    if request_ids is None:
        request_ids = [f"req-{i}" for i in range(len(seq_lens))]
    fields: dict[str, Any] = dict(
        step=step, request_ids=tuple(request_ids), num_actual_tokens=qsl[-1], query_start_loc=tuple(qsl),
        seq_lens=tuple(seq_lens), block_table=tuple(tuple(r) for r in block_table), slot_mapping=tuple(slots),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
    )  # fmt: skip
    fields.update(overrides)
    return step_record(**fields)


def with_sources_of(trace_dir: Path, donor: Path, dest: Path) -> Path:
    """A copy of ``trace_dir`` at ``dest`` carrying ``donor``'s stored vLLM sources.

    The committed H200 traces share one vLLM 0.26.0 install, so only the eager fixture keeps
    its sources; tests of the other two borrow them this way.
    """
    shutil.copytree(trace_dir, dest)
    shutil.copytree(donor / SOURCES_DIR, dest / SOURCES_DIR)
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["sources"] = json.loads((donor / MANIFEST).read_text())["sources"]
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest


# -- kernel batches (torch) ------------------------------------------------------------------

FP8_NAN = 0x7F  # an e4m3fn NaN byte: what a stale fp8 slot may hold


@dataclasses.dataclass
class Batch:
    """One varlen batch with a paged cache, and the same keys in logical order."""

    query: torch.Tensor  # [T + pad, H, D]
    key_cache: torch.Tensor  # [nb, bs, H_kv, D]; stale slots are NaN
    value_cache: torch.Tensor
    block_table: torch.Tensor  # [B, width]; garbage past each row's blocks
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    kwargs: dict  # scale, causal, window, softcap, alibi_slopes, sinks, k_scale, v_scale
    used_blocks: list[list[int]]  # physical blocks of each sequence, in logical order

    @property
    def args(self):
        """The kernels' positional arguments, in their order."""
        return (self.query, self.key_cache, self.value_cache, self.block_table, self.seq_lens, self.query_start_loc)

    def logical_kv(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s keys/values ``[s, H_kv, D]`` in position order, decoded."""
        import torch

        from reference_impl import layouts as L

        s = int(self.seq_lens[b])
        blocks = torch.tensor(self.used_blocks[b], dtype=torch.long)
        k, v = self.key_cache[blocks], self.value_cache[blocks]
        if k.dtype == torch.uint8:
            k = L.dequant_fp8(k, self.kwargs["k_scale"])
            v = L.dequant_fp8(v, self.kwargs["v_scale"])
        return k.reshape(-1, *k.shape[2:])[:s], v.reshape(-1, *v.shape[2:])[:s]

    def dense(self, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The expected output: ``dense_attention`` per sequence (fp64 by default), zeros elsewhere."""
        import torch

        from reference_impl import kernel as K

        compute_dtype = torch.float64 if compute_dtype is None else compute_dtype
        opts = {k: v for k, v in self.kwargs.items() if k not in ("k_scale", "v_scale")}
        out = torch.zeros(self.query.shape, dtype=compute_dtype)
        for b in range(self.seq_lens.shape[0]):
            q0, q1 = int(self.query_start_loc[b]), int(self.query_start_loc[b + 1])
            if q1 > q0:
                k, v = self.logical_kv(b)
                out[q0:q1] = K.dense_attention(self.query[q0:q1], k, v, compute_dtype=compute_dtype, **opts)
        return out


def make_batch(seq_lens, q_lens, *, num_kv_heads=2, group=2, head_size=16, block_size=4, causal=True,
               window=(-1, -1), softcap=0.0, alibi=False, sinks=False, fp8=False, spare_blocks=2,
               pad_rows=1, seed=0) -> Batch:  # fmt: skip
    """A random batch: sequence ``b`` has ``seq_lens[b]`` keys, the last ``q_lens[b]`` of them queried.

    Blocks are shuffled, table entries past a row's blocks are garbage (some out of range),
    and every slot no sequence owns holds NaN, so a kernel that reads one shows it.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # physical blocks, shuffled
    used, start = [], 0
    for n in need:
        used.append(order[start : start + n])
        start += n
    width = max(need) + 1
    # Entries past a row's blocks are garbage, some out of range: never to be read.
    table = torch.randint(-3, num_blocks + 50, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    for b, blocks in enumerate(used):
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)

    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key = torch.randn(shape, generator=gen)
    value = torch.randn(shape, generator=gen)
    stale = torch.ones(num_blocks, block_size, dtype=torch.bool)  # slots no sequence owns
    for s, blocks in zip(seq_lens, used, strict=True):
        for j, block in enumerate(blocks):
            stale[block, : min(block_size, s - j * block_size)] = False
    if fp8:
        key = key.to(torch.float8_e4m3fn).view(torch.uint8)
        value = value.to(torch.float8_e4m3fn).view(torch.uint8)
        key[stale], value[stale] = FP8_NAN, FP8_NAN
    else:
        key[stale], value[stale] = math.nan, math.nan

    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1] + pad_rows, num_heads, head_size, generator=gen)
    kwargs = dict(
        scale=head_size**-0.5, causal=causal, window=window, softcap=softcap,
        alibi_slopes=torch.rand(num_heads, generator=gen) * 0.5 if alibi else None,
        sinks=torch.randn(num_heads, generator=gen) * 2 if sinks else None,
        k_scale=0.5 if fp8 else 1.0, v_scale=2.0 if fp8 else 1.0,
    )  # fmt: skip
    return Batch(query, key, value, table, torch.tensor(seq_lens), torch.tensor(qsl), kwargs, used)


# -- tensor-parallel traces split from a single-rank one ---------------------------------------


def split_ranks(source: Path, dest: Path, world_size: int) -> Path:
    """Write ``source`` (a single-rank trace) as the ``world_size`` ranks' parts of a tensor-parallel trace.

    Each rank gets vLLM's split (``tracer.manifest.tensor_parallel_of``): query heads from
    ``r * H / world_size``, KV heads from ``r * H_kv // world_size`` (replicated when there are
    more ranks than KV heads). Records keep their metadata with this rank's head counts; the
    tensors of ``tracer.format.ranks.HEAD_TENSORS`` / ``KV_HEAD_TENSORS`` are cut to the rank's
    heads from the stored files (a KV write log as it is, not rebuilt), the rest copied. Rank 0
    writes ``dest`` with ``source``'s sources and ``session.json``, rank N ``dest/rank<N>``.
    """
    from safetensors.torch import load_file

    from tracer.format import TensorParallel, Trace, TraceWriter
    from tracer.format.ranks import HEAD_TENSORS, KV_HEAD_TENSORS, rank_dir

    trace = Trace.open(source)
    spec = trace.run.kv_cache
    assert spec is not None and not trace.ranks
    heads = trace.records[0].num_heads
    kv_heads = spec.num_kv_heads
    for rank in range(world_size):
        num_heads, num_kv = heads // world_size, max(1, kv_heads // world_size)
        tp = TensorParallel(rank, world_size, rank * num_heads, num_heads, rank * kv_heads // world_size, num_kv)
        cut = {
            **{name: (dim, tp.heads) for name, dim in HEAD_TENSORS.items()},
            **{name: (dim, tp.kv_heads) for name, dim in KV_HEAD_TENSORS.items()},
        }
        shape = (spec.shape[0], num_kv, *spec.shape[2:])
        part = dataclasses.replace(spec, num_kv_heads=num_kv, shape=shape)
        run = dataclasses.replace(
            trace.run,
            format_version=FORMAT_VERSION,
            kv_cache=part,
            tensor_parallel=tp,
            sources={} if rank else trace.run.sources,
        )
        out = dest / rank_dir(rank) if rank else dest
        with TraceWriter(out) as writer:
            writer.write_manifest(run)
            for gap in trace.gaps:
                writer.append(gap)
            for record in trace.records:
                tensors = None
                if record.tensors is not None:
                    stored = load_file(str(trace.tensor_path(record)))
                    tensors = {
                        name: t.narrow(cut[name][0], cut[name][1].start, len(cut[name][1])).contiguous()
                        if name in cut
                        else t
                        for name, t in stored.items()
                    }
                per_head = {
                    f: None if getattr(record, f) is None else getattr(record, f)[tp.head_start : tp.heads.stop]
                    for f in ("alibi_slopes", "sinks")
                }
                mine = dataclasses.replace(
                    record, num_heads=num_heads, num_kv_heads=num_kv, tensors=None, tensor_names=(), **per_head
                )
                writer.append(mine, tensors)
    if not (dest / SOURCES_DIR).exists() and (source / SOURCES_DIR).is_dir():
        shutil.copytree(source / SOURCES_DIR, dest / SOURCES_DIR)
    if (source / "session.json").is_file():
        shutil.copy(source / "session.json", dest / "session.json")
    return dest
