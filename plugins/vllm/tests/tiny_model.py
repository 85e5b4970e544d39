"""Build the deterministic tiny models the engine tests serve (no model hub needed).

Random weights from a fixed seed and a locally built character-level tokenizer: printable
ASCII, one token per character, so any prompt tokenizes without a hub. Every architecture has
2 layers, hidden 256, vocab 512, 4 query heads and 2 KV heads where it has KV heads:

- ``llama`` (the default): dense attention;
- ``gemma3``: one sliding-window layer (window ``WINDOW`` tokens) and one full-attention
  layer, so vLLM keeps two KV-cache groups (its hybrid KV-cache manager);
- ``gpt-oss``: gpt-oss's shape, sliding and full layers alternating, mixture of experts;
- ``deepseek``: DeepSeek-V2's multi-head latent attention (MLA: one 512 + 64 latent per
  token and layer, no per-head K and V), the smallest head geometry vLLM's MLA accepts.

And the engine benchmark's models (``engine_bench``), dense Llamas with positions up to
``BENCH_POSITIONS``:

- ``llama-bench``: narrower than ``llama`` (``BENCH_SHAPE``: hidden 128, 2 query and 2 KV
  heads of 64, so 2 KiB of float32 KV per token), so one engine prefills an 8K-token prompt
  in hundreds of milliseconds on one CPU core;
- the production KV shapes of ``KV_SHAPES``: the layer count, KV heads, head dim and bf16
  KV of a served model (``gpt-oss-120b-kv``: 36 x 8 x 64, 72 KiB per token;
  ``llama-3-8b-kv``: 32 x 8 x 128, 128 KiB per token), with as many query heads as KV
  heads and a small hidden and MLP size (``KV_SHAPE_BODY``), so a CPU runs them. Every
  layer attends to the whole prompt (gpt-oss's alternate sliding-window layers would keep
  only their window), so a pull moves every layer's KV of every token.

``python tiny_model.py DIR [ARCH]`` writes a Hugging Face model directory that
``vllm.LLM(model=DIR)`` and the OpenAI server load.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SEED = 0
VOCAB = 512
WINDOW = 64
"""Sliding-window length (tokens) of the hybrid models."""
SPECIALS = ("<unk>", "<s>", "</s>")
KV_SHAPES: dict[str, dict[str, int]] = {
    "gpt-oss-120b-kv": {"num_hidden_layers": 36, "num_key_value_heads": 8, "head_dim": 64},
    "llama-3-8b-kv": {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128},
}
"""Production KV geometries (Hugging Face ``config.json`` of ``openai/gpt-oss-120b`` and
``meta-llama/Meta-Llama-3-8B``): layers, KV heads, head dim; the KV is bf16."""
KV_SHAPE_BODY: dict[str, int] = {"hidden_size": 256, "intermediate_size": 256}
"""The small rest of a production-shape model (query heads = KV heads)."""
ARCHITECTURES = ("llama", "gemma3", "gpt-oss", "deepseek", "llama-bench", *KV_SHAPES)
BENCH_POSITIONS = 16384
"""Longest sequence ``llama-bench`` takes (its ``max_position_embeddings``)."""
BENCH_SHAPE: dict[str, int] = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "intermediate_size": 256,
}
"""``llama-bench``'s geometry (its KV bytes per token follow: layers x KV heads x head dim
x 2 x 4 bytes)."""


def kv_bytes_per_token(arch: str = "llama-bench") -> int:
    """KV bytes per token of an engine-benchmark model: layers x KV heads x head dim x 2
    (K and V) x the KV dtype's bytes (4 for ``llama-bench``'s float32, 2 for bf16)."""
    if arch == "llama-bench":
        shape, dtype_bytes = (
            {
                **BENCH_SHAPE,
                "head_dim": BENCH_SHAPE["hidden_size"] // BENCH_SHAPE["num_attention_heads"],
            },
            4,
        )
    else:
        shape, dtype_bytes = KV_SHAPES[arch], 2
    return (
        shape["num_hidden_layers"]
        * shape["num_key_value_heads"]
        * shape["head_dim"]
        * 2
        * dtype_bytes
    )


def _model(arch: str) -> Any:
    """The untrained ``transformers`` model of ``arch``."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    hybrid = ["sliding_attention", "full_attention"]
    if arch == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, intermediate_size=512))
    if arch == "llama-bench":
        return hf.LlamaForCausalLM(
            hf.LlamaConfig(**{**common, **BENCH_SHAPE, "max_position_embeddings": BENCH_POSITIONS})
        )
    if arch in KV_SHAPES:
        shape = KV_SHAPES[arch]
        return hf.LlamaForCausalLM(
            hf.LlamaConfig(
                **{
                    **common,
                    **KV_SHAPE_BODY,
                    **shape,
                    "num_attention_heads": shape["num_key_value_heads"],
                    "max_position_embeddings": BENCH_POSITIONS,
                }
            )
        )
    if arch == "gemma3":
        return hf.Gemma3ForCausalLM(
            hf.Gemma3TextConfig(
                **common,
                intermediate_size=512,
                head_dim=64,
                sliding_window=WINDOW,
                layer_types=hybrid,
            )
        )
    if arch == "gpt-oss":
        return hf.GptOssForCausalLM(
            hf.GptOssConfig(
                **common,
                intermediate_size=256,
                head_dim=64,
                sliding_window=WINDOW,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=hybrid,
            )
        )
    if arch == "deepseek":
        return hf.DeepseekV2ForCausalLM(
            hf.DeepseekV2Config(
                **common,
                intermediate_size=512,
                kv_lora_rank=512,
                q_lora_rank=None,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                n_routed_experts=4,
                num_experts_per_tok=2,
                first_k_dense_replace=2,
                moe_intermediate_size=128,
            )
        )
    raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHITECTURES)}")


def build(out: Path, arch: str = "llama") -> Path:
    """Write the model of ``arch`` and the tokenizer to ``out`` (created); returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    model = _model(arch)
    if arch in KV_SHAPES:
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<extra{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), *sys.argv[2:3]))
