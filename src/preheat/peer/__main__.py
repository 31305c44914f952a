"""``python -m preheat.peer DIR``: a seed peer (see ``preheat.peer.node.main``)."""

import sys

from preheat.peer.node import main

sys.exit(main())
