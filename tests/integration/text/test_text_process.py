"""The tokenizer built in a process of its own while torch imports (preheat.text.process): the same text as an
in-process tokenizer, every failure either reported like one or absorbed by building the tokenizer here, and no
process left. Each case runs in a fresh interpreter, as ``preheat serve`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from preheat.testing.synthetic import make_tiny_servable_model

SCRIPT = r"""
import json, os, signal, sys, time
from preheat.text.process import ProcessTokenizer, TokenizerProcess
from preheat.text.tokenizer import TextTokenizer
from preheat.core.timeline import Timeline

case, root = sys.argv[1], sys.argv[2]
process = TokenizerProcess.start()
assert process is not None
timeline = Timeline()
future = process.build(root, [], timeline)
out = {"case": case}
try:
    tok = future.result(timeout=60)
except Exception as exc:
    out.update(error=type(exc).__name__, message=str(exc), path=getattr(exc, "path", None))
    print(json.dumps(out))
    sys.exit(0)
out["own_process"] = isinstance(tok, ProcessTokenizer) and not tok.local
out["stage"] = next(s.detail for s in timeline.stages() if s.name == "tokenizer")
messages = [{"role": "user", "content": "Héllo, wörld! 🙂 What is 2+2?"}]
text = "The quick brown fox 🦊 jumps; naïve café."

def sample(t):
    ids = t.encode(text)
    stream = t.detokenizer([1, 2])
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    got = {"ids": ids, "decoded": t.decode(ids), "stream": "".join(pieces),
           "plain": t.encode(text, add_special_tokens=False),
           "eos": sorted(t.eos_ids), "special": t.special_tokens, "vocab": t.vocab_size}
    try:
        got["chat"] = t.render_chat(messages)
        got["chat_ids"] = t.encode_chat(messages)
    except Exception as exc:
        got["chat_error"] = [type(exc).__name__, str(exc)]
    return got

if case == "killed":
    os.kill(process.pid, signal.SIGKILL)
    os.waitpid(process.pid, 0)
out["remote"] = sample(tok)
out["local_after"] = tok.local
out["reference"] = sample(TextTokenizer.from_dir(root))
if case == "settle":
    tok.settle(idle_s=0.05).join(30)
    out["settled"] = tok.local
    out["after_settle"] = sample(tok)
    deadline = time.monotonic() + 10
    gone = False
    while time.monotonic() < deadline and not gone:
        try:
            os.kill(process.pid, 0)
            time.sleep(0.02)
        except ProcessLookupError:
            gone = True
    out["child_gone"] = gone
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_servable_model(tmp_path_factory.mktemp("tokenizer") / "tiny")


def run_case(case: str, root: Path, **env: str) -> dict[str, Any]:  # Any: the script's JSON
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, case, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])  # Any: JSON
    return result


def test_the_tokenizer_process_gives_the_same_ids_and_text_as_one_built_here(model: Path) -> None:
    got = run_case("same", model)
    assert got["own_process"] is True
    assert got["stage"]["process"] == "own"
    assert got["remote"] == got["reference"]
    assert got["remote"]["chat_ids"]
    assert "<|im_start|>" in got["remote"]["chat"]
    assert got["local_after"] is False  # nothing switched before the server asked


def test_once_settled_the_server_tokenizes_itself_and_the_child_is_gone(model: Path) -> None:
    got = run_case("settle", model)
    assert got["settled"] is True
    assert got["after_settle"] == got["reference"]
    assert got["child_gone"] is True


def test_a_dead_tokenizer_process_is_replaced_by_a_tokenizer_built_here(model: Path) -> None:
    got = run_case("killed", model)
    assert got["remote"] == got["reference"]
    assert got["local_after"] is True


def test_a_broken_tokenizer_file_fails_the_load_naming_the_file(model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(model, broken)
    (broken / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7')
    got = run_case("same", broken)
    assert got["error"] == "CheckpointError"
    assert got["path"] == str(broken / "tokenizer.json")
    assert "cannot read this tokenizer" in got["message"]


def test_a_model_without_chat_template_refuses_chats_as_an_in_process_tokenizer_does(
    model: Path, tmp_path: Path
) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(model, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    got = run_case("same", plain)
    assert got["remote"]["chat_error"][0] == "RequestError"
    assert got["remote"]["chat_error"] == got["reference"]["chat_error"]
    assert got["remote"]["ids"] == got["reference"]["ids"]


def test_the_variable_keeps_the_tokenizer_in_the_servers_process() -> None:
    code = "from preheat.text.process import TokenizerProcess; p = TokenizerProcess.start(); print(p is not None)"
    for value, want in (("1", "True"), ("0", "False"), ("off", "False")):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env={**os.environ, "PREHEAT_TOKENIZER_PROCESS": value},
        )
        assert done.stdout.strip() == want
