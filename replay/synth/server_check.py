"""Does the server count prompts as this tokenizer does? Asked before a run sends anything.

Prompts are exact by construction against tokenizer.json, but a server does not always
tokenize the way tokenizer.json does: a `tokenizer_class` in tokenizer_config.json can make
transformers build another tokenizer from the same files (a byte-level BPE loaded as
`LlamaTokenizer` drops the spaces: +1,058 tokens a prompt on average in one run), or the server
renders another chat template or adds other special tokens. Every request then succeeds while
every count and every shared prefix of the run is wrong. So before the first send the master
asks each endpoint to count a sample of prompts built exactly as the run's are:

- the whole safe vocabulary (every word a synthesized prompt can contain), VOCAB_WORDS words a
  prompt, inside the chat template where the run uses one;
- synthetic rows across the template frame and block boundaries: the shortest exact row, rows
  a token either side of one and two blocks, several blocks, and the window's shortest and
  longest rows.

Each is compared with the ids the replay takes it to be: built from the proven frame and the
vocabulary's ids, as the synthesizer builds its prompts (encoded only where the replay itself
encodes, for templates that touch the content).

The sample uses a seed of its own, so no block of the run enters the server's prefix cache.
Ways to ask, in order: `POST /tokenize` (vLLM: prompt and messages forms; SGLang: prompt form;
TGI: `{"inputs"}`), which gives ids; else a `max_tokens: 1` request reading
`usage.prompt_tokens` (counts only; OpenAI APIs).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

from replay.protocol.ask import Asker, Unanswered
from replay.protocol.table import Api, get_api
from replay.protocol.urls import shown
from replay.rules.tokens import are_token_ids
from replay.synth.prompts import Prompt, PromptSynthesizer, encode_prompt
from replay.synth.tokenizer import tokenizer_json
from replay.synth.vocab import SPACE_MARKERS
from replay.trace.record import TraceRow

logger = logging.getLogger(__name__)

VOCAB_WORDS = 2048  # words per vocabulary prompt
MAX_SAMPLE_TOKENS = 1 << 17  # the longest sample prompt (a longer row is built the same way)
SAMPLE_SEED = 0x7E51  # added to the run's seed: the sample's blocks are none of the run's
SHOWN_TOKENS = 6  # tokens shown either side of the first difference
EDGE_TOKENS = 8  # a difference this small at the start or end is the frame's, not the tokenizer's
NOT_OFFERED = frozenset({400, 404, 405, 422, 501})  # "no such endpoint" or "not this form"
# tokenizer_class names of sentencepiece-style tokenizers: transformers builds them its own way
SENTENCEPIECE_CLASSES = ("Llama", "Gemma", "T5", "Mistral", "XLNet", "Albert")
TOKENIZE = "tokenize"
USAGE = "usage"


@dataclass(slots=True)
class Sample:
    label: str  # what it covers, as the error message says it
    prompt: Prompt
    ids: list[int]  # the prompt's ids by the server's rule, as this tokenizer has them


@dataclass
class Mismatch:
    sample: Sample
    server_ids: list[int] | None  # None: the server gave a count only
    server_count: int
    server_strs: list[str] | None = None


@dataclass
class ServerCheck:
    """One endpoint's answer: `method` None when it offered no way to count (see `note`)."""

    endpoint: str
    method: str | None = None
    prompts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    mismatch: Mismatch | None = None
    note: str = ""
    mismatches: int = 0

    @property
    def ok(self) -> bool:
        return self.method is not None and self.mismatch is None

    def to_dict(self) -> dict:
        """For the run's meta file: how the server was checked, and how it ended."""
        return {"endpoint": self.endpoint, "method": self.method, "prompts": self.prompts, "tokens": self.tokens,
                "mismatches": self.mismatches, "ok": self.ok, "note": self.note, "seconds": round(self.seconds, 3)}


class ServerCountsDiffer(ValueError):
    """A server counts the sample otherwise than the tokenizer: the run's counts would be wrong."""


def build_samples(synth: PromptSynthesizer, lengths: Iterable[int] = (), max_len: int | None = None) -> list[Sample]:
    """The prompts the servers are asked to count (the module's docstring says which).

    `synth` is the run's synthesizer (tokenizer, api, block size); the sample gets its own seed.
    `lengths`: input lengths of the run's own rows to include (its shortest and longest).
    `max_len`: the server's context; prompts are kept a token under it (the usage way asks for
    one output token).
    """
    sample = synth.reseeded(synth.seed + SAMPLE_SEED)
    cap = min(max_len or MAX_SAMPLE_TOKENS, MAX_SAMPLE_TOKENS) - 1
    samples = _vocabulary_samples(sample, cap)
    frame, size = sample.frame.overhead, sample.blocks.block_size
    wanted = [frame + 1, frame + 2, frame + size - 1, frame + size, frame + size + 1, frame + 2 * size + 1,
              frame + 5 * size + size // 2, *lengths]
    if sample.short_frame is not None:
        wanted.insert(0, sample.short_frame.overhead + 1)
    seen: set[int] = set()
    for n, length in enumerate(wanted):
        if length in seen or length > cap or length < sample.min_overhead_tokens:
            continue
        seen.add(length)
        blocks = -(-max(length - frame, 1) // size)
        row = TraceRow(request_id=n, timestamp_s=0.0, input_length=length, output_length=1,
                       hash_ids=tuple(range(blocks)))
        samples.append(Sample(f"a {length}-token prompt ({blocks} block(s) of {size})", sample.prompt(row),
                              sample.server_ids(row)))
    return samples


def _vocabulary_samples(sample: PromptSynthesizer, cap: int) -> list[Sample]:
    vocab = sample.vocab
    words = max(1, min(VOCAB_WORDS, cap - sample.frame.overhead - 2))
    order = _spread(len(vocab), sample.seed)
    samples = []
    for start in range(0, len(order), words):
        chunk = order[start : start + words]
        lead = start // words % vocab.lead_count  # a prompt's first word goes bare: one that has a bare form
        text = vocab.texts[lead][1:] + "".join(_gather(vocab.texts, chunk))
        prompt = sample.text_prompt(text, 0)
        if sample.verified:  # no proven frame: the replay encodes its prompts, and so does the check
            ids = encode_prompt(sample.tokenizer, prompt)
        else:  # the ids the replay takes this prompt to be (no tokenizer needed: it may be loaded lazily)
            frame = sample.frame
            ids = [*frame.before, vocab.lead_ids[lead], *_gather(vocab.ids, chunk), *frame.after]
        prompt.expected_tokens = len(ids)
        samples.append(Sample(f"vocabulary prompt {start // words + 1} ({len(chunk) + 1} words)", prompt, ids))
    return samples


def _spread(count: int, seed: int) -> list[int]:
    """Every index below `count` once, neighbours far apart: a stride coprime with `count`
    (near count / golden ratio, moved by the seed): cheaper than a shuffle of the words, which
    weighed on the check."""
    step = max(1, int(count / 1.618) + seed % 97)
    while math.gcd(step, count) != 1:
        step += 1
    return [i * step % count for i in range(count)]


def _gather(seq, indices: list[int]) -> tuple:
    """seq[i] for each index, at C speed (a whole vocabulary is gathered: 41k words for qwen2)."""
    return itemgetter(*indices)(seq) if len(indices) > 1 else tuple(seq[i] for i in indices)


def check_server(url: str, samples: list[Sample], api: str, model: str | None = None,
                 headers: dict[str, str] | None = None) -> ServerCheck:
    """Ask `url` to count every sample; the first mismatch is kept (all are counted). The result
    names the URL as shown (replay.protocol.urls): it is logged and written to the meta."""
    result = ServerCheck(shown(url))
    spec = get_api(api)
    started = time.perf_counter()
    try:
        with Asker() as asker:  # one connection for all the samples
            for sample in samples:
                answer = _count(asker, url, sample.prompt, spec, model or None, headers, result)
                if answer is None:
                    break
                ids, count, strs = answer
                result.prompts += 1
                result.tokens += count
                same = ids == sample.ids if ids is not None else count == len(sample.ids)
                if not same:
                    result.mismatches += 1
                    if result.mismatch is None:
                        result.mismatch = Mismatch(sample, ids, count, strs)
    except Unanswered as e:
        result.method, result.note = None, f"no answer: {e}"
    result.seconds = time.perf_counter() - started
    return result


def _count(asker: Asker, url: str, prompt: Prompt, api: Api, model: str | None, headers: dict | None,
           result: ServerCheck) -> tuple[list[int] | None, int, list[str] | None] | None:
    """(ids or None, count, the server's token texts or None) by the endpoint's way, found on its
    first prompt; None when it offers none (`result.note` says why). `model` None: no model field."""
    if result.method in (None, TOKENIZE):
        status, answer = asker.ask_json(url.rstrip("/") + "/tokenize", api.tokenize_body(prompt, model), headers)
        ids, strs = _tokenize_ids(answer) if status == 200 else (None, None)
        if ids is not None:
            result.method = TOKENIZE
            return ids, len(ids), strs
        # it answered before, or answered what no server without the endpoint says: an error
        if result.method == TOKENIZE or status not in NOT_OFFERED:
            raise Unanswered(f"POST /tokenize answered HTTP {status}: {_said(answer)}")
    if not api.usage_counts_prompt:
        result.note = f"no POST /tokenize (HTTP {status}), and --api {api.name} reports no prompt token count"
        return None
    # the run's own body for one output token, not streamed: its usage counts the prompt as the run's are
    path, body = api.body_path, api.body(prompt, model=model, max_tokens=1, stream=False, ignore_eos=False)
    status, answer = asker.ask_json(url.rstrip("/") + path, body, headers)
    usage = answer.get("usage") if isinstance(answer, dict) else None
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if status != 200 or not isinstance(count, int):
        if result.method == USAGE:
            raise Unanswered(f"POST {path} answered HTTP {status}: {_said(answer)}")
        result.note = f"no POST /tokenize, and POST {path} answered HTTP {status} without usage.prompt_tokens"
        return None
    result.method = USAGE
    return None, count, None


def _tokenize_ids(answer) -> tuple[list[int] | None, list[str] | None]:
    """vLLM/SGLang: {"tokens": [ids], "token_strs": [...]}; TGI: [{"id": .., "text": ..}, ...]."""
    if isinstance(answer, dict) and isinstance(answer.get("tokens"), list):
        tokens = answer["tokens"]
        if are_token_ids(tokens):
            strs = answer.get("token_strs")
            return tokens, strs if isinstance(strs, list) else None
    if isinstance(answer, list) and all(isinstance(t, dict) and isinstance(t.get("id"), int) for t in answer):
        return [t["id"] for t in answer], [str(t.get("text", "")) for t in answer]
    return None, None


def _said(answer) -> str:
    return json.dumps(answer)[:200] if answer is not None else "(no JSON)"


# -- the message --------------------------------------------------------------------------------


def explain(check: ServerCheck, synth: PromptSynthesizer, tokenizer_path: str) -> str:
    """The refusal: which server, which prompt, local vs server tokens, and the likely cause."""
    m = check.mismatch
    assert m is not None
    lines = [f"{check.endpoint} does not count prompts as --tokenizer {tokenizer_path} does "
             f"({check.mismatches} of {check.prompts} sample prompts differ; asked by "
             f"{'POST /tokenize' if check.method == TOKENIZE else 'usage.prompt_tokens'})",
             f"  first: {m.sample.label}: {len(m.sample.ids)} tokens here, {m.server_count} on the server"]
    tok = synth.tokenizer.tokenizer
    if m.server_ids is not None:
        local, server = m.sample.ids, m.server_ids
        at = _same_prefix(local, server)
        lo, hi = max(0, at - SHOWN_TOKENS), at + SHOWN_TOKENS
        server_strs = m.server_strs[lo:hi] if m.server_strs else [tok.id_to_token(i) or f"#{i}" for i in server[lo:hi]]
        lines += [f"  first difference at token {at}, in the text {tok.decode(local[lo:hi])!r}",
                  f"    here:   {' '.join(repr(tok.id_to_token(i) or f'#{i}') for i in local[lo:hi])}",
                  f"    server: {' '.join(repr(s) for s in server_strs)}"]
    lines.append(f"  likely cause: {likely_cause(m, synth, tokenizer_path)}")
    remedy = "  no request of the trace was sent. Serve this tokenizer and template, or pass the server's with " \
             "--tokenizer/--chat-template"
    if get_api(synth.api).token_ids:
        remedy += "; --prompt-format token-ids sends the prompts as ids, exact whatever the server does with text"
    lines.append(remedy + "; --verify-server off sends anyway (counts will be off)")
    return "\n".join(lines)


def likely_cause(m: Mismatch, synth: PromptSynthesizer, tokenizer_path: str) -> str:
    """A guess from where the counts differ: only around the content (template, special tokens)
    or inside it (the tokenizer itself)."""
    local = m.sample.ids
    if m.server_ids is not None:
        server = m.server_ids
        shorter = min(len(local), len(server))
        head, tail = _same_prefix(local, server), _same_prefix(local[::-1], server[::-1])
        # the ids differ only where the frame is (before or after the content), in a few tokens
        at_edge = head <= len(synth.frame.before) + 1 or tail <= len(synth.frame.after) + 1
        edges_only = at_edge and max(len(local), len(server)) - min(head + tail, shorter) <= EDGE_TOKENS
    else:
        edges_only = abs(m.server_count - len(local)) <= EDGE_TOKENS
    folder = tokenizer_json(tokenizer_path).parent
    named = _json(folder / "tokenizer_config.json").get("tokenizer_class")
    if edges_only:
        if synth.chat:
            return ("the chat template: the server puts other tokens around the message than this template "
                    f"({synth.frame.overhead} here); serve with this template, or pass the server's with --chat-template")
        return ("special tokens: the server adds other tokens around the text (BOS/EOS: add_bos_token in "
                "tokenizer_config.json, or another tokenizer_config.json)")
    if m.server_ids is not None and _spaces_dropped(m, synth):
        return ("the server's tokens carry no space marker where this tokenizer's do: it reads this byte-level "
                "tokenizer.json as a sentencepiece-style tokenizer, as transformers does when the server's "
                "tokenizer_config.json names a tokenizer_class such as LlamaTokenizerFast; name "
                "PreTrainedTokenizerFast there, or remove the line, on the server")
    if isinstance(named, str) and any(n in named for n in SENTENCEPIECE_CLASSES) and _byte_level(folder):
        return (f"this tokenizer_config.json names tokenizer_class {named!r} for a byte-level BPE tokenizer.json: "
                "the server's transformers builds that (sentencepiece-style) class from the files instead of using "
                "tokenizer.json as it is; name PreTrainedTokenizerFast there, or remove the line, on the server")
    return "the server's tokenizer is not this tokenizer.json: another model or revision, or loaded otherwise"


def _same_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids two lists share (the first difference's index)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _spaces_dropped(m: Mismatch, synth: PromptSynthesizer) -> bool:
    """Most of our tokens start with a space marker ('Ġ', '▁') and almost none of the server's do."""
    tok = synth.tokenizer.tokenizer
    ours = sum(1 for i in m.sample.ids if (tok.id_to_token(i) or "")[:1] in SPACE_MARKERS)
    theirs_texts = m.server_strs or [tok.id_to_token(i) or "" for i in m.server_ids or ()]
    theirs = sum(1 for t in theirs_texts if t[:1] in SPACE_MARKERS)
    return ours >= len(m.sample.ids) // 2 and theirs * 10 < ours


def _byte_level(folder: Path) -> bool:
    """tokenizer.json splits bytes (GPT-2 style: Qwen, Llama 3), not sentencepiece pieces."""
    spec = _json(folder / "tokenizer.json")
    return "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass
class Verdict:
    """The outcome over a fleet, for the run's meta file and the log."""

    checks: list[ServerCheck] = field(default_factory=list)
    skipped: str = ""  # why nothing was asked (e.g. --verify-server off)

    def to_dict(self) -> dict:
        return {"skipped": self.skipped, "endpoints": [c.to_dict() for c in self.checks]}


def skip_reason(mode: str, token_ids: bool) -> str | None:
    """Why a run asks no server, or None: `--verify-server off`, or token-id prompts, which a server
    counts as given."""
    if mode == "off":
        return "--verify-server off"
    if token_ids:
        return "--prompt-format token-ids: the server counts the ids as given"
    return None


def verify_servers(urls: list[str], synth: PromptSynthesizer, tokenizer_path: str, *, mode: str = "auto",
                   model: str | None = None, headers: dict[str, str] | None = None, lengths: Iterable[int] = (),
                   max_len: int | None = None) -> Verdict:
    """Check every endpoint (a fleet may mix servers). Raises ServerCountsDiffer on a mismatch,
    and, with mode "require", for an endpoint that offers no way to count. Ask `skip_reason`
    first: it decides before the synthesizer `synth` is built."""
    samples = build_samples(synth, lengths, max_len)
    verdict = Verdict()
    for url in urls:
        check = check_server(url, samples, synth.api, model, headers)
        verdict.checks.append(check)
        if check.mismatch is not None:
            raise ServerCountsDiffer(explain(check, synth, tokenizer_path))
        if check.method is None:
            if mode == "require":
                raise ServerCountsDiffer(f"--verify-server require: {check.endpoint} offers no way to count prompts: "
                                         f"{check.note}")
            logger.warning("--verify-server: %s not checked (%s); its prompt counts are assumed right", check.endpoint,
                           check.note)
            continue
        logger.info("--verify-server: %s counts all %d sample prompts (%d tokens) as this tokenizer does "
                    "(by %s, %.1f s)", check.endpoint, check.prompts, check.tokens,
                    "POST /tokenize" if check.method == TOKENIZE else "usage.prompt_tokens", check.seconds)
    return verdict
