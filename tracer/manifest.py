"""What describes the run: versions, device, model and KV cache, for ``manifest.json``.

Everything here runs once per trace, off the hot path: ``Tracer`` calls
:func:`build_run_info` when it writes the first record. vLLM and torch are imported
lazily, inside the functions, so importing this module needs neither.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tracer.format import (
    FORMAT_VERSION,
    REGISTRY,
    KVCacheSpec,
    ModelSummary,
    RunInfo,
    TensorParallel,
    TraceWriter,
    __version__,
    layer_index,
    read_sources,
    store_sources,
)
from tracer.kv_groups import kv_cache_groups, null_block_id
from tracer.layer_capture import dtype_name
from tracer.options import ENV_MODEL_NAME, ENV_WEIGHTS, TracerOptions

__all__ = [
    "build_run_info",
    "import_attr",
    "kv_cache_spec",
    "kv_layout_of",
    "tensor_parallel_of",
    "tp_rank",
    "vllm_sources",
    "write_manifest",
]

logger = logging.getLogger("pagedtrace")


def import_attr(module_name: str, attr: str) -> Any:
    """``module_name.attr``, or None when this vLLM build lacks the module (not an error)."""
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a backend this build lacks is not an error
        logger.debug("pagedtrace: %s not importable: %s", module_name, exc)
        return None
    return getattr(module, attr, None)


def tp_rank() -> int:
    """This worker's tensor-parallel rank; 0 in a single process."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - not initialised: a single process
        return 0


def tensor_parallel_of(impl: Any, cfg: Any) -> TensorParallel | None:
    """This worker's rank, world size and head ranges; None without vLLM's parallel state or a backend.

    vLLM's ``QKVParallelLinear`` gives rank ``r`` of ``tp`` the query heads from ``r * H / tp``
    and, with ``H_kv`` KV heads, the KV heads from ``r * H_kv // tp`` (a KV head replicated on
    ``tp / H_kv`` ranks when ``tp > H_kv``); the backend's ``num_heads`` / ``num_kv_heads`` are
    this rank's counts.
    """
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

        world = int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - not initialised: no parallel state to record
        return None
    num_heads, num_kv_heads = getattr(impl, "num_heads", None), getattr(impl, "num_kv_heads", None)
    mc = getattr(cfg, "model_config", None)
    if not isinstance(num_heads, int) or not isinstance(num_kv_heads, int) or mc is None:
        return None
    rank = tp_rank()
    total_kv = int(mc.get_total_num_kv_heads())
    return TensorParallel(
        rank=rank,
        world_size=world,
        head_start=rank * num_heads,
        num_heads=num_heads,
        kv_head_start=rank * total_kv // world,
        num_kv_heads=num_kv_heads,
    )


def vllm_sources() -> dict[str, str]:
    """The engine's own copies of ``SOURCE_FILES`` (those it has)."""
    try:
        import vllm

        return read_sources(Path(vllm.__file__).parent.parent)
    except (ImportError, OSError):
        return {}


def kv_layout_of(impl: Any, kv_cache: Any) -> str:
    """Name the layout of ``kv_cache`` as the backend ``impl`` reads it."""
    if type(impl).__name__ == "CPUAttentionBackendImpl":
        # The CPU kernel's ISA decides the packing: "amx" tiles K and V differently.
        return "cpu_amx" if getattr(impl, "isa", None) == "amx" else "cpu"
    stride = kv_cache.stride()
    # logical (blocks, heads, tokens, 2D): NHD keeps the heads dim inside a token
    return "flash_nhd" if stride[1] < stride[2] else "flash_hnd"


def build_run_info(
    options: TracerOptions,
    vllm_config: Any,
    sources: dict[str, dict[str, str]],
    *,
    impl: Any = None,
    kv_cache: Any = None,
    layer: str = "",
    runner: Any = None,
) -> RunInfo:
    """Collect versions, device, model and KV-cache facts for the manifest.

    ``vllm_config``: the model runner's (None: vLLM's current config, if any). ``impl``,
    ``kv_cache``, ``layer``: the first recorded forward's backend instance, cache tensor
    and layer name; without ``impl`` the manifest has no ``KVCacheSpec``. ``runner``: the
    model runner, whose ``kv_cache_config`` gives the KV-cache groups (:mod:`tracer.kv_groups`).
    """
    import torch
    import vllm

    cfg = vllm_config
    if cfg is None:
        try:
            from vllm.config import get_current_vllm_config

            cfg = get_current_vllm_config()
        except Exception:  # noqa: BLE001
            cfg = None
    platform_name, device, device_name = "unknown", "cpu", "cpu"
    try:
        from vllm.platforms import current_platform

        platform_name = type(current_platform).__name__
        device = str(current_platform.device_type)
        device_name = current_platform.get_device_name() if device == "cuda" else _cpu_name()
    except Exception:  # noqa: BLE001
        pass
    model = _model_summary(cfg)
    kv = None
    backend = "unknown"
    fa_version = None
    tensor_parallel = None
    if impl is not None:
        backend = f"{type(impl).__module__}.{type(impl).__qualname__}"
        fa_version = getattr(impl, "vllm_flash_attn_version", None)
        kv = kv_cache_spec(impl, kv_cache, layer, cfg)
        tensor_parallel = tensor_parallel_of(impl, cfg)
    cc = getattr(cfg, "compilation_config", None)
    return RunInfo(
        format_version=FORMAT_VERSION,
        pagedtrace_version=__version__,
        vllm_version=str(vllm.__version__),
        torch_version=str(torch.__version__),
        platform=platform_name,
        device=device,
        device_name=device_name,
        attention_backend=backend,
        flash_attn_version=fa_version,
        cudagraph_mode=str(getattr(cc, "cudagraph_mode", "unknown")).removeprefix("CUDAGraphMode."),
        enforce_eager=bool(getattr(getattr(cfg, "model_config", None), "enforce_eager", False)),
        model=model,
        kv_cache=kv,
        options=options.to_json(),
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        sources=sources,
        extra={
            "pid": os.getpid(),
            "model_attention": _model_attention(cfg),
            "torch_compile": _torch_compile(),
            **_cpu_attention(impl),
        },
        kv_cache_groups=kv_cache_groups(runner),
        null_block=null_block_id(),
        tensor_parallel=tensor_parallel,
    )


def _torch_compile() -> bool:
    """Whether ``torch.compile`` compiles in the engine's process (``TORCH_COMPILE_DISABLE`` unset).

    vLLM's Flex backend calls a ``torch.compile``'d ``flex_attention`` whatever the graph mode; with
    compilation disabled (``pagedtrace run --eager`` sets ``TORCH_COMPILE_DISABLE=1``) that is
    PyTorch's ``math_attention``, which rounds differently (``reference_impl.emulation.FLEX_EAGER``).
    """
    import torch._dynamo

    return not bool(torch._dynamo.config.disable)


def _cpu_attention(impl: Any) -> dict[str, Any]:
    """``{"cpu_attention": ...}`` for vLLM's CPU backend: which kernel ran and how it rounds to bf16.

    The CPU kernel is chosen by ``impl.isa`` (``cpu_attn._get_attn_isa``: ``amx``, ``vec``,
    ``vec16``, ``neon``, ...), and its fp32 -> bf16 conversions by the build of vLLM's
    extension that ``CpuPlatform.import_kernels`` loads on this CPU: ``vllm._C`` (AVX-512 with
    AVX512-BF16) converts with ``vcvtneps2bf16``, round to nearest even; ``vllm._C_AVX512``
    (AVX-512 without BF16) and ``vllm._C_AVX2`` drop the low 16 bits of the fp32 value, round
    toward zero (``csrc/cpu/cpu_types_x86.hpp``). The verdict's baseline rounds as the kernel
    did (``reference_impl.emulation.emulation_of``). Other architectures: ``unknown``.
    Empty for other backends.
    """
    if type(impl).__name__ != "CPUAttentionBackendImpl":
        return {}
    isa = getattr(impl, "isa", None)
    return {"cpu_attention": cpu_attention(None if isa is None else str(isa))}


def cpu_attention(isa: str | None) -> dict[str, Any]:
    """vLLM's CPU attention kernel ``isa`` on this CPU: ``{"isa", "bf16_conversion", "extension"}``.

    How the extension this CPU loads converts fp32 to bf16: see :func:`_cpu_attention`.
    """
    import platform

    import torch

    conversion, extension = "unknown", None
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "x86"):
        if torch.cpu._is_avx512_supported():
            bf16 = torch.cpu._is_avx512_bf16_supported()
            conversion, extension = ("nearest", "vllm._C") if bf16 else ("toward_zero", "vllm._C_AVX512")
        else:
            conversion, extension = "toward_zero", "vllm._C_AVX2"
    return {"isa": isa, "bf16_conversion": conversion, "extension": extension}


def _model_attention(cfg: Any) -> dict[str, Any]:
    """The model config's attention settings, for ``tracer.format.metadata``'s flag check.

    Raw config values, not the backend's: the check compares them with what each layer's
    impl reported, so they must come from the other side.
    """
    mc = getattr(cfg, "model_config", None)
    if mc is None:
        return {}
    hf = mc.hf_text_config
    layer_types = getattr(hf, "layer_types", None)
    softcap = getattr(hf, "attn_logit_softcapping", None)
    return {
        "sliding_window": getattr(hf, "sliding_window", None),
        "cache_sliding_window": getattr(getattr(cfg, "cache_config", None), "sliding_window", None),
        "layer_types": list(layer_types) if layer_types else None,
        "attn_logit_softcapping": None if softcap is None else float(softcap),
    }


def write_manifest(
    writer: TraceWriter,
    options: TracerOptions,
    vllm_config: Any,
    *,
    impl: Any = None,
    kv_cache: Any = None,
    layer: str = "",
    runner: Any = None,
) -> RunInfo:
    """Write ``manifest.json`` (small, atomically) first; with ``impl``, store the sources and rewrite it.

    Without a recorded forward (``impl``) the manifest has no ``KVCacheSpec`` yet and no
    sources. ``extra["finished"]`` is False: the tracer sets it when it stops, so a trace
    whose process was killed says so. Returns what is on disk; raises ``OSError``.
    """
    run = build_run_info(options, vllm_config, {}, impl=impl, kv_cache=kv_cache, layer=layer, runner=runner)
    run = replace(run, extra={**run.extra, "finished": False})
    # Before the sources: a disk that fills while they are copied still leaves a manifest.
    writer.write_manifest(run)
    if impl is None:
        return run
    sources = store_sources(writer, vllm_sources())
    if sources:
        run = replace(run, sources=sources)
        writer.write_manifest(run)
    return run


def _model_summary(cfg: Any) -> ModelSummary | None:
    if cfg is None or cfg.model_config is None:
        return None
    mc = cfg.model_config
    hf = mc.hf_text_config
    return ModelSummary(
        name=str(os.environ.get(ENV_MODEL_NAME) or mc.model),
        architectures=tuple(getattr(mc.hf_config, "architectures", None) or ()),
        num_layers=int(getattr(hf, "num_hidden_layers", 0) or 0),
        num_attention_heads=int(getattr(hf, "num_attention_heads", 0) or 0),
        num_kv_heads=int(mc.get_total_num_kv_heads()),
        head_size=int(mc.get_head_size()),
        hidden_size=int(getattr(hf, "hidden_size", 0) or 0),
        vocab_size=int(getattr(hf, "vocab_size", 0) or 0),
        dtype=dtype_name(mc.dtype),
        max_model_len=int(mc.max_model_len),
        weights=os.environ.get(ENV_WEIGHTS) or str(cfg.load_config.load_format),
    )


def kv_cache_spec(impl: Any, kv_cache: Any, layer: str, cfg: Any) -> KVCacheSpec:
    """The KV-cache facts of ``layer``'s ``kv_cache`` as the backend ``impl`` reads it."""
    layout = kv_layout_of(impl, kv_cache)
    nb, h, bs, d2 = (int(x) for x in kv_cache.shape)
    backend_shape: tuple[int, ...] = ()
    stride_order = None
    backend_cls = _backend_class(impl)
    if backend_cls is not None:
        with contextlib.suppress(Exception):  # a backend without it: the manifest says ()
            backend_shape = tuple(backend_cls.get_kv_cache_shape(nb, bs, h, d2 // 2, impl.kv_cache_dtype))
        try:
            stride_order = tuple(backend_cls.get_kv_cache_stride_order())
        except Exception:  # noqa: BLE001 - CPU backend has none
            stride_order = None
    # Without vLLM's forward context, the one layer recorded so far stands for the model.
    layer_names = _attention_layers(cfg) or [layer]
    layer_obj = _layer_obj(cfg, layer)
    return KVCacheSpec(
        layer_names=tuple(layer_names),
        num_blocks=nb,
        block_size=bs,
        num_kv_heads=h,
        head_size=d2 // 2,
        dtype=dtype_name(kv_cache.dtype),
        cache_dtype=str(getattr(impl, "kv_cache_dtype", "auto")),
        element_size=int(kv_cache.element_size()),
        shape=(nb, h, bs, d2),
        stride=tuple(int(s) for s in kv_cache.stride()),
        layout=layout,
        physical_order=REGISTRY[layout].memory_order,
        k_scale=float(getattr(layer_obj, "_k_scale_float", 1.0)),
        v_scale=float(getattr(layer_obj, "_v_scale_float", 1.0)),
        backend_kv_cache_shape=backend_shape,
        backend_stride_order=stride_order,
    )


def _attention_layers(cfg: Any) -> list[str]:
    """Names of the model's attention layers (they share one KV-cache spec here)."""
    try:
        ctx = cfg.compilation_config.static_forward_context
    except Exception:  # noqa: BLE001
        return []
    names = [n for n, mod in ctx.items() if hasattr(mod, "impl") and hasattr(mod, "kv_cache")]
    return sorted(names, key=lambda n: (layer_index(n) if layer_index(n) is not None else 1 << 30, n))


def _layer_obj(cfg: Any, name: str) -> Any:
    try:
        return cfg.compilation_config.static_forward_context[name]
    except Exception:  # noqa: BLE001
        return None


def _backend_class(impl: Any) -> Any:
    name = type(impl).__name__
    if name == "FlashAttentionImpl":
        return import_attr("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend")
    if name == "CPUAttentionBackendImpl":
        return import_attr("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend")
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "cpu"
