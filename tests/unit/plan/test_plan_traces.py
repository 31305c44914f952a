"""Trace readers: every supported format, line-numbered errors, --strict, unknown columns, shipped samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from preheat.core.errors import PlanError
from preheat.plan.traces import (
    MOONCAKE_BLOCK,
    Problems,
    Request,
    detect_format,
    fast_token_ids,
    iter_requests,
    read_arrays,
    with_tokens,
)
from strategies import token_ids

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "traces"


def _jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_preheat_jsonl_reads_token_ids_prompts_and_chats(tmp_path: Path) -> None:
    trace = _jsonl(
        tmp_path / "t.jsonl",
        [
            {"token_ids": [1, 2, 3], "timestamp": 1.5, "output_tokens": 7},
            {"prompt": "hello world!", "timestamp": 2},
            {"messages": [{"role": "user", "content": "hi there"}]},
        ],
    )
    got = list(iter_requests(str(trace), Problems(str(trace))))
    assert got[0].token_ids is not None
    assert list(got[0].token_ids) == [1, 2, 3]
    assert (got[0].line, got[0].timestamp, got[0].input_tokens, got[0].output_tokens) == (1, 1.5, 3, 7)
    assert got[1].text == "hello world!"
    assert got[1].token_ids is None
    assert got[1].input_tokens == 3
    assert got[2].messages == [{"role": "user", "content": "hi there"}]
    assert got[2].timestamp is None


def test_mooncake_lines_become_chained_stand_in_tokens(tmp_path: Path) -> None:
    trace = _jsonl(
        tmp_path / "m.jsonl",
        [
            {"timestamp": 1500, "input_length": 600, "output_length": 9, "hash_ids": [3, 4]},
            {"timestamp": 2500, "input_length": 512, "output_length": 1, "hash_ids": [3]},
        ],
    )
    first, second = iter_requests(str(trace), Problems(str(trace)))
    assert first.timestamp == 1.5
    assert first.input_tokens == 600
    assert first.output_tokens == 9
    assert first.token_ids is not None
    assert len(first.token_ids) == 600
    assert second.token_ids == first.token_ids[:MOONCAKE_BLOCK]  # same hash id, same tokens


def test_azure_csv_times_are_seconds_from_the_first_row(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.1805900,396,109\n",
        encoding="utf-8",
    )
    assert detect_format(str(trace)) == "azure"
    arrays = read_arrays(str(trace), Problems(str(trace)))
    assert arrays.arrival.tolist() == pytest.approx([0.0, 3.5])
    assert arrays.input_tokens.tolist() == [374, 396]
    assert arrays.output_tokens.tolist() == [44, 109]


def test_burstgpt_csv_is_read_and_extra_columns_are_named(tmp_path: Path) -> None:
    trace = tmp_path / "burst.csv"
    trace.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type,Region\n"
        "5.0,ChatGPT,472,18,490,Conversation log,eu\n"
        "7.25,GPT-4,1087,230,1317,API log,us\n",
        encoding="utf-8",
    )
    problems = Problems(str(trace))
    arrays = read_arrays(str(trace), problems)
    assert arrays.arrival.tolist() == [0.0, 2.25]
    assert arrays.input_tokens.tolist() == [472, 1087]
    assert problems.unknown_columns == {"Region"}
    assert any("Region" in note for note in problems.summary())


def test_malformed_lines_are_skipped_with_their_line_numbers(tmp_path: Path) -> None:
    trace = _jsonl(
        tmp_path / "bad.jsonl",
        [
            {"token_ids": [1, 2], "timestamp": 0},
            "{not json",
            {"token_ids": [1, -2]},
            {"prompt": "a", "token_ids": [1]},
            [1, 2],
            {"token_ids": [5], "timestamp": 1, "colour": "red"},
        ],
    )
    problems = Problems(str(trace))
    got = list(iter_requests(str(trace), problems))
    assert [r.line for r in got] == [1, 6]
    assert [line for line, _ in problems.skipped] == [2, 3, 4, 5]
    assert "not valid JSON" in problems.skipped[0][1]
    assert "exactly one of" in problems.skipped[2][1]
    assert problems.unknown_columns == {"colour"}
    assert problems.summary()[0].startswith(f"{trace}:2: skipped")


def test_strict_stops_at_the_first_malformed_line(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,10,2\n2.0,ten,2\n", encoding="utf-8")
    with pytest.raises(PlanError, match=rf"{trace}:3: .*ten"):
        list(iter_requests(str(trace), Problems(str(trace), strict=True)))


def test_simulation_needs_timestamps(tmp_path: Path) -> None:
    trace = _jsonl(tmp_path / "t.jsonl", [{"token_ids": [1]}, {"token_ids": [2], "timestamp": 3}])
    problems = Problems(str(trace))
    assert len(read_arrays(str(trace), problems)) == 1
    assert problems.skipped == [(1, "no 'timestamp': the simulator needs arrival times")]


def test_an_unknown_csv_header_is_refused_naming_the_expected_columns(tmp_path: Path) -> None:
    trace = tmp_path / "x.csv"
    trace.write_text("time,tokens\n1,2\n", encoding="utf-8")
    with pytest.raises(PlanError, match="ContextTokens"):
        detect_format(str(trace))


def test_text_prompts_are_tokenized_in_batches_in_file_order() -> None:
    requests = [Request(i, None, 0, 0, text="ab" * i) for i in range(1, 6)]
    requests.insert(1, Request(99, None, 2, 0, token_ids=[7, 7]))  # waits behind line 1's text, is not re-encoded
    batches: list[list[int]] = []

    def encode(batch: list[Request]) -> list[list[int]]:
        batches.append([r.line for r in batch])
        return [[len(r.text or "")] for r in batch]

    got = list(with_tokens(requests, encode, batch=2))
    assert [r.line for r in got] == [1, 99, 2, 3, 4, 5]
    assert [list(r.token_ids or []) for r in got] == [[2], [7, 7], [4], [6], [8], [10]]
    assert batches == [[1], [2, 3], [4, 5]]


def test_text_without_a_tokenizer_names_the_line() -> None:
    with pytest.raises(PlanError, match=r"line 4: .*--model"):
        list(with_tokens([Request(3, None, 1, 0, token_ids=[1]), Request(4, None, 1, 0, text="hi")], None))


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("rag.jsonl", "jsonl"),
        ("mooncake.jsonl", "jsonl"),
        ("azure-day.csv", "azure"),
        ("burstgpt-hour.csv", "burstgpt"),
    ],
)
def test_shipped_samples_parse_cleanly(name: str, kind: str) -> None:
    path = str(EXAMPLES / name)
    assert detect_format(path) == kind
    problems = Problems(path, strict=True)
    assert sum(1 for _ in iter_requests(path, problems)) > 100
    assert not problems.unknown_columns


def test_shipped_samples_stay_small() -> None:
    assert sum(p.stat().st_size for p in EXAMPLES.iterdir()) < 1_000_000


_ids = token_ids(max_size=40)
_odd_ids = st.lists(st.one_of(st.integers(-5, 2**33), st.floats(allow_nan=False), st.booleans(), st.text()), max_size=5)


@settings(max_examples=150, deadline=None)
@given(
    st.one_of(_ids, _odd_ids),
    st.sampled_from([", ", ",", " , ", ",\t"]),
    st.dictionaries(st.sampled_from(["timestamp", "prompt", "note"]), st.one_of(st.integers(), st.text()), max_size=3),
)
def test_the_fast_token_ids_parser_agrees_with_json(
    ids: list[object], separator: str, extra: dict[str, object]
) -> None:
    body = separator.join(json.dumps(t) for t in ids)
    line = json.dumps({**extra, "token_ids": "X"}).replace('"X"', f"[{body}]")
    fast = fast_token_ids(line)
    if fast is None:
        return  # the careful path takes it: nothing to compare
    slow = json.loads(line)
    assert list(fast.pop("token_ids")) == slow.pop("token_ids")  # type: ignore[call-overload]
    assert fast == slow


def test_the_fast_parser_leaves_anything_unusual_to_json() -> None:
    assert fast_token_ids('{"token_ids": [1 2]}') is None
    assert fast_token_ids('{"token_ids": [1, -2]}') is None
    assert fast_token_ids('{"token_ids": [1, 4294967296]}') is None
    assert fast_token_ids('{"prompt": "\\"token_ids\\": [1]"}') is None
    plain = fast_token_ids('{"timestamp": 1, "token_ids": [1, 2, 3]}')
    assert plain is not None
    assert list(plain["token_ids"]) == [1, 2, 3]  # type: ignore[call-overload]
    fast = fast_token_ids('{"token_ids": [], "timestamp": 2}')
    assert fast is not None
    assert list(fast["token_ids"]) == []  # type: ignore[call-overload]
