"""Training documents: plain text files, JSONL records with a text field, and ShareGPT-style
conversations; plus the testbed's stdlib corpus and its held-out split rule.

A document is the token ids the target sees and a loss mask (True where the draft should
learn to predict; all True for plain text, assistant tokens only for conversations).
"""

from __future__ import annotations

import codecs
import fnmatch
import glob
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat import render_conversation

JSON_SUFFIXES = (".jsonl", ".json")
HELDOUT_MODULUS = 20
# The testbed's corpus: every stdlib .py file outside site-packages (1,697 train + 93 held-out).
STDLIB_PATTERN = "*.py"
STDLIB_EXCLUDE = ("site-packages/*",)


class CorpusError(ValueError):
    """An input that cannot be read as a corpus, with where and why."""


@dataclass
class Document:
    name: str
    token_ids: list[int]
    loss_mask: list[bool]


def is_heldout(relative_path: str) -> bool:
    """The testbed's split rule on the path relative to the corpus root (posix separators)."""
    return int(hashlib.sha1(relative_path.encode()).hexdigest(), 16) % HELDOUT_MODULUS == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def folder_files(root: Path, pattern: str, exclude: Iterable[str] = (), split: str | None = None) -> list[Path]:
    """Files under ``root`` matching ``pattern`` (by name), minus ``exclude`` globs on the
    relative path, optionally restricted to one side of the held-out split; sorted."""
    exclude = tuple(exclude)
    found = []
    for path in sorted(root.rglob(pattern)):
        if not path.is_file():
            continue
        relative = path.relative_to(root).as_posix()
        if any(fnmatch.fnmatch(relative, rule) for rule in exclude):
            continue
        if split is not None and is_heldout(relative) != (split == "heldout"):
            continue
        found.append(path)
    return found


def stdlib_files(split: str | None, root: Path | None = None) -> list[Path]:
    """The testbed corpus: stdlib .py files outside site-packages, one side of the split."""
    return folder_files(root or stdlib_root(), STDLIB_PATTERN, STDLIB_EXCLUDE, split)


def expand_inputs(inputs: Iterable[str], pattern: str, exclude: Iterable[str], split: str | None) -> list[Path]:
    """Files from paths, folders (searched for ``pattern``; the split rule applies to paths
    relative to the folder) and globs; a lone file is never split."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item).expanduser()
        if path.is_dir():
            files.extend(folder_files(path, pattern, exclude, split))
        elif path.is_file():
            files.append(path)
        else:
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise CorpusError(f"input {item!r} is neither a file, a folder nor a glob that matches files")
            files.extend(matches)
    return files


# Byte-order marks and the encodings they name; UTF-32's before UTF-16's (FF FE starts both LE marks).
BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
        (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def read_corpus_text(path: Path, strict: bool) -> str:
    """A corpus file's text. A byte-order mark names its encoding and is dropped (Windows editors
    write UTF-8 with one, PowerShell UTF-16: the mark was read as text, UTF-16 as mojibake); else
    UTF-8. ``strict`` (JSON, prompts) refuses bytes that are not in one line; plain text replaces
    them."""
    return decode_text(path.read_bytes(), str(path), strict)


def decode_text(data: bytes, name: str, strict: bool) -> str:
    """``read_corpus_text`` of bytes read elsewhere (stdin); ``name`` says where in an error."""
    encoding, start = next(((bom_name, len(bom)) for bom, bom_name in BOMS if data.startswith(bom)), ("utf-8", 0))
    try:
        text = data[start:].decode(encoding, errors="strict" if strict else "replace")
    except UnicodeDecodeError as error:
        raise CorpusError(f"{name}: not {encoding.upper()} text (byte {data[start + error.start]:#04x} at "
                          f"offset {start + error.start}); save it as UTF-8") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as read_text gave


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``<s> text </s>`` as the testbed was trained: the tokenizer adds its own start token
    (if it has one); the end token is appended here."""
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def _record_messages(record: dict[str, Any]) -> list[dict[str, str]] | None:
    """ShareGPT ``conversations`` (from/value) or ``messages`` (role/content), normalised to
    role/content with roles system/user/assistant; None when the record has neither."""
    raw = record.get("conversations")
    if raw is None:
        raw = record.get("messages")
    if raw is None:
        return None
    # A string or a list of strings iterates too, and failed on turn.get with a traceback.
    if not isinstance(raw, list) or not all(isinstance(turn, dict) for turn in raw):
        raise CorpusError("conversation is not a list of turn objects ({\"from\": ..., \"value\": ...} or "
                          "{\"role\": ..., \"content\": ...})")
    roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
             "bing": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
    messages = []
    for turn in raw:
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role not in roles or not isinstance(content, str):
            raise CorpusError(f"conversation turn with unknown role {role!r} or non-text content")
        messages.append({"role": roles[role], "content": content})
    return messages


def read_documents(files: Iterable[Path], tokenizer: Any, text_field: str = "text",
                   chat_template: bool = True) -> Iterator[Document]:
    """Documents in file order; JSON/JSONL files give one document per record."""
    for path in files:
        if path.suffix not in JSON_SUFFIXES:
            ids = encode_text(tokenizer, read_corpus_text(path, strict=False))
            yield Document(str(path), ids, [True] * len(ids))
            continue
        for number, record in _json_records(path):
            name = f"{path}:{number}"
            try:
                messages = _record_messages(record)
            except CorpusError as error:
                raise CorpusError(f"{name}: {error}") from None
            if messages is not None:
                try:
                    ids, mask = render_conversation(tokenizer, messages, use_template=chat_template)
                except ValueError as error:  # a template that rewrites a reply: named, not a traceback
                    raise CorpusError(f"{name}: {error} (--no-chat-template renders plain 'role: content' "
                                      "lines)") from None
                if any(mask):  # a conversation without assistant turns teaches nothing
                    yield Document(name, ids, mask)
                continue
            field_text = record.get(text_field)
            if not isinstance(field_text, str):
                raise CorpusError(f"{name}: record has no string field {text_field!r} and no conversation")
            ids = encode_text(tokenizer, field_text)
            yield Document(name, ids, [True] * len(ids))


def _json_records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    text = read_corpus_text(path, strict=True)
    if path.suffix == ".json" and text.lstrip().startswith("["):
        yield from _json_list_records(path, text)
        return
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise CorpusError(f"{path}:{number}: invalid JSON: {error}") from None
        if not isinstance(record, dict):
            raise CorpusError(f"{path}:{number}: expected a JSON object")
        yield number, record


def _json_list_records(path: Path, text: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of a ``.json`` list, numbered from 1; a file that is not valid JSON, or an item
    that is not an object, is the user's error in one line (was a JSONDecodeError/AttributeError)."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise CorpusError(f"{path}: invalid JSON: {error}") from None
    for number, record in enumerate(records, start=1):
        if not isinstance(record, dict):
            raise CorpusError(f"{path}: item {number} of the list is not a JSON object")
        yield number, record


def shuffled(files: list[Path], seed: int | None) -> list[Path]:
    """A fixed-seed shuffle, so a token cap takes a sample of the corpus, not its first folders."""
    if seed is None:
        return list(files)
    order = list(files)
    random.Random(seed).shuffle(order)
    return order
