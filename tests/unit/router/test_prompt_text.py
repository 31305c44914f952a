"""``prefix``'s reading of a prompt as text (router/prompts.py ``prompt_text``): a later turn starts with an earlier
one, a body routing cannot read goes by load, and a prompt of megabytes is looked at only as far as its first bytes."""

from __future__ import annotations

import json

from preheat.router.prompts import PromptReader, prompt_text

SYSTEM = {"role": "system", "content": "You answer in one line, and never more than that."}


def test_a_later_turn_of_a_chat_starts_with_the_text_of_an_earlier_one() -> None:
    first = [SYSTEM, {"role": "user", "content": "Hi"}]
    later = [*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}]
    early, late = prompt_text("chat", {"messages": first}, 10_000), prompt_text("chat", {"messages": later}, 10_000)
    assert early is not None
    assert late is not None
    assert late.startswith(early)
    assert len(late) > len(early)


def test_roles_and_message_boundaries_are_part_of_the_text() -> None:
    def text(*messages: dict[str, str]) -> bytes | None:
        return prompt_text("chat", {"messages": list(messages)}, 10_000)

    assert text({"role": "user", "content": "ab"}) != text({"role": "system", "content": "ab"})
    assert text({"role": "user", "content": "ab"}) != text(
        {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    )


def test_completion_prompts_as_text_a_batch_of_one_or_token_ids() -> None:
    assert prompt_text("completion", {"prompt": ["Once upon"]}, 100) == b"Once upon"  # the OpenAI client's prompt=[...]
    ids = [prompt_text("completion", {"prompt": p}, 100) for p in ([1, 2, 3], [1, 2, 34])]
    assert ids[0] is not None
    assert ids[1] is not None
    assert not ids[1].startswith(ids[0])  # each id ends with its comma: 3 is not the start of 34


def test_completion_prompts_as_text_or_token_ids() -> None:
    assert prompt_text("completion", {"prompt": "Once upon"}, 100) == b"Once upon"
    short, longer = (
        prompt_text("completion", {"prompt": [1, 22]}, 100),
        prompt_text("completion", {"prompt": [1, 22, 3]}, 100),
    )
    assert short is not None
    assert longer is not None
    assert longer.startswith(short)


def test_a_body_routing_cannot_read_has_no_text() -> None:
    unreadable: list[tuple[str, dict[str, object]]] = [
        ("chat", {"messages": "hi"}),
        ("chat", {"messages": ["hi"]}),
        ("chat", {}),
        ("completion", {"prompt": {"text": "hi"}}),
        ("completion", {"prompt": [1, "2"]}),
        ("completion", {"prompt": [True]}),
        ("completion", {"prompt": ["a", "b"]}),  # a batch: the replica refuses it
    ]
    for kind, body in unreadable:
        assert prompt_text(kind, body, 100) is None, body


def test_only_the_first_bytes_of_a_huge_prompt_are_read_and_a_lone_surrogate_is_still_text() -> None:
    huge = prompt_text("completion", {"prompt": "é" * 1_000_000}, 1001)
    assert huge == ("é" * 500).encode() + b"\xc3"  # bytes, not characters: the last one cut in two
    assert prompt_text("completion", json.loads('{"prompt": "a\\ud800b"}'), 100) == b"a\xed\xa0\x80b"


def test_a_reader_for_prefix_needs_no_model_and_reads_the_session_beside_the_text() -> None:
    reader = PromptReader.from_model(None, 8, text=True)
    body = json.dumps({"model": "m", "user": "ann", "messages": [SYSTEM]}).encode()
    request = reader.read("/v1/chat/completions", body, None)
    assert request.session == "ann"
    assert request.token_ids is None
    assert request.text == prompt_text("chat", {"messages": [SYSTEM]}, 32)  # 8 tokens' worth: 32 bytes
    assert request.text is not None
    assert len(request.text) == 32
    assert reader.read("/v1/chat/completions", b"{not json", None).text is None


def test_no_more_of_a_body_is_looked_at_than_the_bytes_that_count() -> None:
    # What lies past the bound is never read: not even checked (a bad element there does not spoil the prompt).
    ids = prompt_text("completion", {"prompt": [7] * 1_000 + ["not an id"]}, 100)
    assert ids == b"7," * 50
    chat = [SYSTEM] + [{"role": "user", "content": "x" * 100}] * 1_000 + ["not a message"]
    text = prompt_text("chat", {"messages": chat}, 300)
    assert text is not None
    assert len(text) == 300
