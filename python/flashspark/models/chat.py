"""Chat templates: a model's Jinja template rendered like Hugging Face's `apply_chat_template`,
from a GGUF file's `tokenizer.chat_template` or a Hugging Face directory's
`tokenizer_config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str):
    raise TemplateError(message)


def apply_chat_template(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}]) under a chat template,
    rendered as Hugging Face's apply_chat_template does (trim_blocks, lstrip_blocks, a
    sandbox; `raise_exception` available to the template)."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError("messages must be a list of {'role': str, 'content': str} dicts")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
        )
    except TemplateError as e:
        raise ValueError(f"chat template failed: {e}") from None


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template with its BOS / EOS strings: `template(messages)` is the prompt
    text up to where the assistant's reply starts (the callable `data.render_prompt` takes)."""

    template: str
    bos_token: str = ""
    eos_token: str = ""

    def __call__(self, messages: list[dict[str, str]]) -> str:
        return apply_chat_template(self.template, messages, bos_token=self.bos_token, eos_token=self.eos_token)

    def user(self, text: str) -> str:
        """One user turn."""
        return self([{"role": "user", "content": text}])


def _token_text(value) -> str:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def hf_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model directory (`tokenizer_config.json`'s
    `chat_template`, or `chat_template.jinja`), None when it has none."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if not template:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{config_path}: chat_template is not a string")
    return ChatTemplate(template, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
