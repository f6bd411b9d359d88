"""Chat templates: a conversation rendered to one string the way Hugging Face tokenizers do it.

A model's chat template is a Jinja program stored in its ``tokenizer_config.json`` (key
``chat_template``: one string, or a list of ``{"name", "template"}`` entries of which ``default``
is used unless another is named) or, in newer exports, in a ``chat_template.jinja`` file beside
it. It is rendered in a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``,
the variables ``messages``, ``bos_token``, ``eos_token`` and ``add_generation_prompt``, the
function ``raise_exception(message)`` (templates call it to refuse a conversation) and
``strftime_now(format)``, a ``tojson`` filter that keeps non-ASCII text as is, and the
``{% generation %}`` tag (rendered as its body; plait finds assistant turns differently, see
:mod:`plait.data.sft_tokenize`).

A tokenizer without a template gets :data:`DEFAULT_CHAT_TEMPLATE` (ChatML), so that a base model
can be fine-tuned on conversations; its markers ``<|im_start|>`` and ``<|im_end|>`` are then plain
text to the tokenizer unless it has them as added tokens.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from plait.data.errors import DataError
from plait.data.tokenizer import find_eos

# ChatML: every turn is ``<|im_start|>{role}\n{content}<|im_end|>\n``; with add_generation_prompt
# the text ends with an opened assistant turn for the model to continue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SOURCE = "plait's default ChatML template (the tokenizer has none)"
CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker of assistant text): the body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and non-ASCII text, which would change the prompt.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The environment Hugging Face renders in: sandboxed (templates come with downloaded models)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template and where it came from (named in every error)."""

    def __init__(self, text: str, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.text, self.source = text, source
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._compiled = _environment().from_string(text)
        except TemplateError as exc:
            raise DataError(f"chat template from {source}: cannot be compiled ({exc}); fix the template or "
                            f"remove it to use plait's default ChatML template") from None

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = False,
               where: str = "") -> str:
        """The conversation as text; ``where`` (``file:line``) names the row in a failure."""
        try:
            return self._compiled.render(messages=[dict(m) for m in messages], bos_token=self.bos_token,
                                         eos_token=self.eos_token, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # template code is arbitrary: any error it raises is a failure to render
            row = f"{where}: " if where else ""
            raise DataError(f"{row}the chat template from {self.source} failed to render this conversation "
                            f"({type(exc).__name__}: {exc}); fix the row, or use a template that accepts "
                            f"it") from None


def _token_text(value: object) -> str:
    """A special token as tokenizer_config.json stores it: a string or an ``{"content": ...}`` object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return ""


def _pick_template(found: object, name: str | None, source: str) -> str | None:
    """The template text of a ``chat_template`` value: a string or a list of named templates."""
    if found is None:
        return None
    if isinstance(found, str):
        if name not in (None, "default"):
            raise DataError(f"{source}: has one unnamed chat_template, not one named {name!r}; "
                            f"leave the template name unset")
        return found
    if isinstance(found, list):
        named = {e.get("name"): e.get("template") for e in found if isinstance(e, Mapping)}
        wanted = name or "default"
        text = named.get(wanted)
        if isinstance(text, str):
            return text
        raise DataError(f"{source}: chat_template has no template named {wanted!r} (found "
                        f"{sorted(str(k) for k in named)}); name one of those")
    raise DataError(f"{source}: chat_template is a {type(found).__name__}; expected a string or a list of "
                    f"{{name, template}} objects")


def _config_dir(path: Path) -> Path:
    """The directory holding the tokenizer files, given it or any file in it."""
    return path if path.is_dir() else path.parent


def load_chat_template(tokenizer_path: str | os.PathLike | None, tokenizer: Tokenizer | None = None, *,
                       name: str | None = None) -> ChatTemplate:
    """The chat template of a tokenizer directory (or of the directory of a ``tokenizer.json`` or
    ``tokenizer_config.json``), else :data:`DEFAULT_CHAT_TEMPLATE`.

    ``bos_token``/``eos_token`` come from ``tokenizer_config.json``; without an ``eos_token`` there,
    the end-of-text token of ``tokenizer`` (:func:`plait.data.tokenizer.find_eos`) is used.
    """
    config: dict[str, Any] = {}
    text: str | None = None
    source = DEFAULT_SOURCE
    if tokenizer_path is not None:
        folder = _config_dir(Path(tokenizer_path))
        config_path = folder / CONFIG_FILE
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"{config_path}: cannot be read as JSON ({exc}); fix or remove the file") from None
            if not isinstance(loaded, dict):
                raise DataError(f"{config_path}: is a JSON {type(loaded).__name__}, not an object")
            config = loaded
            text = _pick_template(config.get("chat_template"), name, str(config_path))
            source = f"{config_path} (chat_template{'' if name is None else ' ' + repr(name)})"
        jinja_path = folder / JINJA_FILE
        if text is None and jinja_path.is_file():
            try:
                text, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
            except (OSError, UnicodeDecodeError) as exc:
                raise DataError(f"{jinja_path}: cannot be read as a UTF-8 chat template ({exc}); fix or remove "
                                f"the file") from None
    if text is None and name not in (None, "default"):
        raise DataError(f"chat template {name!r} was asked for but the tokenizer at {tokenizer_path} has no "
                        f"chat template")
    eos = _token_text(config.get("eos_token"))
    if not eos and tokenizer is not None:
        eos = find_eos(tokenizer)[0]
    return ChatTemplate(DEFAULT_CHAT_TEMPLATE if text is None else text, source,
                        bos_token=_token_text(config.get("bos_token")), eos_token=eos)
