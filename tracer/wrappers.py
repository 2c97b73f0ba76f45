"""The wrappers the tracer installs around vLLM's functions, one factory per kind.

Each factory takes the tracer (a :class:`tracer.capture.Capture`, as ``tracer.install.Tracer``
is) and the original function and returns the wrapper ``Tracer._install`` sets in its place;
the wrappers only keep references and call back into the tracer, which decides what to record.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

from tracer.engine_state import capturing

if TYPE_CHECKING:
    from tracer.capture import Capture as Tracer

__all__ = ["dispatch", "flashinfer_build", "forward", "forward_context", "kv_update", "runner"]


def graph_mode(mode: object) -> str:
    """vLLM's ``CUDAGraphMode`` (or None) as ``StepRecord.cudagraph``."""
    try:
        return _GRAPH_MODES[mode]
    except (KeyError, TypeError):  # not seen yet, or not hashable
        pass
    name = str(getattr(mode, "name", mode or "NONE")).lower()
    name = name if name in ("none", "piecewise", "full") else "none"
    with contextlib.suppress(TypeError):
        if len(_GRAPH_MODES) < 64:
            _GRAPH_MODES[mode] = name
    return name


#: :func:`graph_mode`'s answers so far, by the mode vLLM gave (its enum members: a few)
_GRAPH_MODES: dict[object, str] = {}


def runner(tracer: Tracer, method: str):
    """A wrapper factory for one model-runner method: numbers steps, tells their kinds apart."""
    phase: str | None = {
        "execute_model": "request",
        "profile_run": "profile",
        "capture_model": "warmup",
        "_dummy_run": "warmup",
        "prepare_inputs": None,
    }[method]
    counts_step = method in ("execute_model", "_dummy_run")
    dummy = method == "_dummy_run"
    capture = method == "capture_model"

    def make(original):
        if method == "prepare_inputs":
            # V2 runner: rows are sorted here, so take the request ids from its batch.
            @functools.wraps(original)
            def prepare_inputs(runner, *args, **kwargs):
                batch = original(runner, *args, **kwargs)
                ids = getattr(batch, "req_ids", None)
                if ids is not None:
                    tracer._v2_req_ids = tuple(ids)
                return batch

            return prepare_inputs

        @functools.wraps(original)
        def wrapper(runner, *args, **kwargs):
            if tracer._runner is not runner:  # the first call (one runner a process: not again)
                if tracer._runner is None and tracer._handover is not None:
                    # This process runs the model (vLLM's front end and engine core never get here):
                    # start the record writer process now, at the profile run, before any request step.
                    tracer._record_writer.start()
                tracer._runner = runner
                tracer._vllm_config = getattr(runner, "vllm_config", tracer._vllm_config)
                tracer._record_writer.vllm_config = tracer._vllm_config
                tracer._record_writer.runner = runner
            stack = tracer._phase
            depth = tracer._depth
            if stack:
                # Nested calls belong to the outer step: the V2 runner's _dummy_run calls
                # execute_model, profile_run and capture_model call _dummy_run, and the V1
                # runner pads data-parallel steps with a _dummy_run inside execute_model.
                effective = stack[-1] if depth > 0 or dummy else phase
            else:
                effective = phase
            assert effective is not None  # prepare_inputs has its own wrapper above
            new_step = counts_step and depth == 0
            if new_step:
                tracer._begin_step()
            if capture:
                # The writer thread must stay off the device while graphs are captured (vLLM
                # captures in global mode: any thread's sync or copy aborts the capture). Let it
                # finish what it holds; passes inside capture_model make no copies.
                tracer.drain()
                tracer._in_capture += 1
            stack.append(effective)
            tracer._depth = depth + counts_step
            if new_step and effective == "request":
                tracer.untraced_now = tracer.never_traced  # forward's fast path, for this step
            raised: BaseException | None = None
            try:
                return original(runner, *args, **kwargs)
            except BaseException as exc:
                raised = exc  # vLLM's own error: it propagates, the step is not recorded
                raise
            finally:
                if capture:
                    tracer._in_capture -= 1
                tracer._depth -= counts_step
                stack.pop()
                if new_step:
                    tracer._end_step(method, effective, runner, args, kwargs, raised)

        return wrapper

    return make


def forward_context(tracer: Tracer, original):
    """``set_forward_context``: keep a request step's metadata, graph mode and padded size."""

    request = ["request"]

    @functools.wraps(original)
    def set_forward_context(attn_metadata, *args, **kwargs):
        if tracer._depth == 1 and tracer._phase == request:
            get = kwargs.get
            padded = getattr(get("batch_descriptor"), "num_tokens", None) or get("num_tokens")
            tracer._fc = (attn_metadata, graph_mode(get("cudagraph_runtime_mode")), padded)
        return original(attn_metadata, *args, **kwargs)

    return set_forward_context


def dispatch(tracer: Tracer, original):
    """The V2 runner's ``dispatch_cg_and_sync_dp``: which graph a step replays, at what size."""

    @functools.wraps(original)
    def dispatch_cg_and_sync_dp(*args, **kwargs):
        result = original(*args, **kwargs)
        with contextlib.suppress(Exception):  # an unexpected shape: the step just lacks the graph
            desc = result[0]
            tracer._dispatch = (graph_mode(desc.cg_mode), int(desc.num_tokens))
        return result

    return dispatch_cg_and_sync_dp


def kv_update(tracer: Tracer, original):
    """``do_kv_cache_update``: for a tensor step, keep what a wanted layer wrote, and where.

    ``forward`` runs right after, on the same stream, and gathers the written entries through
    this ``slot_mapping`` at once: a reference is enough. ``key``/``value`` are cloned: the
    writer thread copies them later.
    """

    @functools.wraps(original)
    def do_kv_cache_update(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        result = original(impl, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)
        name = getattr(layer, "layer_name", "")
        if tracer.stages(name):  # a full graph being captured: its replays copy key / value out
            tracer._graph_copies.stage(name, {"key": key, "value": value}, kv_cache, tracer.capture_capacity())
        elif tracer._wants_tensors() and tracer._wants(name) and not capturing():
            n = slot_mapping.shape[0]
            tracer._kv_inputs[name] = {
                "slot_mapping": slot_mapping,
                "key": key[:n].detach().clone(),
                "value": value[:n].detach().clone(),
            }
        return result

    return do_kv_cache_update


def forward(tracer: Tracer, original):
    """``forward``: after attention ran, let the tracer look at its inputs and output."""

    @functools.wraps(original)
    def forward(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = original(impl, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if tracer.untraced_now.get(getattr(layer, "layer_name", "")):  # a request step's untraced layer
            return result
        try:
            tracer._on_forward(impl, layer, query, kv_cache, attn_metadata, output)
        except Exception as exc:  # noqa: BLE001 - the engine must run on
            tracer._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
        return result

    return forward


def flashinfer_build(tracer: Tracer, original):
    """``FlashInferMetadataBuilder.build``: the metadata keeps the block table FlashInfer's was made from.

    ``FlashInferMetadata`` holds ``paged_kv_indptr / indices / last_page_len`` (in its wrappers'
    plans) but no block table: the tracer sets the runner's ``block_table``, ``seq_lens``,
    ``query_start_loc``, ``max_query_len`` and ``max_seq_len`` on it under vLLM's names (the
    fields every other backend's metadata has), and ``paged_kv`` (:func:`flashinfer_paged_kv`)
    where this build computed FlashInfer's own. A few attribute sets a build; no device work
    but, for a tensor trace, one clone of the step's page indices.
    """

    @functools.wraps(original)
    def build(builder, common_prefix_len, common_attn_metadata, *args, **kwargs):
        md = original(builder, common_prefix_len, common_attn_metadata, *args, **kwargs)
        try:
            cm = common_attn_metadata
            md.block_table = cm.block_table_tensor
            md.seq_lens = cm.seq_lens
            md.query_start_loc = cm.query_start_loc
            md.max_query_len = int(cm.max_query_len)
            md.max_seq_len = int(cm.max_seq_len)
            md.paged_kv = flashinfer_paged_kv(builder, md, int(cm.num_reqs), tracer.options.tensors and not capturing())
        except Exception as exc:  # noqa: BLE001 - an unexpected vLLM object: the step lacks the fields
            tracer._warn_once(f"pagedtrace: FlashInfer metadata not read ({exc!r}); its steps may lack records")
        return md

    return build


def flashinfer_paged_kv(builder, md, num_reqs: int, clone_indices: bool) -> dict | None:
    """FlashInfer's page table of this build, when it made one (its native paths and cascade; the
    TRT-LLM paths read the block table itself): ``paged_kv_indptr`` and ``paged_kv_last_page_len``
    as ints, read from the builder's host buffers; ``paged_kv_indices`` (a device clone, only with
    ``clone_indices``) cut at ``indptr[-1]``. None when this build computed none.
    """
    native = (md.prefill is not None and type(md.prefill).__name__ == "FIPrefill") or (
        md.decode is not None and type(md.decode).__name__ == "FIDecode"
    )
    if not (native or md.use_cascade) or num_reqs <= 0:
        return None
    indptr = tuple(int(x) for x in builder.paged_kv_indptr_cpu_buffer[: num_reqs + 1].tolist())
    out: dict = {
        "paged_kv_indptr": indptr,
        "paged_kv_last_page_len": tuple(int(x) for x in builder.paged_kv_last_page_len.np[:num_reqs].tolist()),
    }
    if clone_indices:
        out["paged_kv_indices"] = builder.paged_kv_indices.gpu[: indptr[-1]].clone()
    return out


def engine_idle(tracer: Tracer, original):
    """``EngineCoreProc._notify_idle_state_callbacks``: the busy loop is about to wait for requests."""

    @functools.wraps(original)
    def _notify_idle_state_callbacks(engine, *args, **kwargs):
        tracer.engine_idle()
        return original(engine, *args, **kwargs)

    return _notify_idle_state_callbacks


def run_engine(tracer: Tracer, original):
    """``LLM._run_engine`` (the engine in the caller's process): its steps run here; idle once it returns."""

    @functools.wraps(original)
    def _run_engine(llm, *args, **kwargs):
        tracer.engine_loop_here()
        try:
            return original(llm, *args, **kwargs)
        finally:
            tracer.engine_idle()

    return _run_engine
