"""`preheat analyze` and `preheat simulate` end to end, on the shipped sample traces and a tiny real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from preheat.cli.main import main

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "traces"
TIMELINE = str(EXAMPLES / "coldstart-8b.json")


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, object]:
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert isinstance(doc, dict)
    return doc


def test_analyze_tokenizes_chats_and_measures_prefill_on_the_model(
    tiny_servable_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _json(
        capsys,
        [
            "analyze",
            str(EXAMPLES / "rag.jsonl"),
            "--model",
            str(tiny_servable_model),
            "--l1",
            "256KiB",
            "--l2",
            "2MiB",
            "--json",
        ],
    )
    assert doc["requests"] == 150
    ratio, prefill = doc["shared_prefix_ratio"], doc["prefill_ms_per_token"]
    assert isinstance(ratio, float)
    assert isinstance(prefill, (int, float))
    assert 0.4 < ratio < 1.0  # shared system prompts and documents
    assert prefill > 0
    configured = doc["configured"]
    assert isinstance(configured, dict)
    shared = doc["infinite_shared"]
    assert isinstance(shared, dict)
    for routing in ("round_robin", "prefix_aware"):
        assert 0 < configured[routing]["hit_rate"] <= shared["hit_rate"]
    assert configured["l1_chunks"] > 0
    assert configured["l2_chunks"] > configured["l1_chunks"]
    recommendation = doc["recommendation"]
    assert isinstance(recommendation, list)
    assert recommendation
    assert "shared L2" in recommendation[0]


def test_analyze_draws_hit_rate_against_cache_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hits.png"
    argv = ["analyze", str(EXAMPLES / "mooncake.jsonl"), "--kv-bytes-per-token", "131072", "--plot", str(out)]
    assert main([*argv, "--prefill-ms-per-token", "0.1", "--replicas", "8"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "shared prefix ratio" in text
    assert "prefix-aware" in text


def test_analyze_skips_bad_lines_and_reports_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"token_ids": [1, 2, 3, 4, 5]}\n{"token_ids": "x"}\n{"token_ids": [1, 2, 3, 4, 6]}\n')
    doc = _json(capsys, ["analyze", str(trace), "--kv-chunk-tokens", "2", "--json"])
    assert doc["requests"] == 2
    assert doc["problems"] == {
        "skipped_lines": 1,
        "first_skipped": [{"line": 2, "error": "'token_ids' must be a list of integers in 0..2**32-1"}],
        "unknown_columns": [],
    }
    assert doc["shared_prefix_ratio"] == pytest.approx(4 / 10)


def test_analyze_strict_fails_on_the_first_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"token_ids": [1]}\n\n{"prompt": 5}\n')
    assert main(["analyze", str(trace), "--strict"]) == 1
    assert f"{trace}:3: 'prompt' must be a string" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--l1", "1GiB"], "--kv-bytes-per-token"),
        (["--replicas", "0"], "--replicas"),
        (["--l1", "lots", "--kv-bytes-per-token", "8"], "cannot parse size"),
        (["--l1", "1MiB", "--kv-bytes-per-token", "131072"], "holds no chunk"),
    ],
)
def test_analyze_refuses_bad_flags(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", str(EXAMPLES / "mooncake.jsonl"), *argv]) == 1
    assert message in capsys.readouterr().err


def test_analyze_text_prompts_need_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"prompt": "hello"}\n')
    assert main(["analyze", str(trace)]) == 1
    assert "line 1: a text prompt needs a tokenizer" in capsys.readouterr().err


def test_simulate_reports_each_policy_with_its_frontier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "frontier.png"
    argv = ["simulate", str(EXAMPLES / "burstgpt-hour.csv"), "--cold-start", TIMELINE, "--json"]
    doc = _json(capsys, [*argv, "--policy", "scale-to-zero", "--policy", "warm-replicas:min=2", "--plot", str(out)])
    policies = doc["policies"]
    assert isinstance(policies, list)
    assert [p["policy"] for p in policies] == ["scale-to-zero", "warm-replicas:min=2"]
    s2z, warm = policies
    assert warm["ttft_p99_s"] < s2z["ttft_p99_s"]  # bursts from zero wait for cold starts
    assert warm["on_frontier"]
    assert s2z["cold_starts"] > 0
    assert warm["settings"]["min_replicas"] == 2
    assert doc["trace"]["requests"] == s2z["requests"] > 100  # type: ignore[index]
    assert doc["cold_start_phases_s"]["image"] == 40.0  # type: ignore[index]  # the timeline's platform stage
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_simulate_reads_the_azure_csv_and_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", str(EXAMPLES / "azure-day.csv"), "--cold-start", TIMELINE]
    assert main([*argv, "--policy", "node-cache", "--gpu-cost-per-hour", "4"]) == 0
    out = capsys.readouterr().out
    assert "node-cache" in out
    assert "TTFT p99" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--policy", "fast:turbo"], "unknown setting 'turbo'"),
        (["--spot-discount", "1.5"], "--spot-discount"),
        (["--cold-start", "missing.json"], "missing.json"),
        (["--slots", "0"], "--slots"),
    ],
)
def test_simulate_refuses_bad_input(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["simulate", str(EXAMPLES / "burstgpt-hour.csv"), "--cold-start", TIMELINE]
    assert main([*base, *argv]) == 1
    assert message in capsys.readouterr().err


def test_analyze_mixes_text_chats_and_token_ids_in_one_trace(
    tiny_servable_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = "the same long shared instructions for every request " * 20
    lines = [
        {"prompt": text + "first"},
        {"token_ids": list(range(600))},
        {"messages": [{"role": "user", "content": text + "second"}]},
        {"prompt": text + "third"},
    ]
    trace = tmp_path / "mixed.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["analyze", str(trace), "--model", str(tiny_servable_model), "--kv-chunk-tokens", "16"]
    doc = _json(capsys, [*argv, "--prefill-ms-per-token", "1", "--json"])
    assert doc["requests"] == 4
    reuse = doc["reusable_prefix_tokens"]
    assert isinstance(reuse, dict)
    assert reuse["max"] > 0  # the third prompt repeats the first one's long prefix
