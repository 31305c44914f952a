"""A chat's rendered text without running its template: one render per shape of chat, for the router's keys.

Most chat templates only ever write a message's content out as it is: between the same role headers and added
tokens, whatever the content says (ChatML's ``<|im_start|>user\\n`` ... ``<|im_end|>``). For such a template every
chat with the same roles renders to the same text around its contents, so the router (router/prompts.py, which
renders every chat request to key it) renders each *shape* (the roles, and ``add_generation_prompt``) once, with
stand-ins for the contents, and then lays each request's contents into that text: a C ``str.format`` in place of a
Jinja render in the sandbox (~1 us against ~7-14 us a short chat; the router's largest cost for a known chat).

A shape is kept only when the template provably treats its contents as opaque:

- the stand-ins (``_Opaque``) may be written out or joined to other text, and nothing else: a template that looks
  into a content (compares, measures, strips, slices, formats, iterates, hashes or calls any method of it, or of a
  text made from it) stops the render, and that shape is rendered by the template from then on;
- ``strftime_now`` stops it too (a date in the prompt would be frozen at the shape's first render);
- and the text laid out from the shape must equal the template's own render twice: for the request that met the
  shape first, and for contents made to show any rewriting (spaces at both ends, quotes, ``&<>{}%``, upper case,
  newlines and tabs), which catches what passes the stand-ins by without a method call (``tojson``'s escaping, a
  ``join`` then ``trim``).

For the router, not the server: the replica always runs its template. A shape laid out wrong could only cost the
router a cache miss (keys that match nothing), never an answer. Bounded: ``MAX_SHAPES`` shapes (kept or refused)
and ``MAX_MESSAGES`` messages a chat; any chat past them is rendered by the template.
"""

from __future__ import annotations

import re
import threading
from typing import NoReturn

from preheat.core.errors import RequestError, _LookedError
from preheat.text.chat import ChatTemplate

MAX_SHAPES = 4096  # role sequences: a fleet's conversations of up to a few hundred turns, with and without a system
MAX_MESSAGES = 512
# Noncharacters around a message's index stand in for its content: no template writes them, and a template that does
# gets no skeletons (``for_template``).
_OPEN, _CLOSE = "\U0010fffe", "\U0010ffff"
_STAND_IN = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_SHOWS = " \t Spaced \"quoted\" 'single' &amp; <tag> {brace} 100% UPPER lower\n\ttabbed \\ slash {index} \n "
_PROBES: tuple[tuple[tuple[str, ...], bool], ...] = (
    (("user",), True),
    (("system", "user"), True),
    (("system", "user", "assistant", "user"), True),
    (("user", "assistant"), False),
)

# Every str method and operator but these stops a skeleton render: writing a content out (``str``) and joining it to
# other text (``+``, whose result is a stand-in too) are all a template may do with one.
_ALLOWED = frozenset({"__new__", "__str__", "__getattribute__", "__doc__", "__getnewargs__", "__sizeof__",
                      "__init_subclass__", "__subclasshook__", "__class__", "__init__"})  # fmt: skip


def _stop(*_args: object, **_kwargs: object) -> NoReturn:
    raise _LookedError


class _Opaque(str):
    """A content, or a text made from one, while a shape is rendered: it can be written out and joined, no more."""

    __slots__ = ()

    def __str__(self) -> str:
        return str.__str__(self)

    def __add__(self, other: object) -> _Opaque:
        if not isinstance(other, str):
            raise _LookedError
        return _Opaque(str.__add__(self, other))

    def __radd__(self, other: object) -> _Opaque:
        if not isinstance(other, str):
            raise _LookedError
        return _Opaque(str.__add__(other, self))


for _name, _value in vars(str).items():
    if _name not in _ALLOWED and callable(_value) and _name not in vars(_Opaque):
        setattr(_Opaque, _name, _stop)


class Skeletons:
    """Chats rendered from their shapes' skeletons (``render``), where ``template`` allows it; thread-safe."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        # Per shape: the text around its contents as a ``str.format`` string ("{0}" where message 0's content
        # goes), or None for a shape its template must render.
        self._shapes: dict[tuple[tuple[str, ...], bool], str | None] = {}
        self._lock = threading.Lock()
        self._verified = False  # a shape was kept: the template writes contents as they are somewhere
        self.laid_out = 0  # chats laid out from a skeleton, for tests and profiles

    @classmethod
    def for_template(cls, template: ChatTemplate) -> Skeletons | None:
        """Skeletons for ``template``, or None when it writes no probe chat's contents as they are (then every chat
        is rendered by it, as before)."""
        if _OPEN in template.source or _CLOSE in template.source:
            return None
        skeletons = cls(template)
        for roles, add_generation_prompt in _PROBES:
            probe = [{"role": role, "content": f"{i}{_SHOWS}"} for i, role in enumerate(roles)]
            try:
                rendered = template.render(probe, add_generation_prompt=add_generation_prompt)
            except RequestError:  # a template that refuses this shape (no system role, say): not a verdict
                continue
            if skeletons._make(probe, add_generation_prompt, rendered) is None:
                return None
        with skeletons._lock:
            skeletons._shapes.clear()  # the probes' shapes are made again when a request has them
        return skeletons if skeletons._verified else None

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """``template.render(messages, add_generation_prompt=...)``, laid out from the shape's skeleton where it
        has one. ``messages``: each exactly ``{"role": str, "content": str}``, as ``text.request.prompt_fields``
        gives them."""
        if len(messages) > MAX_MESSAGES:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt)
        shape = (tuple([message["role"] for message in messages]), add_generation_prompt)
        try:
            skeleton = self._shapes[shape]
        except KeyError:  # a shape not met yet
            return self._first(messages, add_generation_prompt)
        if skeleton is None:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt)
        self.laid_out += 1
        return skeleton.format(*[message["content"] for message in messages])

    def _first(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        rendered = self.template.render(messages, add_generation_prompt=add_generation_prompt)
        if len(self._shapes) < MAX_SHAPES:
            self._make(messages, add_generation_prompt, rendered)
        return rendered

    def _make(self, messages: list[dict[str, str]], add_generation_prompt: bool, rendered: str) -> str | None:
        """Make and keep the skeleton of ``messages``' shape (None: the template must render it), checked against
        ``rendered``, the template's own text for ``messages``."""
        roles = tuple(message["role"] for message in messages)
        skeleton = self._skeleton(roles, add_generation_prompt)
        if skeleton is not None:
            shows = [{"role": role, "content": f"{_SHOWS}{i}{_SHOWS}"} for i, role in enumerate(roles)]
            try:
                checks = [
                    (messages, rendered),
                    (shows, self.template.render(shows, add_generation_prompt=add_generation_prompt)),
                ]
            except RequestError:  # the template takes the request's contents and not those: look no further
                skeleton = None
            else:
                for chat, text in checks:
                    if skeleton is not None and skeleton.format(*[m["content"] for m in chat]) != text:
                        skeleton = None
        with self._lock:
            self._shapes[(roles, add_generation_prompt)] = skeleton
            self._verified = self._verified or skeleton is not None
        return skeleton

    def _skeleton(self, roles: tuple[str, ...], add_generation_prompt: bool) -> str | None:
        """The template's text for a chat of ``roles`` with stand-ins for the contents, as a format string; None
        when the template looks into a content (or asks for the date)."""
        stand_ins = [{"role": role, "content": _Opaque(f"{_OPEN}{i}{_CLOSE}")} for i, role in enumerate(roles)]
        try:
            text = self.template.render(
                stand_ins, add_generation_prompt=add_generation_prompt, names={"strftime_now": _stop}
            )
        except (_LookedError, RequestError):
            return None
        parts = _STAND_IN.split(text)
        static = "".join(parts[::2])
        if _OPEN in static or _CLOSE in static:
            return None  # a stand-in cut apart: not written out as a whole
        fields = []
        for at, part in enumerate(parts):
            fields.append(part.replace("{", "{{").replace("}", "}}") if at % 2 == 0 else "{" + part + "}")
        return "".join(fields)

    def size(self) -> int:
        """Shapes met (kept or refused)."""
        return len(self._shapes)
