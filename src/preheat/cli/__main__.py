"""``python -m preheat.cli``: the same as the ``preheat`` command."""

from preheat.cli.main import main

raise SystemExit(main())
