"""What a step captures: each traced layer's metadata, and for tensor steps its tensors.

:class:`Capture` adds to the per-step state (``tracer.steps``) what the wrappers call as a step
runs and ends. A request step is recorded where the model runner ends it, so every step has a
record whatever the CUDA-graph mode: a full graph replays without calling Python ``forward``,
but the runner still builds that step's attention metadata. At the end of ``execute_model``
(:meth:`Capture._end_request_step`) the tracer reads it (the V1 runner passes it to
``set_forward_context``; the V2 runner keeps it in ``execute_model_state``, and
``dispatch_cg_and_sync_dp`` says which graph ran) and queues one non-blocking copy of its
tensors per KV-cache group into the step's ring slot (``tracer.host_copies``).

``forward`` / ``do_kv_cache_update`` add what only they see (:meth:`Capture._on_forward`): the
query's dtype, and for tensor steps device-side clones of query / output / key / value plus the
KV write log's gathers (``tracer.writelog``). Warm-up and profile passes are recorded from
``forward``. While the runner captures CUDA graphs no host copy is made: vLLM captures in
global mode, where any thread's sync aborts the capture.

Tensors of full-graph steps: while vLLM captures a full graph, ``forward`` and
``do_kv_cache_update`` of a traced layer add device-to-device copies of query / output / key /
value into buffers the tracer owns (``tracer.graph_copies``). The copies become part of the graph,
so every replay leaves its step's tensors there; the end of the runner's step (outside the
graph, on the same stream, before the next replay) clones the real rows like any other tensor
step. A graph captured before the tracer started has no such copies: its steps carry metadata
only, and the tracer says so once (:data:`FULL_GRAPH_TENSORS`).
"""

from __future__ import annotations

import types
from typing import Any

from tracer.backends import backend_name, not_captured_line
from tracer.engine_state import capturing, is_warmup_batch
from tracer.format import first_line, layer_index
from tracer.host_copies import layer_fields, queue_host_copies, step_fields, tensor_clones
from tracer.kv_groups import layer_groups
from tracer.layer_capture import LayerCapture, LayerStatic, capture_scales, dtype_name
from tracer.steps import NOT_NOW, Steps

__all__ = ["FULL_GRAPH_TENSORS", "Capture"]

#: The one line said when tensors are asked for but a full CUDA graph was captured without the tracer's copies.
FULL_GRAPH_TENSORS = (
    "pagedtrace: steps replayed as full CUDA graphs captured before the tracer started carry metadata only; "
    "start the tracer before the engine (or use cudagraph_mode PIECEWISE) for tensors of every step"
)


def _scheduled(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """A runner call's ``scheduler_output`` and its ``total_num_scheduled_tokens`` (0 where it has none)."""
    sched = args[0] if args else kwargs.get("scheduler_output")
    return sched, int(getattr(sched, "total_num_scheduled_tokens", 0) or 0)


class Capture(Steps):
    """The per-step state, plus what each step records: its layers' metadata, gaps and tensors."""

    def _on_forward(self, impl, layer, query, kv_cache, attn_metadata, output) -> None:
        name = getattr(layer, "layer_name", "") or f"layer{id(layer)}"
        if self._depth == 1 and self._phase[-1] == "request" and attn_metadata is not None:
            # A request step, recorded when the runner's step ends; forward adds the query's dtype
            # and the tensors. Every layer passes here each step: layers not traced return at once.
            self._model_ran = True
            if not self._wants(name):
                if not self._selected(name):
                    # Every later request step too: from now on the wrapper returns at once (each
                    # layer's forward runs once a step, so a per-step mark would never be read),
                    # and once a traced layer has run, vLLM calls the layer's own forward.
                    self.never_traced[name] = True
                    if impl is not None:
                        self._to_bypass.append(impl)
                return
            if self._layer_locked is None and self.options.layers == "first":
                self._layer_locked = name
            static = self._static.get(name)
            if static is None or static.kv_cache is not kv_cache:
                static = self._static_of(name, impl, layer, kv_cache)
                assert static is not None
            static.query_dtype = dtype_name(query.dtype)
            self._fwd_md[name] = attn_metadata
            if self.options.tensors and self._wants_tensors():
                self._capture_tensors(static, query, attn_metadata, output)
            return
        static = self._static_of(name, impl, layer, kv_cache)
        if static is not None:
            static.query_dtype = dtype_name(query)
        if name in self._seen_layers:
            # The same layer again without a runner step around it: a new forward pass
            # (the V2 runner's CUDA-graph warm-up and capture loop calls the model directly).
            self._end_pass()
            self._begin_step()
        self._seen_layers.add(name)
        self._model_ran = True
        if attn_metadata is None:
            # Profile runs build no attention metadata: vLLM skips attention itself.
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                kind = self._kind()
                why = "profile run" if kind == "profile" else "warm-up pass"
                self._record_gap(kind, f"attn_metadata is None: vLLM skips attention in this {why}", 0)
            self._seen_in_step = True
            return
        if self.stages(name):  # a full graph being captured: its replays copy query / output out
            self._graph_copies.stage(name, {"query": query, "output": output}, kv_cache, self.capture_capacity())
        if not self._wants(name):
            return
        if self.options.layers == "first" and self._layer_locked is None:
            self._layer_locked = name
        self._seen_in_step = True
        if self._in_capture or capturing():
            if self._gap_noted_step != self.step:
                self._gap_noted_step = self.step
                why = (
                    "cuda-graph-capture: no copies allowed while capturing"
                    if capturing()
                    else "cuda-graph-capture: a warm-up pass of capture_model (the tracer stays off the device "
                    "while graphs are captured)"
                )
                self._record_gap(self._kind(), why, int(attn_metadata.num_actual_tokens))
            return
        assert static is not None
        md = attn_metadata
        num_reqs = int(md.seq_lens.shape[0])
        self._capture(static, md, num_reqs, int(md.num_actual_tokens), self._req_ids(num_reqs), "none", None)

    def _capture_tensors(self, static: LayerStatic, query, md, output) -> None:
        """Device-side clones for a tensor step (queued on the stream: no host sync)."""
        kv_in = self._kv_inputs.pop(static.name, None) or {}
        n = int(md.num_actual_tokens)
        self._step_tensors[static.name] = tensor_clones(static, query, md, output, kv_in, n, int(md.seq_lens.shape[0]))

    def _capture(
        self,
        static: LayerStatic,
        md: Any,
        num_reqs: int,
        num_tokens: int,
        req_ids: tuple[str, ...],
        cudagraph: str,
        padded: int | None,
        *,
        kind: str | None = None,
        tensors: dict[str, Any] | None = None,
    ) -> None:
        """Queue one layer's record of this step into the slot (host copies, no sync)."""
        slot = self._slot or self._step_slot()
        payload = slot.payload
        hosts = payload["hosts"]
        shared = hosts.get(id(md))  # the layers of one KV-cache group share their metadata
        if shared is None:
            # A metadata trace copies the runner's tensors as given when small (the writer cuts the
            # step's rows; the records cut each row to the blocks it uses), into memory the record
            # process reads when it can. A tensor trace's table is as wide as its clone of the blocks read.
            host = queue_host_copies(
                slot,
                md,
                num_reqs,
                num_tokens,
                tensors["cols"] if tensors else None,
                as_given=not self.options.tensors,
                shared=self._record_writer.shared_host(),
                block_size=static.block_size,
                defer=self._defer,
            )
            shared = hosts[id(md)] = (host, step_fields(md, num_tokens, cudagraph, padded))
        host, metadata = shared
        if static.fields is None:
            # Once per layer: its constants, and the KV-cache group whose block table it reads.
            layer_fields(static)["kv_cache_group"] = layer_groups(self._runner).get(static.name)
        scales = None
        if static.scales is None or getattr(static.module, "calculate_kv_scales", False):
            scales = capture_scales(static.module)
        capture_kind = kind or (self._phase[-1] if self._phase else "request")
        if capture_kind == "request":
            asked = self._warmup_asked  # ``is_warmup_batch``, asked once for the same tuple (a decode step's)
            if asked is None or asked[0] is not req_ids:
                asked = self._warmup_asked = (req_ids, is_warmup_batch(req_ids))
            if asked[1]:
                capture_kind = "warmup"  # the V2 runner warms up through execute_model with fake requests
        reset = False
        if tensors is not None:
            reset = not self._log_valid.get(static.name, False)
            self._log_valid[static.name] = True
            self._logged_now.add(static.name)
            for value in tensors.values():
                if hasattr(value, "element_size"):
                    self._pool.hold(slot, value.numel() * value.element_size())
        slot.queued = True  # the step's event, recorded when the slot is handed over, comes after these
        payload["captures"].append(
            LayerCapture(self.step, capture_kind, static, metadata, host, req_ids, scales, tensors, reset)
        )

    def _req_ids(self, num_reqs: int) -> tuple[str, ...]:
        ids: Any = self._v2_req_ids
        if ids is None and (not self._phase or self._phase[-1] == "request"):  # ``_kind()``
            batch = getattr(self._runner, "input_batch", None)
            ids = getattr(batch, "req_ids", None)
        if ids is None:
            return ("",) * num_reqs
        given = tuple(ids)
        made = self._ids_made
        if made is not None and len(made[1]) == num_reqs and made[0] == given:
            return made[1]  # a decode step's batch is the last step's (the same strings: compared by identity)
        out = tuple(map(str, given[:num_reqs]))
        out += ("",) * (num_reqs - len(out))
        self._ids_made = (given, out)
        return out

    def _end_step(
        self, method: str, kind: str, runner: Any, args: tuple, kwargs: dict, raised: BaseException | None = None
    ) -> None:
        self.untraced_now = NOT_NOW  # the fast path holds inside request steps only
        if raised is not None:
            self._end_raised_step(method, kind, args, kwargs, raised)
            return
        try:
            if self._to_bypass and self._fwd_md:
                self._bypass_untraced()
            if method == "execute_model" and kind == "request":
                self._end_request_step(runner, args, kwargs)
                if not self._idle_decided:
                    self._decide_idle()
            elif not self._seen_in_step and kind == "profile" and self._in_range:
                self._record_gap(kind, "profile run: vLLM skips attention", 0)
            if self._log_valid or self._logged_now:  # a tensor trace's write logs (else nothing to end)
                self._end_pass()
            if self._slot is not None:
                self._submit_slot()
        except Exception as exc:  # noqa: BLE001
            self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            self._drop_slot()

    def _end_raised_step(self, method: str, kind: str, args: tuple, kwargs: dict, raised: BaseException) -> None:
        """vLLM's step raised (its error goes on to the caller): a gap says so, in place of the step's records.

        What the step captured before the error is dropped: its layers ran only in part. Some may
        have written the cache meanwhile, so every layer's write log starts again (its next tensor
        step stores the blocks it reads whole).
        """
        self._drop_slot()
        self._step_tensors = {}  # the layers' clones, freed now rather than at the next step
        for name in self._log_valid:
            self._log_valid[name] = False
        if kind not in ("request", "profile") or not self._in_range:
            return
        _, num_tokens = _scheduled(args, kwargs)
        message = first_line(raised, 200)
        reason = f"step-raised: vLLM's {method} raised {type(raised).__name__}" + (f": {message}" if message else "")
        try:
            self._record_gap(kind, reason, num_tokens)
            self._submit_slot()
        except Exception as exc:  # noqa: BLE001 - vLLM's error is the one the caller must see
            self._fail(f"pagedtrace: recording failed ({exc!r}); tracing stops, the engine runs on")
            self._drop_slot()

    def _end_request_step(self, runner: Any, args: tuple, kwargs: dict) -> None:
        sched, num_tokens = _scheduled(args, kwargs)
        if not self._in_range:
            self._model_ran = self._model_ran or num_tokens > 0
            return
        if num_tokens == 0:
            if sched is not None and hasattr(sched, "total_num_scheduled_tokens"):
                # Counted as a step, but the runner returned before the model ran: the
                # scheduler only passed finished request ids (after requests finish; the
                # V2 runner's warm-up cleanup). Without a gap its number would be unexplained.
                finished = tuple(sorted(str(r) for r in getattr(sched, "finished_req_ids", ()) or ()))
                self._record_gap(
                    "warmup" if is_warmup_batch(finished) else "request",
                    f"empty-step: no tokens scheduled; execute_model returned without running the model "
                    f"({len(finished)} finished request(s) freed)",
                    0,
                )
            return
        self._model_ran = True
        num_reqs = len(getattr(sched, "num_scheduled_tokens", None) or ())
        md_by_layer, cudagraph, padded = self._step_metadata(runner)
        if not md_by_layer:
            self._record_gap("request", "no-metadata: the runner kept no attention metadata for this step", num_tokens)
            return
        req_ids = self._req_ids(num_reqs)
        names = self._wanted_of(md_by_layer)
        full_tensors = False
        known = self._static
        for name in names:
            static = known.get(name) or self._static_of(name)
            if static is None:
                continue
            md = md_by_layer[name]
            tensors = self._step_tensors.pop(name, None) if self._step_tensors else None
            if (
                tensors is None
                and self.options.tensors
                and name not in self._fwd_md
                and cudagraph != "none"
                and self._wants_tensors()
            ):
                # forward() did not run for this layer: its attention replayed inside a graph (a full
                # one, or a breakable PIECEWISE one that captures attention too)
                staged = self._graph_copies.get(name, padded, static.kv_cache)
                if staged is None:
                    full_tensors = True
                else:  # the graph's copies of this replay: clone the real rows, as forward() does
                    kv_in = {"slot_mapping": md.slot_mapping[:num_tokens]}
                    kv_in.update({k: staged[k][:num_tokens].clone() for k in ("key", "value") if k in staged})
                    tensors = tensor_clones(static, staged["query"], md, staged["output"], kv_in, num_tokens, num_reqs)
            if tensors is None and self.options.tensors and self.tensors_absent is None and name not in self._fwd_md:
                self._tensors_absent_why(static)
            self._capture(static, md, num_reqs, num_tokens, req_ids, cudagraph, padded, tensors=tensors)
        if full_tensors:
            self._warn_once(FULL_GRAPH_TENSORS)
            self.tensors_absent = self.tensors_absent or FULL_GRAPH_TENSORS.removeprefix("pagedtrace: ")

    def _tensors_absent_why(self, static: LayerStatic) -> None:
        """A request step of a tensor trace came without tensors: say once why, when it is the backend's."""
        impl = type(static.impl)
        if backend_name(impl.__qualname__) is None and self._wants_tensors():
            line = not_captured_line(f"{impl.__module__}.{impl.__qualname__}")
            self._warn_once(line)
            self.tensors_absent = line.removeprefix("pagedtrace: ")

    def _wanted_of(self, md_by_layer: dict[str, Any]) -> list[str]:
        """The layers of a request step's metadata to record (the step is in range), in its order.

        The same every step for the same layers: kept, with the layer ``"first"`` locked on.
        """
        if self._record_writer.failed:
            return []
        key = (tuple(md_by_layer), self._layer_locked)
        if self._names_cache is not None and self._names_cache[0] == key:
            return self._names_cache[1]
        names = [n for n in key[0] if self._selected(n)]
        if self.options.layers == "first" and self._layer_locked is None and names:
            self._layer_locked = min(names, key=lambda n: (layer_index(n) is None, layer_index(n) or 0, n))
            names = [self._layer_locked]
            key = (key[0], self._layer_locked)
        self._names_cache = (key, names)
        return names

    def _step_metadata(self, runner: Any) -> tuple[dict[str, Any], str, int | None]:
        """This step's attention metadata per layer, how it ran, and its padded size."""
        md: Any = None
        cudagraph, padded = "none", None
        if self._fc is not None:
            md, cudagraph, padded = self._fc
        if md is None:  # the V2 runner replays full graphs without set_forward_context
            state = getattr(runner, "execute_model_state", None)
            md = getattr(state, "attn_metadata", None)
            if self._dispatch is not None:
                cudagraph, padded = self._dispatch
        if isinstance(md, list):  # micro-batched (DBO): not recorded from the runner
            md = None
        if not md:
            md = self._fwd_md
        # read only: the runner's own dict for this step (a new one each step), or forward's
        return md if type(md) is dict else dict(md), cudagraph, padded

    def _bypass_untraced(self) -> None:
        """Give the layers no step traces vLLM's own ``forward`` back, on their impl objects.

        Called at the end of a request step in which a traced layer's ``forward`` ran: that layer
        keeps the wrapper, which is all that later passes need (their steps, warm-up passes and
        gaps are seen through it). Each wrapper call of an untraced layer cost the engine's thread
        about a microsecond a step; with the impl's own attribute, vLLM's
        ``self.impl.forward(...)`` finds the original first. ``stop`` removes the attributes.
        """
        impls, self._to_bypass = self._to_bypass, []
        for impl in impls:
            wrapper = getattr(type(impl), "forward", None)
            original = getattr(wrapper, "__pagedtrace_original__", None)
            own = getattr(impl, "__dict__", None)  # None: no instance attributes (__slots__), the wrapper stays
            if original is None or own is None or "forward" in own:
                continue
            try:
                impl.forward = types.MethodType(original, impl)
            except (AttributeError, TypeError):  # a read-only attribute: the wrapper stays
                continue
            self._bypassed.append(impl)
