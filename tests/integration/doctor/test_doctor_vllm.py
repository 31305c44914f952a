"""``preheat doctor URL`` on a replica that speaks vLLM (``preheat.testing.vllmsleep``, a real process on 127.0.0.1):
read through vLLM's own metrics, and told asleep by vLLM's ``/is_sleeping`` where its ``/health`` says 200. A real
vLLM's start timeline and metrics are diagnosed in tests/engines/test_vllm_signals.py."""

from __future__ import annotations

from preheat.doctor.check import DoctorOptions
from preheat.doctor.run import run_doctor
from preheat.testing.vllmsleep import VLLMSleepDouble
from serving import Client


def test_a_vllm_replica_is_read_from_its_own_metrics_and_said_asleep() -> None:
    with VLLMSleepDouble() as double:
        for _ in range(3):
            assert Client(double.url).post("/v1/completions", {"prompt": "x"}).status == 200
        options = DoctorOptions(url=double.url, io=False, gpu=False)
        found = {f.id: f for f in run_doctor(options).findings}
        assert found["replica.healthy"].severity == "ok"
        assert found["kv.prefix_cache"].evidence["hit_rates"] == {"gpu": 0.5}  # 15 of 30 prompt tokens
        assert found["kv.prefix_cache"].evidence["queue"] == {"running": 0, "waiting": 0}
        assert "kv.l2_would_pay" in found  # half of the prompt tokens reused: past the 40% an L2 pays from
        Client(double.url).post("/sleep?level=1", {})
        asleep = {f.id: f for f in run_doctor(options).findings}
        assert asleep["replica.not_ready"].evidence["is_sleeping"] is True
        assert "replica.healthy" not in asleep
