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

And one more shape, for the engine benchmark (``engine_bench``): ``llama-bench``, dense like
``llama`` but narrower (``BENCH_SHAPE``: hidden 128, 2 query and 2 KV heads of 64, so
2 KiB of float32 KV per token) and with positions up to ``BENCH_POSITIONS``, so one engine
prefills an 8K-token prompt in hundreds of milliseconds on one CPU core.

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
ARCHITECTURES = ("llama", "gemma3", "gpt-oss", "deepseek", "llama-bench")
BENCH_POSITIONS = 16384
"""Longest sequence ``llama-bench`` takes (its ``max_position_embeddings``)."""
BENCH_SHAPE: dict[str, int] = {
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "intermediate_size": 256}
"""``llama-bench``'s geometry (its KV bytes per token follow: layers x KV heads x head dim
x 2 x 4 bytes)."""


def _model(arch: str) -> Any:
    """The untrained ``transformers`` model of ``arch``."""
    import transformers as hf

    common: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}
    hybrid = ["sliding_attention", "full_attention"]
    if arch == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**common, intermediate_size=512))
    if arch == "llama-bench":
        return hf.LlamaForCausalLM(hf.LlamaConfig(
            **{**common, **BENCH_SHAPE, "max_position_embeddings": BENCH_POSITIONS}))
    if arch == "gemma3":
        return hf.Gemma3ForCausalLM(hf.Gemma3TextConfig(
            **common, intermediate_size=512, head_dim=64, sliding_window=WINDOW,
            layer_types=hybrid))
    if arch == "gpt-oss":
        return hf.GptOssForCausalLM(hf.GptOssConfig(
            **common, intermediate_size=256, head_dim=64, sliding_window=WINDOW,
            num_local_experts=4, num_experts_per_tok=2, layer_types=hybrid))
    if arch == "deepseek":
        return hf.DeepseekV2ForCausalLM(hf.DeepseekV2Config(
            **common, intermediate_size=512, kv_lora_rank=512, q_lora_rank=None,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=2, moe_intermediate_size=128))
    raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHITECTURES)}")


def build(out: Path, arch: str = "llama") -> Path:
    """Write the model of ``arch`` and the tokenizer to ``out`` (created); returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    _model(arch).save_pretrained(out, safe_serialization=True)
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<extra{len(vocab)}>"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    return out


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), *sys.argv[2:3]))
