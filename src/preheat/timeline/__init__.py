"""``preheat timeline``: a recorded cold start (``preheat.core.timeline``) as a report. ``report``: the waterfall, idle
accelerator time and cost, text table (pure); ``svg``: inline-SVG HTML; ``plot``: ``--plot`` to .html or .png."""
