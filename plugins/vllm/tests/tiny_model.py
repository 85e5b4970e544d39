"""Build the deterministic tiny Llama the engine tests serve (no model hub needed).

Random weights from a fixed seed (2 layers, hidden 256, 4 heads, 2 KV heads, vocab 512) and a
locally built character-level tokenizer: printable ASCII, one token per character, so any
prompt tokenizes without a hub. ``python tiny_model.py DIR`` writes a Hugging Face model
directory that ``vllm.LLM(model=DIR)`` and the OpenAI server load.
"""

from __future__ import annotations

import sys
from pathlib import Path

SEED = 0
VOCAB = 512
SPECIALS = ("<unk>", "<s>", "</s>")


def build(out: Path) -> Path:
    """Write the model and tokenizer to ``out`` (created); returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
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
    print(build(Path(sys.argv[1])))
