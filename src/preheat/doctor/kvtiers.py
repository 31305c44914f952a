"""KV tier hit rates from a replica's /metrics, and whether its L2 pays off. Pure: metric samples in, findings out.

A vLLM or SGLang replica is read through ``preheat.dashboard.signals`` (``analyze_engine``): its prefix cache's hit
rate, how full its KV cache is, and whether an L2 would pay, by the same rule.

The L2 rule follows ``preheat analyze`` (docs/plan.md): a shared L2 pays off from ~40% of prompt tokens served from
cache (``SHARED_L2_THRESHOLD``), and only if reading a token's KV from it is cheaper than recomputing it; an L2 read
is priced at the rate the replica measured (``bytes_read / read_seconds``) against the seed's ``L2_GBPS``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preheat.dashboard.signals import Signals
from preheat.doctor.findings import Finding
from preheat.plan.analyze import L2_GBPS, SHARED_L2_THRESHOLD

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
MIN_LOOKUPS = 20  # fewer lookups than this say nothing about a hit rate


def parse_metrics(text: str, *, max_lines: int = 100_000) -> Samples:
    """Prometheus text exposition as ``{(name, sorted labels): value}`` (comments and bad lines skipped)."""
    samples: Samples = {}
    for line in text.splitlines()[:max_lines]:
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples[(name, tuple(sorted(_LABEL.findall(labels or ""))))] = number
    return samples


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    return {dict(labels).get(label, ""): value for (n, labels), value in samples.items() if n == name}


def total(samples: Samples, name: str) -> float | None:
    values = [value for (n, _labels), value in samples.items() if n == name]
    return sum(values) if values else None


def analyze_kv(samples: Samples, *, where: str) -> list[Finding]:
    """Hit rate per tier, the share of prompt tokens served from cache, and whether L2 is worth keeping."""
    hits = by_label(samples, "preheat_kv_hits_total", "tier")
    misses = by_label(samples, "preheat_kv_misses_total", "tier")
    prompt = total(samples, "preheat_prompt_tokens_total")
    cached = total(samples, "preheat_prompt_tokens_cached_total")
    share = cached / prompt if prompt and cached is not None else None
    if not hits and not misses:
        return [Finding("kv.none", "kv", "info", "the replica has no KV tiers", evidence={"source": where,
                        "cached_token_share": share},
                        fix="With shared prefixes (system prompts, RAG, multi-turn), `--kv-l1 SIZE` and a shared "
                        "`--kv-l2 URL` serve them from cache; `preheat analyze` estimates the gain from a trace.")]
    findings = []
    rates: dict[str, float | None] = {}
    for tier in sorted(set(hits) | set(misses)):
        lookups = hits.get(tier, 0.0) + misses.get(tier, 0.0)
        rates[tier] = hits.get(tier, 0.0) / lookups if lookups else None
    bytes_read = by_label(samples, "preheat_kv_bytes_read_total", "tier")
    read_s = by_label(samples, "preheat_kv_read_seconds_total", "tier")
    up = by_label(samples, "preheat_kv_tier_up", "tier")
    evidence: dict[str, object] = {
        "source": where, "hit_rates": {t: None if r is None else round(r, 3) for t, r in rates.items()},
        "lookups": {t: hits.get(t, 0.0) + misses.get(t, 0.0) for t in rates},
        "cached_token_share": None if share is None else round(share, 3),
    }
    down = sorted(tier for tier, value in up.items() if value == 0)
    if down:
        findings.append(Finding("kv.tier_down", "kv", "warn", f"KV tier {', '.join(down)} is down: requests recompute",
                                evidence={**evidence, "down": down},
                                fix="Check the L2 URL (Redis reachable, fs:// mounted); the replica retries it."))
    rate_text = ", ".join(f"{t} {r:.0%}" for t, r in rates.items() if r is not None) or "no lookups yet"
    findings.append(Finding("kv.hit_rates", "kv", "ok", f"KV hit rates: {rate_text}", evidence=evidence))
    if "l2" in rates:
        l2 = L2Numbers(rates["l2"], hits.get("l2", 0.0) + misses.get("l2", 0.0), bytes_read.get("l2", 0.0),
                       read_s.get("l2", 0.0), share)
        findings.append(_l2_verdict(l2, evidence))
    return findings


@dataclass(frozen=True)
class L2Numbers:
    rate: float | None  # hits over lookups that reached L2
    lookups: float
    bytes_read: float
    read_seconds: float
    cached_share: float | None  # of all prompt tokens, served from any tier

    @property
    def gbps(self) -> float | None:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds > 0 else None


def _l2_verdict(numbers: L2Numbers, evidence: dict[str, object]) -> Finding:
    rate, lookups, gbps, share = numbers.rate, numbers.lookups, numbers.gbps, numbers.cached_share
    l2 = {**evidence, "l2_read_gbps": None if gbps is None else round(gbps, 3), "assumed_l2_gbps": round(L2_GBPS, 3),
          "shared_l2_threshold": SHARED_L2_THRESHOLD}
    if lookups < MIN_LOOKUPS or rate is None:
        return Finding("kv.l2_unproven", "kv", "info", f"too few L2 lookups ({lookups:.0f}) to judge it", evidence=l2)
    if gbps is not None and gbps < L2_GBPS / 4:
        return Finding("kv.l2_slow", "kv", "warn", f"L2 reads at {gbps:.2f} GB/s, under a quarter of the "
                       f"{L2_GBPS:.1f} GB/s an L2 needs to beat recomputing", evidence=l2,
                       fix="Move L2 closer (same zone, Redis on a fast network, fs:// on local NVMe) or drop it: "
                       "reading slower than prefill costs time on every hit.")
    if rate < 0.05 and (share is None or share < SHARED_L2_THRESHOLD):
        return Finding("kv.l2_idle", "kv", "warn", f"L2 answers {rate:.0%} of the lookups that reach it",
                       evidence=l2,
                       fix="Little prefix sharing reaches L2: route by prefix (`preheat router --policy prefix` or "
                       "`kv`), or drop L2 and spend on cold start; `preheat analyze` on a trace shows what a tier "
                       "would serve.")
    return Finding("kv.l2_worth", "kv", "ok", f"L2 answers {rate:.0%} of the lookups that reach it", evidence=l2)


FULL_KV = 0.9  # of the KV cache in use: past this, evictions may hide reuse that an L2 would keep


def analyze_engine(signals: Signals, *, where: str) -> list[Finding]:
    """An engine replica's (vLLM, SGLang) prefix cache: its hit rate, and whether an L2 would pay. The rule is
    ``preheat analyze``'s: reuse at or past ``SHARED_L2_THRESHOLD`` of prompt tokens is what a shared L2 serves
    across replicas and after evictions; an engine that has one already (vLLM's ``external`` tier: a KV connector
    such as LMCache) is judged by what that tier answers."""
    gpu = signals.tiers.get("gpu")
    rate = gpu.hit_rate if gpu is not None else None
    lookups = gpu.hits + gpu.misses if gpu is not None else 0.0
    share = signals.cached_share if signals.cached_share is not None else rate
    evidence: dict[str, object] = {
        "source": where, "engine": signals.engine,
        "hit_rates": {t: None if v.hit_rate is None else round(v.hit_rate, 3) for t, v in signals.tiers.items()},
        "lookups": {t: v.hits + v.misses for t, v in signals.tiers.items()},
        "cached_token_share": None if share is None else round(share, 3),
        "kv_usage": None if signals.kv_usage is None else round(signals.kv_usage, 3),
        "queue": {"running": signals.running, "waiting": signals.waiting},
        "shared_l2_threshold": SHARED_L2_THRESHOLD,
    }
    if gpu is None:
        return [Finding("kv.engine_unknown", "kv", "info", f"the {signals.engine} replica exports no prefix-cache "
                        "counters", evidence=evidence)]
    rate_text = "no lookups yet" if rate is None else f"{rate:.0%} of {lookups:.0f} prompt tokens"
    findings = [Finding("kv.prefix_cache", "kv", "ok", f"{signals.engine} prefix cache hits {rate_text}",
                        evidence=evidence)]
    external = signals.tiers.get("external")
    if external is not None:
        l2 = L2Numbers(external.hit_rate, external.hits + external.misses, 0.0, 0.0, share)
        findings.append(_l2_verdict(l2, evidence))
        return findings
    findings.append(_would_l2_pay(rate, lookups, share, signals.kv_usage, evidence))
    return findings


def _would_l2_pay(
    rate: float | None, lookups: float, share: float | None, usage: float | None, evidence: dict[str, object]
) -> Finding:
    if lookups < MIN_LOOKUPS or rate is None or share is None:
        return Finding("kv.l2_unproven", "kv", "info", f"too few prompt tokens ({lookups:.0f}) to tell whether an "
                       "L2 would pay", evidence=evidence)
    if share >= SHARED_L2_THRESHOLD:
        return Finding("kv.l2_would_pay", "kv", "warn", f"{share:.0%} of prompt tokens are reused, past the "
                       f"{SHARED_L2_THRESHOLD:.0%} from which a shared L2 pays", evidence=evidence,
                       fix="Add a shared L2 so every replica serves what any one computed, and keeps it after the "
                       "GPU evicts it: LMCache through vLLM's KV connector (docs/integrations.md), and route by KV "
                       "(`preheat router --policy kv` with the replicas' events=).")
    if usage is not None and usage >= FULL_KV:
        return Finding("kv.l2_hidden", "kv", "info", f"{share:.0%} of prompt tokens are reused with the KV cache "
                       f"{usage:.0%} full: evictions may hide more", evidence=evidence,
                       fix="`preheat analyze` on a request trace tells what an L2 would serve.")
    return Finding("kv.l2_would_not_pay", "kv", "ok", f"{share:.0%} of prompt tokens are reused, under the "
                   f"{SHARED_L2_THRESHOLD:.0%} from which a shared L2 pays", evidence=evidence)
