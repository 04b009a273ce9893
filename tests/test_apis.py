"""The API table (replay/protocol/table.py): each API's paths, request bodies on the wire, and reply readers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replay.protocol.prompt import Prompt
from replay.protocol.table import API_NAMES, APIS, get_api
from replay.synth.bodies import build_body

CHAT = Prompt([{"role": "user", "content": "hi"}], None, None, 5)
TEXT = Prompt(None, "hi", None, 2)
IDS = Prompt(None, None, [1, 2, 3], 3)
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def test_every_api_is_described_once_with_its_paths_and_prompt_form():
    assert API_NAMES == ("openai-chat", "openai-completions", "tgi")
    described = {name: (api.name, api.path(True), api.path(False), api.chat, api.token_ids, api.usage_counts_prompt)
                 for name, api in APIS.items()}
    assert described == {
        "openai-chat": ("openai-chat", "/v1/chat/completions", "/v1/chat/completions", True, False, True),
        "openai-completions": ("openai-completions", "/v1/completions", "/v1/completions", False, True, True),
        "tgi": ("tgi", "/generate_stream", "/generate", False, False, False),
    }
    for api in APIS.values():
        assert all(callable(f) for f in (api.body, api.tokenize_body, api.read_event, api.read_body)), api.name
    assert get_api("tgi") is APIS["tgi"]
    with pytest.raises(ValueError, match=r"--api 'nope': expected one of openai-chat, openai-completions, tgi"):
        get_api("nope")


@pytest.mark.parametrize("api, prompt, kwargs, expected", [
    ("openai-chat", CHAT, dict(model="m", output_length=3, stream=True),
     b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,'
     b'"stream_options":{"include_usage":true},"ignore_eos":true,"min_tokens":3}'),
    ("openai-chat", Prompt(CHAT.messages, None, None, 5, TOOLS), dict(model="", output_length=0, stream=False,
                                                                       ignore_eos=False),
     b'{"model":"","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f"}}],'
     b'"max_tokens":1,"stream":false}'),
    ("openai-completions", TEXT, dict(model="m", output_length=2, stream=False),
     b'{"model":"m","prompt":"hi","max_tokens":2,"stream":false,"ignore_eos":true,"min_tokens":2}'),
    ("openai-completions", IDS, dict(model="m", output_length=2, stream=True, ignore_eos=False),
     b'{"model":"m","prompt":[1,2,3],"max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}'),
    ("tgi", TEXT, dict(model="m", output_length=0, stream=True),
     b'{"inputs":"hi","parameters":{"max_new_tokens":1,"details":true,"decoder_input_details":false}}'),
])
def test_bodies_are_these_bytes(api, prompt, kwargs, expected):
    assert build_body(api, prompt, **kwargs) == expected


def test_a_body_refuses_a_prompt_of_another_form():
    with pytest.raises(ValueError, match="needs messages"):
        build_body("openai-chat", TEXT, model="m", output_length=1, stream=False)
    with pytest.raises(ValueError, match="needs a text prompt"):
        build_body("tgi", IDS, model="m", output_length=1, stream=False)


def test_tokenize_bodies():
    """The server check's POST /tokenize, in each server's form; a None model is left out."""
    chat = get_api("openai-chat").tokenize_body(Prompt(CHAT.messages, None, None, 5, TOOLS), "m")
    assert chat == {"model": "m", "messages": CHAT.messages, "add_generation_prompt": True, "tools": TOOLS,
                    "return_token_strs": True}
    assert get_api("openai-completions").tokenize_body(TEXT, None) == {
        "prompt": "hi", "add_special_tokens": True, "return_token_strs": True}
    assert get_api("tgi").tokenize_body(TEXT, "m") == {"inputs": "hi"}


def test_readers_count_content_not_role_or_usage():
    chat = get_api("openai-chat")
    assert chat.read_event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})[0] == 0
    assert chat.read_event({"choices": [{"delta": {"content": "x"}}]})[0] == 1
    assert chat.read_event({"choices": [{"delta": {"reasoning_content": "x"}}]})[0] == 1
    count, usage, err = chat.read_event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3,
                                                                   "prompt_tokens_details": {"cached_tokens": 4}}})
    assert (count, usage, err) == (0, {"prompt_tokens": 7, "output_tokens": 3, "cached_tokens": 4}, None)
    assert chat.read_event({"error": {"message": "boom"}})[2] == "boom"
    assert chat.read_body({"choices": [{"message": {"content": "x"}}]})[0] == 1
    completions = get_api("openai-completions")
    assert completions.read_event({"choices": [{"text": "a"}, {"text": ""}]})[0] == 1
    assert completions.read_body({"choices": [{"text": ""}]})[0] == 0
    tgi = get_api("tgi")
    assert tgi.read_event({"token": {"id": 1, "text": "a", "special": False}, "details": None})[0] == 1
    assert tgi.read_event({"token": {"id": 2, "text": "</s>", "special": True}})[0] == 0
    count, usage, err = tgi.read_body([{"generated_text": "a", "details": {"generated_tokens": 1,
                                                                          "prefill": [{}, {}]}}])
    assert (count, usage, err) == (1, {"prompt_tokens": 2, "output_tokens": 1, "cached_tokens": None}, None)
    assert tgi.read_event({"error": "overloaded"})[2] == "overloaded"


def test_synth_imports_no_http_client():
    """Synth runs before dispatch: the table it builds bodies from must not pull in gevent."""
    code = ("import sys, replay.synth.bodies; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gevent', 'geventhttpclient')"
            " or m == 'replay.protocol.client'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
