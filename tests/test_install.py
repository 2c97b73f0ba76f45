"""Install / uninstall of the tracer: symmetric, refuses to nest, leaves nothing patched."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest

from tracer import capture, install, steps, wrappers
from tracer.format import parse_layers, parse_steps
from tracer.install import Tracer, TracerOptions

cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")
runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")

TARGETS = [
    (cpu_attn.CPUAttentionBackendImpl, "forward"),
    (cpu_attn.CPUAttentionBackendImpl, "do_kv_cache_update"),
    (runner.GPUModelRunner, "execute_model"),
    (runner.GPUModelRunner, "_dummy_run"),
    (runner.GPUModelRunner, "profile_run"),
]


@pytest.fixture(autouse=True)
def nothing_left_patched():
    before = {(c, n): vars(c)[n] for c, n in TARGETS}
    yield
    assert install.active() is None
    assert {(c, n): vars(c)[n] for c, n in TARGETS} == before


def test_a_metadata_tracer_leaves_the_cache_write_alone(tmp_path):
    with Tracer(TracerOptions(str(tmp_path / "t"))):
        assert hasattr(vars(cpu_attn.CPUAttentionBackendImpl)["forward"], "__pagedtrace_original__")
        assert not hasattr(vars(cpu_attn.CPUAttentionBackendImpl)["do_kv_cache_update"], "__pagedtrace_original__")


def test_a_layer_no_step_traces_is_passed_by_at_once_from_its_first_request_step(tmp_path):
    import types

    t = Tracer(TracerOptions(str(tmp_path / "t"), layers=(0,)))
    layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(3)]
    forward = wrappers.forward(t, lambda impl, layer, q, k, v, kv, md, out: out)
    asked = []  # the layers that reach the tracer's slow path
    on_forward = t._on_forward

    def slow_path(impl, layer, *rest):
        asked.append(layer.layer_name)
        if layer is not layers[0]:  # the traced layer would need a real impl and cache: stop there
            on_forward(impl, layer, *rest)

    t._on_forward = slow_path

    def model(runner, *args, **kwargs):
        return [forward(None, layer, None, None, None, None, object(), "out") for layer in layers]

    step = wrappers.runner(t, "execute_model")(model)
    runner = types.SimpleNamespace(vllm_config=None)
    assert step(runner) == ["out"] * 3
    assert asked == [layer.layer_name for layer in layers]
    assert t.never_traced == {layers[1].layer_name: True, layers[2].layer_name: True}
    asked.clear()
    step(runner)
    step(runner)
    assert asked == [layers[0].layer_name] * 2  # layers 1 and 2 never reach the tracer again
    assert t.untraced_now == {}  # outside a request step every call is looked at (warm-up, capture)
    forward(None, layers[1], None, None, None, None, object(), "out")
    assert asked[-1] == layers[1].layer_name


def test_start_patches_and_stop_restores(tmp_path):
    t = Tracer(TracerOptions(str(tmp_path / "t"), tensors=True)).start()
    try:
        for cls, name in TARGETS:
            assert hasattr(vars(cls)[name], "__pagedtrace_original__"), name
    finally:
        t.stop()
    t.stop()  # twice is harmless


def test_second_start_refuses(tmp_path):
    with Tracer(TracerOptions(str(tmp_path / "a"))), pytest.raises(RuntimeError, match="already active"):
        Tracer(TracerOptions(str(tmp_path / "b"))).start()


def test_failed_start_leaves_nothing_patched(tmp_path, monkeypatch):
    def broken(self):
        self._patch(cpu_attn.CPUAttentionBackendImpl, "forward", functools.partial(wrappers.forward, self))
        raise OSError("boom")

    monkeypatch.setattr(Tracer, "_install", broken)
    with pytest.raises(OSError, match="boom"):
        Tracer(TracerOptions(str(tmp_path / "t"))).start()


def test_env_is_exported_for_child_processes_and_restored(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDTRACE_DIR", raising=False)
    import os

    import tracer

    t = tracer.start(tmp_path / "t", layers="all", steps=(2, 9), tensors=True)
    try:
        opts = TracerOptions.from_env()
        assert opts == TracerOptions(
            str(tmp_path / "t"), layers="all", steps=(2, 9), tensors=True, budget_bytes=t.options.budget_bytes
        )
    finally:
        tracer.stop()
    assert "PAGEDTRACE_DIR" not in os.environ


def test_option_parsing():
    assert parse_layers("first") == "first" and parse_layers("0, 3,model.x") == (0, 3, "model.x")
    assert parse_steps("") == (None, None) and parse_steps("3:") == (3, None) and parse_steps("5") == (5, 6)
    with pytest.raises(ValueError, match="bad step range"):
        parse_steps("a:b")
    with pytest.raises(ValueError, match="bad layer selection"):
        parse_layers(",")


def test_the_tracer_modules_import_neither_torch_nor_vllm():
    # vLLM is imported inside the hook installer and the manifest builder, torch at flush time.
    code = (
        "import sys, tracer, tracer.install, tracer.manifest, tracer.options, tracer.layer_capture, tracer.plugin, "
        "tracer.session\n"
        "bad = sorted(m for m in ('torch', 'vllm') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


def test_kv_layout_of_names_a_stored_registry_layout():
    import torch

    from tracer.format import STORED_LAYOUTS
    from tracer.manifest import kv_layout_of

    class CPUAttentionBackendImpl:  # named as vLLM's: the layout follows the kernel's ISA
        def __init__(self, isa):
            self.isa = isa

    hnd = torch.empty(4, 2, 16, 8)  # (blocks, heads, tokens, 2D) allocated in that order
    nhd = torch.empty(4, 16, 2, 8).transpose(1, 2)
    names = [
        kv_layout_of(object(), nhd),
        kv_layout_of(object(), hnd),
        kv_layout_of(CPUAttentionBackendImpl("vec"), hnd),
        kv_layout_of(CPUAttentionBackendImpl("amx"), hnd),
    ]
    assert names == ["flash_nhd", "flash_hnd", "cpu", "cpu_amx"]
    assert set(names) <= set(STORED_LAYOUTS)
    assert install.TracerOptions is TracerOptions  # still importable where the rooms import it


def _fake_step_engine(tmp_path, *, tensors=False, layers=(0,), **tracer_kwargs):
    """A tracer with its writer thread, and a V2-like runner whose one step replayed a padded full graph.

    Three requests padded to four rows (the padded row has seq_len 0 and slot -1), as vLLM's V2
    runner leaves them in ``execute_model_state.attn_metadata`` when it replays a full CUDA graph
    without calling ``set_forward_context`` or ``forward``.
    """
    import types

    import torch

    t = Tracer(TracerOptions(str(tmp_path / "trace"), layers=layers, tensors=tensors), **tracer_kwargs)
    t._handover = t._writer_thread()
    impl = types.SimpleNamespace(
        alibi_slopes=None, sinks=None, scale=0.125, num_heads=4, num_kv_heads=2, head_size=8, logits_soft_cap=0
    )
    name = "model.layers.0.self_attn.attn"
    module = types.SimpleNamespace(impl=impl, kv_cache=[torch.zeros(10, 2, 4, 16, dtype=torch.bfloat16)])
    cfg = types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(static_forward_context={name: module}), model_config=None
    )
    md = types.SimpleNamespace(
        num_actual_tokens=4,
        seq_lens=torch.tensor([5, 9, 3, 0], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32),
        block_table=torch.tensor([[1, 2, 0, 0], [3, 4, 5, 0], [6, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 20, 26, -1]),
        max_query_len=1,
        max_seq_len=9,
    )
    runner = types.SimpleNamespace(vllm_config=cfg, execute_model_state=types.SimpleNamespace(attn_metadata={name: md}))
    t._vllm_config = t._record_writer.vllm_config = cfg
    t._runner = runner
    sched = types.SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"a": 1, "b": 1, "c": 1})
    return t, runner, sched, md


@pytest.mark.parametrize("path", ["v2-full-graph", "v1-forward-context"])
def test_a_step_no_forward_saw_is_recorded_from_the_runner(tmp_path, path):
    from tracer.format import Trace

    t, runner, sched, md = _fake_step_engine(tmp_path)
    t._phase, t._depth = ["request"], 1
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    if path == "v2-full-graph":
        t._dispatch = ("full", 4)  # what dispatch_cg_and_sync_dp chose
    else:
        runner.execute_model_state = None
        t._fc = ({"model.layers.0.self_attn.attn": md}, "piecewise", 4)  # what set_forward_context was given
    t._end_request_step(runner, (sched,), {})
    t._submit_slot()
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    (rec,) = Trace.open(tmp_path / "trace").records
    assert rec.cudagraph == ("full" if path == "v2-full-graph" else "piecewise") and rec.padded_tokens == 4
    assert (rec.num_actual_tokens, rec.request_ids, rec.seq_lens) == (3, ("a", "b", "c"), (5, 9, 3))
    assert rec.block_table == ((1, 2), (3, 4, 5), (6,)) and rec.slot_mapping == (8, 20, 26)  # padding dropped


def test_a_full_graph_step_keeps_the_tensors_its_captured_copies_left(tmp_path, monkeypatch):
    """Capture: forward / do_kv_cache_update of the traced layer add copies into staging buffers;
    each replay rewrites them (done here by hand: no CUDA graph on CPU); the runner's step then
    records that replay's real rows, and the write log gathers what the step wrote to the cache."""
    import types

    import torch

    from tracer.format import Trace
    from tracer.graph_copies import GraphCopies

    t, runner, sched, md = _fake_step_engine(tmp_path, tensors=True)
    t._graph_copies = GraphCopies()  # not the process's: this "graph" ends with the test
    name = "model.layers.0.self_attn.attn"
    module = t._vllm_config.compilation_config.static_forward_context[name]
    kv_cache = module.kv_cache[0]
    layer = types.SimpleNamespace(layer_name=name, impl=module.impl)
    kv_update = wrappers.kv_update(t, lambda impl, layer, key, value, kv_cache, slot_mapping: None)
    forward = wrappers.forward(t, lambda impl, layer, q, k, v, kv_cache, md, out: out)
    bf16 = torch.bfloat16

    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(*s, generator=g).to(bf16) for s in ((4, 4, 8), (4, 2, 8), (4, 2, 8), (4, 32))]

    _patch_tracer(monkeypatch, "capturing", lambda: True)
    monkeypatch.setattr(wrappers, "capturing", lambda: True)
    t._phase, t._depth, t._in_capture = ["warmup"], 1, 1
    t._begin_step()
    q, k, v, out = tensors(0)
    kv_update(module.impl, layer, k, v, kv_cache, md.slot_mapping)
    forward(module.impl, layer, q, k, v, kv_cache, md, out)
    staged = t._graph_copies.get(name, 4, kv_cache)
    assert staged is not None and set(staged) == {"cache", "query", "output", "key", "value"}
    assert torch.equal(staged["query"], q) and torch.equal(staged["key"], k)
    assert t._graph_copies.get(name, 8, kv_cache) is None  # no graph of 8 tokens was captured
    assert t._graph_copies.get(name, 4, kv_cache.clone()) is None  # another engine's cache: not its graphs
    t._submit_slot()
    _patch_tracer(monkeypatch, "capturing", lambda: False)
    monkeypatch.setattr(wrappers, "capturing", lambda: False)
    t._phase, t._depth, t._in_capture = ["request"], 1, 0

    q, k, v, out = tensors(1)  # the replay: the graph's copies rewrite the buffers, its kernels the cache
    for key, value in zip(("query", "key", "value", "output"), (q, k, v, out), strict=True):
        staged[key].copy_(value)
    for row, slot in enumerate((8, 20, 26)):  # logical (blocks, heads, block_size, K|V)
        kv_cache[slot // 4, :, slot % 4, :8], kv_cache[slot // 4, :, slot % 4, 8:] = k[row], v[row]
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    t._dispatch = ("full", 4)
    t._end_request_step(runner, (sched,), {})
    t._submit_slot()
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None and not t._warned
    trace = Trace.open(tmp_path / "trace")
    rec = next(r for r in trace.records if r.kind == "request")
    assert rec.cudagraph == "full" and rec.num_actual_tokens == 3
    got = trace.tensors(rec)
    assert torch.equal(got["query"], q[:3]) and torch.equal(got["output"].reshape(3, 32), out[:3])
    assert torch.equal(got["key"], k[:3]) and torch.equal(got["value"], v[:3])
    assert torch.equal(got["kv_written"][:, 0], k[:3]) and torch.equal(got["kv_written"][:, 1], v[:3])


def test_a_full_graph_captured_before_the_tracer_started_says_its_steps_carry_metadata_only(tmp_path):
    t, runner, sched, _md = _fake_step_engine(tmp_path, tensors=True)
    t._phase, t._depth = ["request"], 1
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    t._dispatch = ("full", 4)
    with pytest.warns(RuntimeWarning, match="captured before the tracer started carry metadata only"):
        t._end_request_step(runner, (sched,), {})
    t._submit_slot()
    t._handover.close()
    t._record_writer.finish()
    from tracer.format import Trace

    (rec,) = Trace.open(tmp_path / "trace").records
    assert rec.cudagraph == "full" and not rec.tensors


def test_a_drained_step_is_on_disk_before_the_trace_closes(tmp_path):
    """Each record is flushed as written: a reader of the live trace (or a killed engine's) has it."""
    t, runner, sched, _md = _fake_step_engine(tmp_path)
    t._phase, t._depth = ["request"], 1
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    t._dispatch = ("full", 4)
    t._end_request_step(runner, (sched,), {})
    t.drain()
    lines = (tmp_path / "trace" / "steps.jsonl").read_text().splitlines()
    assert len(lines) == 1 and '"cudagraph":"full"' in lines[0]
    t._handover.close()
    t._record_writer.finish()


def _patch_tracer(monkeypatch, name: str, value) -> None:
    """Set ``name`` to ``value`` in every module of the tracer's step path that uses it."""
    for module in (install, steps, capture):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, value)


def _spy_device_work(monkeypatch) -> list[str]:
    """What the hooks queue on the device, in order: ``clone`` (tensors), ``copy`` (metadata), ``event``."""
    calls: list[str] = []
    for name, what in (("tensor_clones", "clone"), ("queue_host_copies", "copy"), ("record_event", "event")):
        real = getattr(capture, name, None) or getattr(steps, name)

        def spy(*args, _real=real, _what=what, **kwargs):
            calls.append(_what)
            return _real(*args, **kwargs)

        _patch_tracer(monkeypatch, name, spy)
    return calls


def test_a_request_step_records_one_event_after_the_clones_of_forward_and_the_copies_of_its_end(tmp_path, monkeypatch):
    import types

    import torch

    from tracer.format import Trace

    t, runner, sched, md = _fake_step_engine(tmp_path, tensors=True)
    md.num_actual_tokens = 3  # an eager step: no padded row
    name = "model.layers.0.self_attn.attn"
    module = t._vllm_config.compilation_config.static_forward_context[name]
    layer = types.SimpleNamespace(layer_name=name, impl=module.impl)
    kv_update = wrappers.kv_update(t, lambda impl, layer, key, value, kv_cache, slot_mapping: None)
    forward = wrappers.forward(t, lambda impl, layer, q, k, v, kv_cache, md, out: out)
    calls = _spy_device_work(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v, out = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((4, 4, 8), (4, 2, 8), (4, 2, 8), (4, 32)))
    t._phase, t._depth = ["request"], 1
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    kv_update(module.impl, layer, k, v, module.kv_cache[0], md.slot_mapping)
    forward(module.impl, layer, q, k, v, module.kv_cache[0], md, out)
    assert calls == ["clone"]  # forward's clones: no event yet
    t._end_request_step(runner, (sched,), {})
    assert calls == ["clone", "copy"]  # the step's end: still none
    t._submit_slot()
    assert calls == ["clone", "copy", "event"]  # one, after both, where the writer gets the slot
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    (rec,) = Trace.open(tmp_path / "trace").records
    assert rec.cudagraph == "none" and rec.slot_mapping == (8, 20, 26)
    assert torch.equal(Trace.open(tmp_path / "trace").tensors(rec)["query"], q[:3])


def test_a_pass_records_one_event_for_all_its_layers_and_a_pass_of_gaps_none(tmp_path, monkeypatch):
    import copy
    import types

    import torch

    from tracer.format import Trace

    t, runner, _sched, md = _fake_step_engine(tmp_path, layers="all")
    module = t._vllm_config.compilation_config.static_forward_context["model.layers.0.self_attn.attn"]
    layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(2)]
    real = {"seq_lens": md.seq_lens[:3], "query_start_loc": md.query_start_loc[:4], "block_table": md.block_table[:3]}
    eager = types.SimpleNamespace(**{**vars(md), **real, "slot_mapping": md.slot_mapping[:3], "num_actual_tokens": 3})
    metadata = [eager, copy.copy(eager)]  # two KV-cache groups: each its own metadata, its own copy
    forward = wrappers.forward(t, lambda impl, layer, q, k, v, kv_cache, md, out: out)
    query = torch.zeros(3, 4, 8, dtype=torch.bfloat16)

    def model(runner):  # a warm-up pass (``_dummy_run``): forward records each layer
        for layer, layer_md in zip(layers, metadata, strict=True):
            forward(module.impl, layer, query, None, None, module.kv_cache[0], layer_md, None)

    calls = _spy_device_work(monkeypatch)
    dummy_run = wrappers.runner(t, "_dummy_run")(model)
    dummy_run(runner)
    assert calls == ["copy", "copy", "event"]
    metadata = [None, None]  # a pass without attention metadata (vLLM skips attention): one gap
    dummy_run(runner)
    assert calls == ["copy", "copy", "event"]  # gaps alone: no event
    t._handover.close()
    t._record_writer.finish()
    assert t.error is None
    trace = Trace.open(tmp_path / "trace")
    assert [(r.step, r.layer) for r in trace.records] == [(0, layers[0].layer_name), (0, layers[1].layer_name)]
    assert [g.step for g in trace.gaps] == [1]


def test_a_step_whose_forward_ran_never_takes_a_graphs_staged_tensors(tmp_path):
    """The staging buffers hold the last replay of a graph: a step whose attention ran in Python
    (forward saw it) must not be given them, whatever its graph label says."""
    import torch

    from tracer.format import Trace
    from tracer.graph_copies import GraphCopies

    t, runner, sched, md = _fake_step_engine(tmp_path, tensors=True)
    name = "model.layers.0.self_attn.attn"
    kv_cache = t._vllm_config.compilation_config.static_forward_context[name].kv_cache[0]
    t._graph_copies = GraphCopies()
    t._graph_copies.stage(name, {"query": torch.zeros(4, 4, 8), "output": torch.zeros(4, 32)}, kv_cache, 4)
    t._phase, t._depth = ["request"], 1
    t._begin_step()
    t._v2_req_ids = ("a", "b", "c")
    t._dispatch = ("piecewise", 4)
    t._fwd_md[name] = md  # forward ran for the layer (and, say, its tensors were not wanted then)
    t._end_request_step(runner, (sched,), {})
    t._submit_slot()
    t._handover.close()
    t._record_writer.finish()
    (rec,) = Trace.open(tmp_path / "trace").records
    assert rec.cudagraph == "piecewise" and not rec.tensors and not t._warned


def test_an_untraced_layer_gets_vllms_own_forward_back_once_a_traced_layer_ran(tmp_path):
    """vLLM calls ``self.impl.forward(...)``: an untraced layer's impl is given the original as its
    own attribute (no wrapper call a step), the traced layer keeps the wrapper; ``stop`` undoes it."""
    import types

    t = Tracer(TracerOptions(str(tmp_path / "t"), layers=(0,)))
    calls = []

    def original(impl, layer, q, k, v, kv, md, out):
        calls.append(layer.layer_name)
        return out

    class Impl:
        forward = wrappers.forward(t, original)

    Impl.forward.__pagedtrace_original__ = original
    layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(3)]
    impls = [Impl() for _ in layers]
    reached = []  # layers whose call reached the tracer
    on_forward = t._on_forward

    def slow_path(impl, layer, *rest):
        reached.append(layer.layer_name)
        if layer is not layers[0]:  # the traced layer would need a real cache: pretend it was recorded
            on_forward(impl, layer, *rest)
        else:
            t._fwd_md[layer.layer_name] = rest[2]

    t._on_forward = slow_path

    def model(runner, *args, **kwargs):
        pairs = zip(impls, layers, strict=True)
        return [impl.forward(layer, None, None, None, None, object(), "out") for impl, layer in pairs]

    step = wrappers.runner(t, "execute_model")(model)
    runner = types.SimpleNamespace(vllm_config=None)
    assert step(runner) == ["out"] * 3
    assert [("forward" in vars(impl)) for impl in impls] == [False, True, True]
    reached.clear()
    calls.clear()
    assert step(runner) == ["out"] * 3
    assert calls == [layer.layer_name for layer in layers]  # every layer's attention still runs
    assert reached == [layers[0].layer_name]
    t._restore_bypassed()
    assert not any("forward" in vars(impl) for impl in impls)


def test_untraced_layers_keep_the_wrapper_while_no_traced_layer_ran(tmp_path):
    """A step in which no traced layer ran (the traced layer is elsewhere): nothing is bypassed, so
    that the passes are still seen."""
    import types

    t = Tracer(TracerOptions(str(tmp_path / "t"), layers=(5,)))

    class Impl:
        forward = wrappers.forward(t, lambda impl, layer, q, k, v, kv, md, out: out)

    Impl.forward.__pagedtrace_original__ = lambda impl, layer, q, k, v, kv, md, out: out
    layers = [types.SimpleNamespace(layer_name=f"model.layers.{i}.self_attn.attn") for i in range(2)]
    impls = [Impl() for _ in layers]

    def model(runner, *args, **kwargs):
        pairs = zip(impls, layers, strict=True)
        return [impl.forward(layer, None, None, None, None, object(), "out") for impl, layer in pairs]

    step = wrappers.runner(t, "execute_model")(model)
    runner = types.SimpleNamespace(vllm_config=None)
    step(runner)
    step(runner)
    assert t.never_traced and not any("forward" in vars(impl) for impl in impls)


def test_an_impl_without_instance_attributes_keeps_the_wrapper(tmp_path):
    """``__slots__``: the untraced layer's calls keep passing through the wrapper's fast path."""
    import types

    t = Tracer(TracerOptions(str(tmp_path / "t"), layers=(0,)))

    def original(impl, layer, q, k, v, kv, md, out):
        return out

    class Impl:
        __slots__ = ()
        forward = wrappers.forward(t, original)

    Impl.forward.__pagedtrace_original__ = original
    t._to_bypass = [Impl()]
    t._fwd_md = {"model.layers.0.self_attn.attn": object()}
    t._bypass_untraced()
    assert t._bypassed == [] and t._to_bypass == []
    assert Impl().forward(types.SimpleNamespace(layer_name="x"), None, None, None, None, None, "out") == "out"


def test_a_steps_request_ids_are_made_once_for_the_same_batch_and_anew_when_it_changes(tmp_path):
    import types

    t = Tracer(TracerOptions(str(tmp_path / "t")))
    t._v2_req_ids = ("a", "b", "c")
    first = t._req_ids(3)
    assert first == ("a", "b", "c")
    t._v2_req_ids = ("a", "b", "c")  # the next decode step: a new tuple of the same strings
    assert t._req_ids(3) is first
    assert t._req_ids(4) == ("a", "b", "c", "")
    t._v2_req_ids = ("a", "d", "c")
    assert t._req_ids(3) == ("a", "d", "c")
    # the V1 runner's list, changed in place between steps
    t._v2_req_ids, t._phase = None, ["request"]
    ids = ["r1", "r2"]
    t._runner = types.SimpleNamespace(input_batch=types.SimpleNamespace(req_ids=ids))
    assert t._req_ids(2) == ("r1", "r2")
    ids[1] = "r3"
    assert t._req_ids(2) == ("r1", "r3")
    assert t._req_ids(1) == ("r1",)
