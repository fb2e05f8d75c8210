"""Chat templates, found and rendered the way transformers' ``apply_chat_template`` does, without torch.

Where a model folder keeps its template (transformers 5.x's order): ``chat_template.jinja``
(the default) and ``additional_chat_templates/*.jinja`` (named ones) win over the
``chat_template`` entry of ``tokenizer_config.json``, which is a string or a list of
``{"name", "template"}``. With several templates, the one named ``default`` is used.

Rendering matches transformers: jinja2's immutable sandbox with ``trim_blocks`` and
``lstrip_blocks``, the loop-controls extension, ``raise_exception``, ``strftime_now``, a
``tojson`` that does not escape HTML, the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) as variables, ``messages`` and ``add_generation_prompt=True``. The rendered
text is then tokenized without adding special tokens (the template writes BOS itself when
the model wants one), as transformers does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cpu_worker.model.model_dir import is_gguf
from ipc import messages as m

from .tokenizer import Tokenizer

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class ChatTemplateError(ValueError):
    """A chat request that cannot be turned into a prompt; ``code`` is the protocol's error code:
    ``no_chat_template`` (the model has none, or it does not compile) or ``bad_messages`` (the
    template refused these messages)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def read_chat_template(folder: str | Path) -> str | dict[str, str] | None:
    """The folder's template (a string), its named templates (a dict), or None; a GGUF file's
    ``tokenizer.chat_template``."""
    folder = Path(folder)
    if is_gguf(folder):
        from .gguf_tokenizer import gguf_chat_template

        return gguf_chat_template(folder)
    templates: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra = folder / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # the tokenizer loader reports an unreadable config
    saved = config.get("chat_template") if isinstance(config, dict) else None
    if isinstance(saved, list):
        return {entry["name"]: entry["template"] for entry in saved
                if isinstance(entry, dict) and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)}
    return saved if isinstance(saved, str) else None


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which no chat prompt wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: namespace(self=...) works
        self, rest = args[0], args[1:]
        attributes = dict(*rest, **kwargs)
        for name in attributes:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    env.globals["namespace"] = _Namespace
    return env


class ChatTemplate:
    """A model's chat template, ready to render ``messages`` into a prompt."""

    def __init__(self, source: str | Mapping[str, str] | None, special_tokens: Mapping[str, str],
                 origin: str = "this model"):
        self.special_tokens = dict(special_tokens)
        self.source: str | None = None
        self._template: jinja2.Template | None = None
        self._problem: str | None = None
        if source is None:
            self._problem = (f"{origin} has no chat template (tokenizer_config.json 'chat_template' or "
                             f"{CHAT_TEMPLATE_FILE}): send a plain prompt instead")
            return
        if not isinstance(source, str):
            if "default" not in source:
                self._problem = (f"{origin} has several chat templates ({', '.join(sorted(source))}) and none "
                                 f"named 'default'")
                return
            source = source["default"]
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as error:
            self._problem = f"the chat template of {origin} does not compile: {error}"

    @classmethod
    def from_dir(cls, folder: str | Path, special_tokens: Mapping[str, str]) -> ChatTemplate:
        return cls(read_chat_template(folder), special_tokens, origin=str(folder))

    @property
    def available(self) -> bool:
        return self._template is not None

    @property
    def problem(self) -> str | None:
        """Why chat requests cannot be served (None when they can)."""
        return self._problem

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` (each a mapping with ``role`` and ``content``)."""
        if self._template is None:
            raise ChatTemplateError("no_chat_template", self._problem or "no chat template")
        chat = [dict(message) for message in messages]
        try:
            return self._template.render(**self.special_tokens, messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.TemplateError as error:  # raise_exception(...) and undefined names included
            raise ChatTemplateError("bad_messages", f"the chat template refused these messages: {error}") from None
        except Exception as error:  # a template's own bug on these messages (e.g. adding None to a string)
            raise ChatTemplateError("bad_messages", f"the chat template failed on these messages: "
                                                    f"{type(error).__name__}: {error}") from None


def encode_chat(tokenizer: Tokenizer, template: ChatTemplate, messages: Sequence[m.ChatMessage]) -> list[int]:
    """Prompt ids for chat ``messages``: rendered, then tokenized without added special tokens."""
    text = template.render([{"role": message.role, "content": message.content} for message in messages])
    return tokenizer.encode(text, add_special_tokens=False)
