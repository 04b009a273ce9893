"""The words prompts are made of: tokens that survive decode -> encode unchanged.

Random token ids do not round-trip (a decoded random sequence re-encodes to the same count
in under 1% of cases), so a synthesized prompt built from them is neither the right length
nor a stable prefix. Whole-word tokens do: a space marker ('Ġ' byte-level, '▁' sentencepiece)
followed by ASCII letters always starts a new pre-token, so no merge crosses the join between
two of them. The set is chosen per tokenizer and checked on load, because a vocabulary may
hold tokens its own merges never produce.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only a tokenizer's methods are called here: the library is imported where one is loaded
    from tokenizers import Tokenizer

SPACE_MARKERS = ("Ġ", "▁")
WORD = re.compile(r"[A-Za-z]+")
CHECK_SEQUENCES = 24
CHECK_LENGTH = 192
CHECK_SEED = 0x5EED
ENCODE_CHUNK = 2048


class VocabularyError(ValueError):
    """The tokenizer offers no words that round-trip; exact prompts cannot be built from it."""


@dataclass(frozen=True, slots=True)
class SafeVocab:
    """Token ids whose text concatenations re-encode to the same ids.

    texts[i] is ' ' + letters for ids[i]. A prompt's first word loses its space (templates
    strip content; sentencepiece adds the space back itself), and lead_ids[i] is the id that
    bare word encodes to; only the first `lead_count` entries have one, so blocks start with
    one of those.
    """

    ids: tuple[int, ...]
    texts: tuple[str, ...]
    lead_ids: tuple[int, ...]
    lead_count: int

    def __len__(self) -> int:
        return len(self.ids)


def word_tokens(tokenizer: Tokenizer) -> list[tuple[int, str]]:
    """(id, ' word') for every marker + ASCII letters token that is not an added token, by id."""
    added = set(tokenizer.get_added_tokens_decoder())
    found = []
    for token, token_id in tokenizer.get_vocab(with_added_tokens=False).items():
        if token_id in added or len(token) < 2 or token[0] not in SPACE_MARKERS:
            continue
        if WORD.fullmatch(token, 1):
            found.append((token_id, " " + token[1:]))
    found.sort()
    return found


def _encode_batch(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Ids only, ENCODE_CHUNK texts at a time: an Encoding also holds offsets, masks and
    token strings, and a real vocabulary's probes all at once made the peak RSS swell."""
    ids = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        ids += [e.ids for e in tokenizer.encode_batch(texts[start : start + ENCODE_CHUNK], add_special_tokens=False)]
    return ids


def build_safe_vocab(tokenizer: Tokenizer, name: str = "tokenizer") -> SafeVocab:
    """Pick the round-tripping words of `tokenizer`, then prove it on random sentences.

    Single words are checked one by one (in both forms: ' word' inside a prompt, 'word' at
    its start); then CHECK_SEQUENCES random concatenations must re-encode exactly. Words that
    break a concatenation are dropped and the check repeats; the choice is deterministic so
    every worker of a run ends up with the same vocabulary.
    """
    candidates = word_tokens(tokenizer)
    if not candidates:
        model = type(tokenizer.model).__name__  # WordPiece (BERT): words carry no space marker, pieces a '##'
        raise VocabularyError(f"{name}: no whole-word tokens (space marker + ASCII letters) in the vocabulary of "
                              f"this {model} model: prompts are synthesized for byte-level BPE, SentencePiece BPE "
                              "and Unigram tokenizers, as LLM servers use")
    # Inside a prompt a word is preceded by another word; encode each as 'a word' to see it in context.
    probe = _encode_batch(tokenizer, ["a" + text for text in (t for _, t in candidates)])
    bare = _encode_batch(tokenizer, [text[1:] for _, text in candidates])
    prefix = _encode_batch(tokenizer, ["a"])[0]
    added = set(tokenizer.get_added_tokens_decoder())
    words: list[tuple[int, str, int | None]] = []
    for (token_id, text), inside, alone in zip(candidates, probe, bare):
        if inside[len(prefix):] != [token_id] or inside[: len(prefix)] != prefix:
            continue
        lead = alone[0] if len(alone) == 1 and alone[0] not in added else None
        words.append((token_id, text, lead))
    dropped: set[int] = set()
    rng = random.Random(CHECK_SEED)
    for _ in range(8):
        words = [w for w in words if w[0] not in dropped]
        leads = [w for w in words if w[2] is not None]
        if not leads:
            raise VocabularyError(f"{name}: no whole-word token also encodes alone as one token")
        sequences = []
        for _ in range(CHECK_SEQUENCES):
            seq = [rng.choice(leads)] + rng.choices(words, k=rng.randint(1, CHECK_LENGTH))
            sequences.append(seq)
        # the first word goes bare, as it opens a prompt
        encoded = _encode_batch(tokenizer, ["".join(w[1] for w in seq)[1:] for seq in sequences])
        bad: set[int] = set()
        for seq, ids in zip(sequences, encoded):
            expected = [seq[0][2]] + [w[0] for w in seq[1:]]
            if ids != expected:
                # Blame the words at the first difference and just before it (a merge across their join).
                i = next((k for k, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
                bad.update(w[0] for w in seq[max(0, i - 1) : i + 1])
        if not bad:
            break
        dropped |= bad
    else:
        raise VocabularyError(f"{name}: whole-word tokens keep merging across joins; cannot build exact prompts")
    leads = [w for w in words if w[2] is not None]
    rest = [w for w in words if w[2] is None]
    ordered = leads + rest
    return SafeVocab(
        ids=tuple(w[0] for w in ordered),
        texts=tuple(w[1] for w in ordered),
        lead_ids=tuple(w[2] for w in leads),
        lead_count=len(leads),
    )
