"""Chat templates render character for character as transformers renders them."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvserve.engine.tiny_model import ARCHES
from kvserve.model_folder.chat_template import ChatTemplateError, render_chat_template
from kvserve.model_folder.tokenizer import Tokenizer

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city — «now»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CONVERSATIONS = (
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse.  "},
        {"role": "user", "content": "Write a poem about the sea."},
        {"role": "assistant", "content": "Waves."},
        {"role": "user", "content": "Again, <b>louder</b> 😀"},
    ],
    [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 C"},
    ],
)


@cache
def reference(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_transformers(arch, with_tools, add_generation_prompt, tiny_model_dirs):
    ours, theirs = Tokenizer(tiny_model_dirs[arch]), reference(tiny_model_dirs[arch])
    tools = [WEATHER_TOOL] if with_tools else None
    for messages in CONVERSATIONS:
        expected_ids = theirs.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        expected_text = theirs.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        rendered = ours.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected_text
        tokens = ours.encode_chat(
            messages, tools=tools, add_generation_prompt=add_generation_prompt
        )
        assert tokens == list(expected_ids)


def test_tojson_keeps_non_ascii_and_html():
    template = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}"
    message = {"content": "<b>é</b>"}
    rendered = render_chat_template(template, [message], special_tokens={})
    assert rendered == json.dumps(message, ensure_ascii=False) + "|" + json.dumps(
        message, ensure_ascii=False, indent=2
    )


def test_whitespace_control_and_loop_controls():
    template = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
        "{{ m.content }};\n"
        "{% endfor %}"
    )
    messages = [{"role": "a", "content": "x"}, {"role": "skip"}, {"role": "b", "content": "y"}]
    assert render_chat_template(template, messages, special_tokens={}) == "x;\ny;\n"


def test_raise_exception_becomes_a_chat_template_error():
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template(template, [], special_tokens={})


def test_generation_tag_renders_its_body():
    template = "{% generation %}{{ messages[0].content }}{% endgeneration %}!"
    assert render_chat_template(template, [{"content": "hi"}], special_tokens={}) == "hi!"


def test_syntax_error_and_sandbox_escape_are_refused():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [], special_tokens={})
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [], special_tokens={})


def test_named_templates_pick_tool_use_when_tools_are_given(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain"},
        {"name": "tool_use", "template": "with {{ tools | length }} tools"},
    ]
    config_path.write_text(json.dumps(config))
    tokenizer = Tokenizer(folder)
    assert tokenizer.apply_chat_template([]) == "plain"
    assert tokenizer.apply_chat_template([], tools=[WEATHER_TOOL]) == "with 1 tools"


def test_chat_template_file_takes_precedence(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text("{{ bos_token }}[{{ messages[0].content }}]")
    messages = [{"role": "user", "content": "x"}]
    rendered = Tokenizer(folder).apply_chat_template(messages)
    assert rendered == "<|begin_of_text|>[x]"
    assert rendered == reference(folder).apply_chat_template(messages, tokenize=False)


def test_folder_without_template_says_so(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])
