"""``python -m preheat``: the same as the ``preheat`` command (used by the demo and the tests to start servers)."""

from preheat.cli.main import main

raise SystemExit(main())
