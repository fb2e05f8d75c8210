"""Chat templates are found and rendered as transformers' apply_chat_template finds and renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dovetail_runtime.chat_template import ChatTemplate, ChatTemplateError, encode_chat, read_chat_template
from dovetail_runtime.tokenizer import Tokenizer
from ipc import messages as m

from conftest import DEMO_TARGET
from tokenizer_folders import llama2_folder

# Llama-2-chat's template (as published): BOS/EOS variables, raise_exception, a system turn.
LLAMA2_CHAT = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
# ChatML with block tags on their own lines (trim_blocks/lstrip_blocks matter), a namespace,
# loop controls, tojson of non-ASCII text and the generation tag.
CHATML = """{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content }}{% endgeneration %}<|im_end|>
    {% else %}
{{ message.content }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
<!-- {{ ns.turns }} turns, {{ messages[-1].content | tojson }} -->"""

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of France? <s> & é"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "  And of Italy?  "},
]


def tokenizer_folder(tmp_path: Path, name: str, config_extra: dict, kind: str = "demo") -> Path:
    """A tokenizer folder (the demo's, or a Llama-2-style one) with extra tokenizer_config entries."""
    folder = tmp_path / name
    if kind == "demo":
        folder.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            shutil.copy(DEMO_TARGET / file, folder / file)
    else:
        llama2_folder(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **config_extra}))
    return folder


def transformers_render(folder: Path, messages: list[dict], tokenize: bool = False):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    return hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, return_dict=False)


@pytest.mark.parametrize("kind", ["demo", "llama2"])
@pytest.mark.parametrize("template", [LLAMA2_CHAT, CHATML], ids=["llama2-chat", "chatml"])
def test_render_and_ids_match_transformers(tmp_path, kind, template):
    folder = tokenizer_folder(tmp_path, "tok", {"chat_template": template}, kind)
    tokenizer = Tokenizer.from_dir(folder)
    ours = ChatTemplate.from_dir(folder, tokenizer.special_tokens)
    for conversation in (CONVERSATION, CONVERSATION[1:2]):
        text = ours.render(conversation)
        assert text == transformers_render(folder, conversation)
        chat = [m.ChatMessage(role=turn["role"], content=turn["content"]) for turn in conversation]
        assert encode_chat(tokenizer, ours, chat) == transformers_render(folder, conversation, tokenize=True)
    if template is LLAMA2_CHAT:
        assert text.startswith("<s>[INST] Capital of France?")  # the template writes BOS; encode adds none
        ids = encode_chat(tokenizer, ours, chat)
        assert ids[0] == tokenizer.bos_token_id != ids[1]


def test_template_files_win_over_the_config_and_named_templates(tmp_path):
    folder = tokenizer_folder(tmp_path, "tok", {"chat_template": [
        {"name": "default", "template": "config-default {{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools"}]})
    assert read_chat_template(folder) == {"default": "config-default {{ messages[0].content }}",
                                          "tool_use": "tools"}
    assert ChatTemplate.from_dir(folder, {}).render([{"role": "user", "content": "hi"}]) == "config-default hi"
    assert transformers_render(folder, [{"role": "user", "content": "hi"}]) == "config-default hi"

    (folder / "chat_template.jinja").write_text("file {{ messages[0].content }}{{ eos_token }}")
    assert read_chat_template(folder) == "file {{ messages[0].content }}{{ eos_token }}"
    tokenizer = Tokenizer.from_dir(folder)
    rendered = ChatTemplate.from_dir(folder, tokenizer.special_tokens).render([{"role": "user", "content": "hi"}])
    assert rendered == transformers_render(folder, [{"role": "user", "content": "hi"}]) == "file hi</s>"

    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "rag.jinja").write_text("rag")
    assert read_chat_template(folder) == {"default": "file {{ messages[0].content }}{{ eos_token }}", "rag": "rag"}


def test_several_templates_without_a_default_are_refused(tmp_path):
    folder = tokenizer_folder(tmp_path, "tok", {"chat_template": [{"name": "a", "template": "x"},
                                                                  {"name": "b", "template": "y"}]})
    template = ChatTemplate.from_dir(folder, {})
    assert not template.available
    with pytest.raises(ChatTemplateError, match="none named 'default'") as info:
        template.render([{"role": "user", "content": "hi"}])
    assert info.value.code == "no_chat_template"


def test_a_model_without_a_template_gets_a_clear_error():
    template = ChatTemplate.from_dir(DEMO_TARGET, {})
    assert template.source is None and not template.available
    with pytest.raises(ChatTemplateError, match="has no chat template") as info:
        template.render([{"role": "user", "content": "hi"}])
    assert info.value.code == "no_chat_template"
    assert str(DEMO_TARGET) in str(info.value)


def test_a_template_that_does_not_compile_is_reported():
    template = ChatTemplate("{% for m in messages %}", {})
    assert not template.available and "does not compile" in (template.problem or "")
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": "user", "content": "hi"}])
    assert info.value.code == "no_chat_template"


def test_the_template_can_refuse_messages():
    template = ChatTemplate(LLAMA2_CHAT, {"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ChatTemplateError, match="roles must alternate") as info:
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.code == "bad_messages"
    with pytest.raises(ChatTemplateError, match="failed on these messages"):  # a template's own type error
        ChatTemplate("{{ 1 + messages[0].content }}", {}).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ messages.append({'role': 'x'}) }}",  # the sandbox is immutable
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # no reach into Python internals
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",  # nor through a namespace
])
def test_the_sandbox_holds(source):
    with pytest.raises(ChatTemplateError) as info:
        ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])
    assert info.value.code == "bad_messages"
