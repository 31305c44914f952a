"""``preheat timeline``: a recorded cold start (``preheat.core.timeline``) as a report. ``waterfall``: the waterfall,
idle accelerator time and cost, text table (pure); ``fetch``: the timeline JSON from a server or a file; ``svg``:
inline-SVG HTML; ``plot``: ``--plot`` to .html or .png."""
