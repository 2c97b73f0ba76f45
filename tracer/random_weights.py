"""The ``pagedtrace_random`` load format: dummy weights that make attention far from uniform.

vLLM's ``load_format="dummy"`` fills every weight uniformly in +-1e-3, so every
attention logit is ~0 and attention is a plain average of V: a replay of such a
run cannot tell a right block order or K layout from a wrong one. This loader
starts from vLLM's dummy loader, then re-initialises with a seeded normal scaled
by fan-in (query/key projections a bit larger), so logits spread over several
units and each query attends to a few keys. Under tensor parallelism each rank
re-initialises its own shards from ``SEED + rank``, so no two ranks hold the same
heads (a rank's heads put in another rank's place would show).
"""

from __future__ import annotations

from typing import Any

LOAD_FORMAT = "pagedtrace_random"
#: Seed of the re-initialisation (plus the tensor-parallel rank): the same preset at the same
#: tensor-parallel size always gives the same weights.
SEED = 1234
#: Standard deviation factor (times 1/sqrt(fan_in)) for ``qkv_proj``.
QKV_GAIN = 1.5

#: Standard deviation of embedding / lm_head weights.
EMBED_STD = 0.05

_registered = False


def reinit_weights(model, seed: int = SEED) -> None:
    """Re-initialise ``model``'s floating-point parameters in place (deterministic)."""
    import torch

    generators: dict[Any, Any] = {}
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if not param.is_floating_point():
                continue
            # One seeded generator per device: drawing 7B weights on the host takes minutes.
            gen = generators.get(param.device)
            if gen is None:
                gen = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)

            def randn(param=param, gen=gen):
                return torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)

            if param.dim() == 1:
                value = torch.ones_like(param, dtype=torch.float32) if "norm" in name else 0.02 * randn()
            elif "embed" in name or "lm_head" in name:
                # Small next to what the layers add: with tied embeddings a residual stream
                # dominated by the input embedding makes greedy decoding repeat its last token.
                value = EMBED_STD * randn()
            else:
                gain = QKV_GAIN if "qkv" in name or "q_proj" in name or "k_proj" in name else 1.0
                value = randn() * (gain / param.shape[-1] ** 0.5)
            param.copy_(value.to(param.dtype))


def register_loader() -> None:
    """Register the load format with vLLM (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    @register_model_loader(LOAD_FORMAT)
    class PagedtraceRandomLoader(DummyModelLoader):
        """vLLM's dummy loader followed by ``reinit_weights``."""

        def load_weights(self, model, model_config) -> None:
            from tracer.manifest import tp_rank

            super().load_weights(model, model_config)
            reinit_weights(model, seed=SEED + tp_rank())

    _registered = True
