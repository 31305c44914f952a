"""``preheat timeline``: a recorded cold start (``preheat.core.timeline``) as a report. ``waterfall``: the waterfall,
idle accelerator time and cost, text table (pure); ``merge``: per-process records of one start (vLLM's processes)
as one timeline (pure); ``fetch``: the timeline JSON from a server, a file or a directory of records; ``svg``:
inline-SVG HTML; ``plot``: ``--plot`` to .html or .png."""
