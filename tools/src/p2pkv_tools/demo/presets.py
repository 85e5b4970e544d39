"""Model presets: the shape of one KV block, and so its size in bytes.

A block holds ``tokens_per_block`` tokens of KV cache for every layer of the model::

    block_bytes = layers x kv_heads x head_dim x tokens_per_block x dtype_bytes x kv_factor

``kv_factor`` is 2 for standard attention (a K and a V vector per head) and 1 for MLA
(multi-head latent attention, DeepSeek-V2/V3), which caches one compressed latent per token:
its "head" is the latent (``kv_lora_rank``) plus the decoupled RoPE key (``qk_rope_head_dim``),
shared by every query head, so ``kv_heads = 1``. Presets use the published model configs and
assume the KV cache dtype is the model dtype (bf16, 2 bytes) unless ``dtype_bytes`` says
otherwise; an fp8 KV cache halves the block.

With tensor parallelism (``tp``) each rank holds ``kv_heads / tp`` heads (one, replicated,
when ``tp`` exceeds the heads), and the chunk a vLLM CPU tier offers holds every rank's
share: ``tp x`` the rank's page. An MLA latent is whole on every rank and vLLM keeps one
copy, so its block does not grow with ``tp``. Sliding-window layers are counted like the
others: the block is what one block of every layer holds (vLLM keeps the windowed layers in
a KV-cache group of their own and loads only the window of it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from p2pkv.errors import ConfigError

__all__ = ["PRESETS", "ModelPreset", "resolve_preset"]


@dataclass(frozen=True)
class ModelPreset:
    """The KV-cache geometry of one model."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    tokens_per_block: int = 16
    dtype_bytes: int = 2
    kv_factor: int = 2
    """2: separate K and V; 1: one MLA latent per token."""
    note: str = ""
    override_bytes: int | None = None
    """Set by ``--block-bytes``: the block size used instead of the formula."""
    tp: int = 1
    """Tensor-parallel size of the engines (``--tp``)."""

    @property
    def heads_per_chunk(self) -> int:
        """KV heads one chunk holds: every rank's, replicated heads counted per rank."""
        if self.kv_factor == 1:
            return self.kv_heads  # MLA: one latent, one copy whatever the TP
        return max(1, self.kv_heads // self.tp) * self.tp

    @property
    def block_bytes(self) -> int:
        if self.override_bytes is not None:
            return self.override_bytes
        return (
            self.layers
            * self.heads_per_chunk
            * self.head_dim
            * self.tokens_per_block
            * self.dtype_bytes
            * self.kv_factor
        )

    def formula(self) -> str:
        """The block size written out, for the demo's header and ``--help``."""
        if self.override_bytes is not None:
            return f"{self.override_bytes:,} B (--block-bytes)"
        kv = "2 (K and V)" if self.kv_factor == 2 else "1 (MLA latent)"
        heads = f"{self.heads_per_chunk} KV heads"
        if self.tp > 1:
            heads += (
                f" (TP {self.tp}: {self.heads_per_chunk // self.tp} per rank x {self.tp})"
                if self.kv_factor == 2
                else f" (TP {self.tp}: one copy)"
            )
        return (
            f"{self.layers} layers x {heads} x {self.head_dim} head dim x "
            f"{self.tokens_per_block} tokens x {self.dtype_bytes} B x {kv} = "
            f"{self.block_bytes:,} B"
        )


PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("llama-3-8b", layers=32, kv_heads=8, head_dim=128, note="GQA, bf16"),
        ModelPreset("llama-3-70b", layers=80, kv_heads=8, head_dim=128, note="GQA, bf16"),
        ModelPreset("qwen3-8b", layers=36, kv_heads=8, head_dim=128, note="GQA, bf16"),
        ModelPreset("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128, note="GQA, bf16"),
        ModelPreset("mistral-7b", layers=32, kv_heads=8, head_dim=128, note="GQA, bf16"),
        ModelPreset(
            "deepseek-v3",
            layers=61,
            kv_heads=1,
            head_dim=512 + 64,
            kv_factor=1,
            note="MLA: kv_lora_rank 512 + rope dim 64, bf16",
        ),
        ModelPreset(
            "llama-3-8b-fp8",
            layers=32,
            kv_heads=8,
            head_dim=128,
            dtype_bytes=1,
            note="GQA, fp8 KV cache (--kv-cache-dtype fp8)",
        ),
        ModelPreset(
            "gpt-oss-120b",
            layers=36,
            kv_heads=8,
            head_dim=64,
            note="GQA, half the layers sliding-window (128 tokens), bf16",
        ),
        ModelPreset(
            "gemma-3-27b",
            layers=62,
            kv_heads=16,
            head_dim=128,
            note="GQA, 5 of 6 layers sliding-window (1024 tokens), bf16",
        ),
        ModelPreset("tiny", layers=2, kv_heads=2, head_dim=64, note="for quick checks"),
    )
}


def resolve_preset(
    name: str,
    *,
    block_bytes: int | None = None,
    tokens_per_block: int | None = None,
    tp: int | None = None,
) -> ModelPreset:
    """The preset ``name``, optionally re-blocked (``tokens_per_block``), on ``tp`` ranks, or
    overridden.

    ``block_bytes`` replaces the computed size. Sizes must be positive multiples of 8 bytes (the
    content check works in 64-bit words). Raises ``ConfigError`` naming the valid choices.
    """
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    if tokens_per_block is not None:
        if tokens_per_block <= 0:
            raise ConfigError(f"--tokens-per-block must be > 0, got {tokens_per_block}")
        preset = replace(preset, tokens_per_block=tokens_per_block)
    if tp is not None:
        heads = preset.kv_heads
        if tp <= 0 or (preset.kv_factor == 2 and heads % tp and tp % heads):
            raise ConfigError(
                f"--tp {tp}: {name} has {heads} KV heads; TP must divide them "
                "or be a multiple of them"
            )
        preset = replace(preset, tp=tp)
    if block_bytes is not None:
        preset = replace(preset, override_bytes=block_bytes)
    if preset.block_bytes <= 0 or preset.block_bytes % 8:
        raise ConfigError(
            f"block size must be a positive multiple of 8 bytes, got {preset.block_bytes}"
        )
    return preset
