"""A small byte-level BPE tokenizer with a ChatML template, trained here from generated words.

It lets `make demo` and the tests run where no real tokenizer is at hand (no ../shared, no
hub downloads). Training is deterministic: the same words in the same order give the same
tokenizer.json on every machine.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def toy_words(count: int = 1500, seed: int = 0) -> list[str]:
    """Pronounceable pseudo-words: plain lowercase ASCII, so every one is an ordinary word."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < count:
        w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
        if w not in seen:
            seen.add(w)
            words.append(w)
    return words


def build_toy_tokenizer(out_dir: str | Path, vocab_size: int = 3000, seed: int = 0) -> Path:
    """Train and write tokenizer.json + tokenizer_config.json (ChatML template) into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    words = toy_words(seed=seed)
    rng = random.Random(seed + 1)
    corpus = [" ".join(rng.choice(words) for _ in range(40)) + "." for _ in range(3000)]
    corpus += [" ".join(words[i : i + 20]) for i in range(0, len(words), 20)]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out
