"""Planning tools: ``preheat analyze`` (is a KV cache tier worth it?) and ``preheat simulate`` (warm pools or
scale-to-zero?). Spec and formulas: docs/plan.md.

Pure cores over values (``traces`` readers aside, which read files): ``prefix`` (prefix sharing, routing, LRU tiers
over chunk keys), ``analyze`` (the report), ``coldstart`` (timeline JSON to phases), ``simulate`` (the discrete-event
fleet simulation). ``measure`` reads a checkpoint (tokenizer, KV size, a timed prefill); ``plots`` draws PNGs.
"""
