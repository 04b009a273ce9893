"""Chat templates rendered as transformers renders them for vLLM, and counted as vLLM counts.

Each template here is small, hand-written, and uses one feature transformers provides beyond
plain jinja; the expected text is written out by hand, and ServerTokenizer's count must be
the real toy tokenizer's encoding of exactly that text. Real templates (../shared) must
render as they did before named templates and the generation tag existed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import orjson
import pytest

from replay.sim.engine import Engine
from replay.sim.errors import ApiError
from replay.sim.openai import chat_prompt
from replay.sim.options import SimOptions
from replay.synth.bodies import build_body
from replay.synth.chat_template import ChatTemplateError
from replay.synth.prompts import PromptSynthesizer, server_count
from replay.synth.tokenizer import ServerTokenizer, load_chat_template
from replay.trace.reader import read_trace
from support.paths import shared_path

USER = {"role": "user", "content": "hi"}
TOOLS = [{"type": "function", "function": {"name": "wetter", "description": "Wetter für <Ort>",
                                           "parameters": {"type": "object", "properties": {}}}}]


def tokenizer_with(folder: Path, toy_dir: Path, chat_template, **config) -> Path:
    """A copy of the toy tokenizer whose tokenizer_config.json has this template (a string or
    the named list) and these special-token entries."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(toy_dir / "tokenizer.json", folder / "tokenizer.json")
    base = json.loads((toy_dir / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **config, "chat_template": chat_template}))
    return folder


def assert_renders(tok: ServerTokenizer, messages: list[dict], expected: str, tools=None, **kwargs) -> None:
    """The rendered text is `expected`, and the chat count is the tokenizer's encoding of it."""
    assert tok.render_chat(messages, tools, kwargs or None) == expected
    direct = tok.tokenizer.encode(expected, add_special_tokens=False).ids
    assert tok.encode_chat(messages, tools, kwargs or None) == direct
    assert tok.count_chat(messages, tools, kwargs or None) == len(direct)


@pytest.fixture
def make(tmp_path, toy_tokenizer_dir):
    """make(template, **config) -> a ServerTokenizer over the toy vocabulary with that template."""
    def build(chat_template, **config) -> ServerTokenizer:
        return ServerTokenizer.load(tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, chat_template, **config))
    return build


# ---- what transformers adds to jinja -----------------------------------------------------------

def test_generation_block_renders_its_body(make):
    tok = make(
        "{% for m in messages %}"
        "{% if m.role == 'assistant' %}<a>{% generation %}{{ m.content }}</a>{% endgeneration %}"
        "{% else %}<u>{{ m.content }}</u>{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<a>{% endif %}"
    )
    messages = [USER, {"role": "assistant", "content": "lamo pesi"}, {"role": "user", "content": "ba"}]
    assert_renders(tok, messages, "<u>hi</u><a>lamo pesi</a><u>ba</u><a>")


def test_break_and_continue(make):
    tok = make(
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}"
        "{{ loop.index }}:{{ m.content }};"
        "{% endfor %}"
    )
    messages = [{"role": "system", "content": "s"}, USER, {"role": "assistant", "content": "ka"},
                {"role": "user", "content": "never"}]
    assert_renders(tok, messages, "2:hi;3:ka;")


def test_strftime_now_is_the_local_date(make):
    tok = make("{{ strftime_now('%Y-%m-%d') }} {% for m in messages %}{{ m.content }}{% endfor %}")
    before = datetime.now().strftime("%Y-%m-%d")
    text = tok.render_chat([USER])
    after = datetime.now().strftime("%Y-%m-%d")
    assert text in {f"{before} hi", f"{after} hi"}
    assert tok.count_chat([USER]) == len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


def test_tojson_keeps_non_ascii_and_order_and_takes_json_dumps_arguments(make):
    tok = make(
        "{% for m in messages %}{{ m | tojson }}|{{ m | tojson(indent=2) }}|"
        "{{ m | tojson(ensure_ascii=True, sort_keys=True) }}|{{ m | tojson(separators=(',', ':')) }}{% endfor %}"
    )
    message = {"role": "user", "content": "café <b> & ✓"}
    # jinja's own tojson would sort the keys and escape <, > and & as \u003c...
    assert_renders(tok, [message], (
        '{"role": "user", "content": "café <b> & ✓"}|'
        '{\n  "role": "user",\n  "content": "café <b> & ✓"\n}|'
        '{"content": "caf\\u00e9 <b> & \\u2713", "role": "user"}|'
        '{"role":"user","content":"café <b> & ✓"}'
    ))


def test_special_tokens_are_variables_and_unset_ones_are_undefined(make):
    tok = make(
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}|{{ unk_token is defined }}|"
        "{{ additional_special_tokens | join(',') }}|{{ documents is none }}|{{ tools is none }}|"
        "{{ add_generation_prompt }}",
        bos_token={"content": "<|endoftext|>", "lstrip": False, "special": True},
        eos_token="<|im_end|>", pad_token=None, unk_token="",
    )
    # transformers passes its special_tokens_map: null and empty tokens are absent, not None
    # (a template's `{{ pad_token }}` renders "", never "None"); documents is None, not undefined
    assert_renders(tok, [USER], "<|endoftext|>|<|im_end|>|False|False|<|im_start|>,<|im_end|>|True|True|True")


def test_chat_template_kwargs_add_variables_and_win_over_special_tokens(make):
    tok = make("{{ eos_token }}{% if enable_thinking is defined and not enable_thinking %}<nothink>{% endif %}"
               "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert_renders(tok, [USER], "<|im_end|>hi")
    assert_renders(tok, [USER], "E<nothink>hi", enable_thinking=False, eos_token="E")


# ---- templates that refuse -------------------------------------------------------------------------

BAD_ROLE = (
    "{% for m in messages %}\n"
    "{% if m.role not in ('user', 'assistant') %}{{ raise_exception('Unsupported role: ' + m.role) }}{% endif %}\n"
    "{{ m.content }}\n"
    "{% endfor %}"
)


def test_raise_exception_names_the_template_and_its_line(make, tmp_path):
    tok = make(BAD_ROLE)
    assert_renders(tok, [USER], "hi\n")
    with pytest.raises(ChatTemplateError) as caught:
        tok.render_chat([USER, {"role": "tool", "content": "x"}])
    err = caught.value
    assert err.reason == "Unsupported role: tool"
    config = tmp_path / "tok" / "tokenizer_config.json"
    assert str(err) == f"chat template {config}, template line 2: Unsupported role: tool"
    assert err.__suppress_context__ and err.__cause__ is None  # jinja's traceback is not chained on
    with pytest.raises(ChatTemplateError, match="template line 3: TypeError: can only concatenate"):
        make("{% for m in messages %}\n\n{{ m.content + 1 }}{% endfor %}").render_chat([USER])


def test_a_template_that_does_not_compile_fails_at_load(make):
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json, template line 2: .*endgeneration"):
        make("{% for m in messages %}\n{% generation %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template, said", [
    (42, "chat_template: expected a template string or a list of named ones, got int"),
    ([{"name": "default", "template": 7}], "chat_template 'default': expected a template string, got int"),
    ({"default": ["x"]}, "chat_template 'default': expected a template string, got list"),
])
def test_a_chat_template_that_is_no_text_is_one_error_naming_the_file(make, template, said):
    """A tokenizer_config.json whose chat_template is a number (or a list of one) was a
    TypeError's traceback in `prompts check` and `replay sim`."""
    with pytest.raises(ChatTemplateError) as err:
        make(template)
    assert str(err.value).endswith(f"tokenizer_config.json: {said}")


def test_the_sim_answers_a_refused_chat_with_the_templates_words(tmp_path, toy_tokenizer_dir):
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, BAD_ROLE)
    engine = Engine(SimOptions(tokenizer=str(folder)))
    with pytest.raises(ApiError) as caught:
        chat_prompt(engine, {"messages": [{"role": "tool", "content": "x"}]})
    assert caught.value.message == "chat template failed on these messages: Unsupported role: tool"
    assert caught.value.status == 400
    assert str(tmp_path) not in str(caught.value)  # no server paths in what a client reads


def test_a_template_that_does_not_compile_stops_chats_only(tmp_path, toy_tokenizer_dir):
    """Only a chat renders the template: as vLLM, the sim serves completions with one that does
    not compile and refuses chats (400, its words); `prompts check` passes for completions and
    refuses chat, naming the template."""
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, "{% for m in messages %}{{ m.content }")
    engine = Engine(SimOptions(tokenizer=str(folder)))
    with pytest.raises(ApiError) as caught:
        chat_prompt(engine, {"messages": [USER]})
    assert (caught.value.status, caught.value.message) == (400, "chat template failed on these messages: "
                                                                 "unexpected '}'")
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b'{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1]}\n')
    check = [sys.executable, "-m", "replay", "prompts", "check", "--trace", str(trace), "--tokenizer", str(folder)]
    completions = subprocess.run([*check, "--api", "openai-completions"], capture_output=True, text=True, timeout=60)
    assert completions.returncode == 0, completions.stderr
    chat = subprocess.run([*check, "--api", "openai-chat"], capture_output=True, text=True, timeout=60)
    assert chat.returncode == 2 and "template line 1: unexpected '}'" in chat.stderr, chat.stderr


def test_the_sim_renders_chat_template_kwargs(tmp_path, toy_tokenizer_dir):
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, template)
    engine = Engine(SimOptions(tokenizer=str(folder)))
    ids = chat_prompt(engine, {"messages": [USER], "chat_template_kwargs": {"greeting": "lamo "}})
    assert ids == engine.tokenizer.tokenizer.encode("lamo hi", add_special_tokens=False).ids


# ---- named templates and tools ----------------------------------------------------------------------

NAMED = [
    {"name": "default", "template": "D:{% for m in messages %}{{ m.content }}{% endfor %}:{{ tools is none }}"},
    {"name": "tool_use", "template": "T:{% for t in tools %}{{ t | tojson }}{% endfor %}:"
                                     "{% for m in messages %}{{ m.content }}{% endfor %}"},
]
TOOLS_JSON = ('{"type": "function", "function": {"name": "wetter", "description": "Wetter für <Ort>", '
              '"parameters": {"type": "object", "properties": {}}}}')


def test_a_list_of_named_templates_picks_default_or_tool_use(make):
    tok = make(NAMED)
    assert_renders(tok, [USER], "D:hi:True")
    assert_renders(tok, [USER], f"T:{TOOLS_JSON}:hi", tools=TOOLS)
    assert_renders(tok, [USER], "T::hi", tools=[])  # transformers: tools passed at all -> tool_use
    assert tok.chat_template.names == ["default", "tool_use"]


def test_named_templates_without_default_refuse_rows_without_tools(make):
    tok = make(NAMED[1:])
    assert_renders(tok, [USER], f"T:{TOOLS_JSON}:hi", tools=TOOLS)
    with pytest.raises(ChatTemplateError, match="none named 'default' \\(tool_use\\)"):
        tok.render_chat([USER])


def test_template_files_win_over_tokenizer_config(tmp_path, toy_tokenizer_dir):
    template = "CONFIG{% for m in messages %}{{ m.content }}{% endfor %}"
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, template)
    (folder / "chat_template.jinja").write_text("FILE{% for m in messages %}{{ m.content }}{% endfor %}")
    assert_renders(ServerTokenizer.load(folder), [USER], "FILEhi", tools=TOOLS)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS{{ tools | length }}")
    tok = ServerTokenizer.load(folder)
    assert_renders(tok, [USER], "FILEhi")
    assert_renders(tok, [USER], "TOOLS1", tools=TOOLS)


def test_named_templates_have_a_fingerprint_of_all_of_them(make):
    one = make(NAMED).chat_template.sha256
    assert one == make(list(reversed(NAMED))).chat_template.sha256  # the order of the list does not matter
    changed = [NAMED[0], {**NAMED[1], "template": NAMED[1]["template"] + " "}]
    assert make(changed).chat_template.sha256 != one
    single = make(NAMED[0]["template"]).chat_template
    assert single.sha256 == hashlib.sha256(NAMED[0]["template"].encode()).hexdigest()  # unchanged for one template


def test_trace_rows_with_tools_are_rendered_and_sent_with_them(tmp_path, toy_tokenizer_dir):
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, NAMED)
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "messages": [USER], "tools": TOOLS, "output_length": 3},
            {"timestamp": 1, "messages": [USER], "tools": [], "output_length": 3}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = ServerTokenizer.load(folder)
    with_tools, empty = read_trace(str(trace), "jsonl").rows
    encode = tok.tokenizer.encode
    chat = PromptSynthesizer(tok, "openai-chat")
    prompt = chat.prompt(with_tools)
    assert prompt.expected_tokens == server_count(tok, prompt) == len(encode(f"T:{TOOLS_JSON}:hi").ids)
    assert orjson.loads(build_body("openai-chat", prompt, model="m", output_length=3, stream=False))["tools"] == TOOLS
    # an empty list is not sent, so the server renders tools=None: the default template
    prompt = chat.prompt(empty)
    assert prompt.tools is None and prompt.expected_tokens == len(encode("D:hi:True").ids)
    text = PromptSynthesizer(tok, "openai-completions").prompt(with_tools)
    assert text.text == f"T:{TOOLS_JSON}:hi"


# ---- real templates: same text as before ------------------------------------------------------------

MESSAGES = {
    "user": [{"role": "user", "content": "Hello, how are you?"}],
    "system_user": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Héllo — naïve café ✓"}],
    "multi": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " hello there "},
              {"role": "user", "content": "again\n"}],
}
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
L3 = "<|start_header_id|>{}<|end_header_id|>\n\n"
# What main's renderer (before this module) gave for these messages.
BEFORE = {
    "qwen2": {
        "user": QWEN_SYSTEM + "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n",
        "system_user": "<|im_start|>system\nBe brief.<|im_end|>\n"
                       "<|im_start|>user\nHéllo — naïve café ✓<|im_end|>\n<|im_start|>assistant\n",
        "multi": QWEN_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n hello there <|im_end|>\n"
                 "<|im_start|>user\nagain\n<|im_end|>\n<|im_start|>assistant\n",
    },
    "llama3": {
        "user": "<|begin_of_text|>" + L3.format("user") + "Hello, how are you?<|eot_id|>" + L3.format("assistant"),
        "system_user": "<|begin_of_text|>" + L3.format("system") + "Be brief.<|eot_id|>" + L3.format("user")
                       + "Héllo — naïve café ✓<|eot_id|>" + L3.format("assistant"),
        "multi": "<|begin_of_text|>" + L3.format("user") + "hi<|eot_id|>" + L3.format("assistant")
                 + "hello there<|eot_id|>" + L3.format("user") + "again<|eot_id|>" + L3.format("assistant"),
    },
    "llama2": {
        "user": "<s>[INST] Hello, how are you? [/INST]",
        "system_user": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHéllo — naïve café ✓ [/INST]",
        "multi": "<s>[INST] hi [/INST] hello there </s><s>[INST] again [/INST]",
    },
}
# main's qwen2 render of MESSAGES["user"] with a tool whose description is "Wetter für einen Ort"
QWEN_TOOLS_SHA256 = "41cb24a5c895adb1f553694fff556a1bd5e3a0219d18afb3d863d86ff1a3c6e9"


@pytest.mark.parametrize("family", list(BEFORE))
def test_real_templates_render_as_before(family):
    tok = ServerTokenizer.load(shared_path("tokenizers", family))
    for name, messages in MESSAGES.items():
        assert_renders(tok, messages, BEFORE[family][name])


def test_real_qwen2_template_renders_tools_as_before():
    tok = ServerTokenizer.load(shared_path("tokenizers", "qwen2"))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für einen Ort",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    text = tok.render_chat(MESSAGES["user"], tools)
    assert hashlib.sha256(text.encode()).hexdigest() == QWEN_TOOLS_SHA256
    assert '"description": "Wetter für einen Ort"' in text
    assert tok.count_chat(MESSAGES["user"], tools) == len(tok.tokenizer.encode(text, add_special_tokens=False).ids)


def test_real_llama2_template_refuses_roles_that_do_not_alternate():
    folder = shared_path("tokenizers", "llama2")
    tok = ServerTokenizer.load(folder)
    with pytest.raises(ChatTemplateError) as caught:
        tok.render_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert caught.value.reason == "Conversation roles must alternate user/assistant/user/assistant/..."
    assert str(folder / "tokenizer_config.json") in str(caught.value)
    assert load_chat_template(folder).sha256 == tok.chat_template.sha256


# ---- the same text as transformers itself, where it is installed ----------------------------------

CROSS_CHECKED = {
    "features": "{{ bos_token }}|{{ pad_token }}|{{ documents is none }}|{{ tools | tojson(indent=1) }}\n"
                "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
                "{% else %}{{ m | tojson }}{% endif %}\n{% endfor %}",
    "named": NAMED,
}


@pytest.mark.parametrize("name", list(CROSS_CHECKED))
def test_same_text_as_transformers(name, tmp_path, toy_tokenizer_dir):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (an optional "
                                       "cross-check of the template's rendering: pip install transformers)")
    folder = tokenizer_with(tmp_path / "tok", toy_tokenizer_dir, CROSS_CHECKED[name], pad_token=None)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    tok = ServerTokenizer.load(folder)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "café <b>"},
                {"role": "assistant", "content": "ka"}, USER]
    for tools in (None, TOOLS):
        expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert tok.render_chat(messages, tools) == expected
