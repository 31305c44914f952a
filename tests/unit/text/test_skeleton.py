"""``Skeletons`` (text/skeleton.py): a chat's text laid out from its shape's one render. The router keys requests by
it, so it must be exactly the template's own render for every chat, and a template that looks into a message's
content (or asks for the date) must be rendered by itself, by shape or as a whole."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from preheat.core.errors import RequestError
from preheat.text import skeleton
from preheat.text.chat import ChatTemplate
from preheat.text.skeleton import Skeletons
from preheat.text.tokenizer import TextTokenizer
from strategies import FRAGMENTS, FUZZ

# Contents that a format string or a stand-in could trip on: braces, format fields, the stand-ins' own noncharacters.
contents = st.lists(
    st.sampled_from([*FRAGMENTS, "{0}", "{", "}}", "%s", "\U0010fffe0\U0010ffff", "\U0010ffff"]), max_size=20
).map("".join)
chats = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": contents}),
    min_size=1, max_size=7,
)  # fmt: skip

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are {helpful}.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Writes contents as they are, in a different order and twice, with `~` and a set variable.
REORDERED = (
    "{% set first = messages[0].content %}[{{ first }}]{% for m in messages|reverse %}{{ m.role ~ ':' ~ m.content }}"
    "{% endfor %}{{ bos_token }}{{ first }}"
)
# Each looks into a content in its own way; none may be laid out from a skeleton.
LOOKS = {
    "trim filter": "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}",
    "strip method": "{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}{% endfor %}",
    "truthiness": "{% for m in messages %}{% if m.content %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}",
    "startswith": "{% for m in messages %}{% if m.content.startswith('/') %}CMD{% endif %}{{ m.content }}{% endfor %}",
    "in": "{% for m in messages %}{% if 'x' in m.content %}X{% endif %}{{ m.content }}{% endfor %}",
    "length": "{% for m in messages %}{{ m.content | length }}{{ m.content }}{% endfor %}",
    "tojson": "{% for m in messages %}{{ m.content | tojson }}{% endfor %}",
    "join then trim": "{{ messages | map(attribute='content') | join('\n') | trim }}",
    "upper on a joined text": "{% for m in messages %}{{ ('> ' + m.content) | upper }}{% endfor %}",
    "format": "{% for m in messages %}{{ '%-20s' | format(m.content) }}{% endfor %}",
    "date": "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "slice": "{% for m in messages %}{{ m.content[:3] }}{{ m.content }}{% endfor %}",
    "equality": "{% for m in messages %}{% if m.content == 'hi' %}HI{% endif %}{{ m.content }}{% endfor %}",
}


def template(source: str) -> ChatTemplate:
    return ChatTemplate(source, {"bos_token": "<s>"}, where="test")


@pytest.fixture(scope="module")
def servable(tiny_servable_model: Path) -> TextTokenizer:
    return TextTokenizer.from_dir(str(tiny_servable_model))


@FUZZ
@given(messages=chats, add_generation_prompt=st.booleans())
def test_a_chat_laid_out_from_its_skeleton_is_the_template_s_render(
    servable: TextTokenizer, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    for chat_template in (servable.template, template(CHATML), template(REORDERED)):
        assert chat_template is not None
        skeletons = Skeletons.for_template(chat_template)
        assert skeletons is not None  # each writes contents as they are
        want = chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        for _ in range(2):  # the shape's first chat (rendered), then laid out
            assert skeletons.render(messages, add_generation_prompt=add_generation_prompt) == want
        assert skeletons.laid_out == 1


@pytest.mark.parametrize("name", sorted(LOOKS))
def test_a_template_that_looks_into_a_content_gets_no_skeletons(name: str) -> None:
    assert Skeletons.for_template(template(LOOKS[name])) is None


def test_a_shape_the_template_looks_into_is_rendered_by_it_and_others_are_laid_out() -> None:
    # Past the fourth message (deeper than any probe), an assistant's content is trimmed: that shape has no skeleton.
    source = (
        "{% for m in messages %}{% if m.role == 'assistant' and loop.index > 4 %}[{{ m.content | trim }}]"
        "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
    )
    chat_template = template(source)
    skeletons = Skeletons.for_template(chat_template)
    assert skeletons is not None
    roles = ["user", "assistant"] * 3
    long_chat = [{"role": role, "content": f"  turn {i}  "} for i, role in enumerate(roles)]
    for _ in range(3):
        assert skeletons.render(long_chat) == chat_template.render(long_chat)
        assert skeletons.render(long_chat[:2]) == chat_template.render(long_chat[:2])
    assert skeletons.laid_out == 2  # only the short chat, on its second and third reading
    assert skeletons.size() == 2


def test_a_template_that_rewrites_contents_only_for_some_text_is_caught_by_the_check() -> None:
    # No method on the content, but a filter on a text joined from it: spaces at the ends show it.
    source = "{% for m in messages %}{{ ([m.role, m.content] | join(':')) | trim }};{% endfor %}"
    assert Skeletons.for_template(template(source)) is None


def test_shapes_are_bounded_and_the_rest_rendered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(skeleton, "MAX_SHAPES", 1)
    chat_template = template(CHATML)
    skeletons = Skeletons.for_template(chat_template)
    assert skeletons is not None
    one, two = (
        [{"role": "user", "content": "a"}],
        [{"role": "system", "content": "s"}, {"role": "user", "content": "b"}],
    )
    for chat in (one, two, one, two):
        assert skeletons.render(chat) == chat_template.render(chat)
    assert skeletons.size() == 1
    assert skeletons.laid_out == 1


def test_a_template_s_refusal_is_its_own() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    skeletons = Skeletons.for_template(template(source))
    assert skeletons is not None  # the probes with a system role are refused, the others pass
    for _ in range(2):
        with pytest.raises(RequestError, match="no system role"):
            skeletons.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])
    assert skeletons.render([{"role": "user", "content": "y"}]) == "y"
