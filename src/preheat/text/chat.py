"""Chat templates: the Jinja template a checkpoint ships, rendered the way transformers renders it.

The template comes from ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``
where ``default`` is used) or from a ``chat_template.jinja`` file beside it. It is rendered in jinja2's immutable
sandbox with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter and the
``raise_exception``/``strftime_now`` globals, as transformers does, so prompts are byte-identical to
``apply_chat_template``. jinja2 (~50 ms to import) is imported on the first render, or by ``compile()`` at warm-up.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING

from preheat.core.errors import CheckpointError, RequestError

if TYPE_CHECKING:  # jinja2 itself is imported on the first render
    from jinja2 import Template


def find_template(root: str, tokenizer_config: dict[str, object]) -> str | None:  # read value by value, checked
    """The checkpoint's chat template source, or None when it has none."""
    raw = tokenizer_config.get("chat_template")
    if isinstance(raw, list):
        named = {str(t.get("name")): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default") or next(iter(named.values()), None)
    if isinstance(raw, str) and raw:
        return raw
    path = os.path.join(root, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    return None


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to (``bos_token``, ``eos_token`` ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str], *, where: str) -> None:
        self.source = source
        self.special_tokens = special_tokens
        self.where = where
        self._template: Template | None = None  # compiled on first use

    def compile(self) -> None:
        """Import jinja2 and compile the template (done once; ``render`` calls it when needed)."""
        if self._template is not None:
            return
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(
            value: object,
            ensure_ascii: bool = False,
            indent: int | None = None,
            separators: tuple[str, str] | None = None,
            sort_keys: bool = False,
        ) -> str:
            # jinja2's own tojson escapes HTML characters, which would change prompts; transformers overrides it too.
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        def strftime_now(fmt: str) -> str:
            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            template = env.from_string(self.source)
        except jinja2.exceptions.TemplateError as exc:
            raise CheckpointError(f"{self.where}: the chat template does not compile: {exc}", path=self.where) from None
        # The same names and values as a plain dict: a template's globals are a ChainMap over the environment's,
        # which every render copies name by name (half of a short chat's render; the router renders every chat).
        template.globals = dict(template.globals)
        self._template = template

    def render(
        self,
        messages: list[dict[str, str]],
        *,
        add_generation_prompt: bool = True,
        names: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text for ``messages``; ``RequestError`` when the template refuses them (e.g. roles that do
        not alternate), with the template's own message. ``names``: template names to shadow for this render (a
        global such as ``strftime_now``; text/skeleton.py)."""
        self.compile()
        assert self._template is not None  # compile() set it or raised
        import jinja2

        try:
            text: str = self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **(names or {})
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RequestError(f"the chat template rejected these messages: {exc}") from None
        except (TypeError, KeyError, AttributeError) as exc:
            # A message missing 'role'/'content' (or not a mapping) surfaces inside the template as one of these.
            raise RequestError(
                f"messages do not fit the chat template ({exc!r}): each needs 'role' and 'content'"
            ) from None
        return text
