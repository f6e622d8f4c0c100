"""A small BPE tokenizer (with a chat template) for the tiny random models, whose folders have none.

    folder = make_tiny_model(tmp_path, "llama")
    add_tiny_tokenizer(folder)        # tokenizer.json + tokenizer_config.json + chat template, vocab 256

Ids 0..2 are ``<unk>``, ``<s>``, ``</s>`` (the tiny models' bos 1 / eos 2), then ``<|user|>`` and
``<|assistant|>``, the printable ASCII characters, and two-letter merges filling the rest of the 256
ids: text of letters splits into tokens of one or two characters, so a string often straddles a
token boundary (what the stop-string tests need).
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]


def add_tiny_tokenizer(folder: str | Path, vocab_size: int = 256) -> Path:
    """Write a fast tokenizer of exactly ``vocab_size`` ids (and a chat template) into the model folder."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in string.printable[:95]:  # digits, letters, punctuation, space
        vocab.setdefault(ch, len(vocab))
    merges = []
    for a, b in itertools.product("etaoinshrdlu", "etaoinshrdlcmu"):
        if len(vocab) >= vocab_size:
            break
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is outside what this tokenizer can fill ({len(vocab)})")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return Path(folder)
