"""``python -m preheat.peer DIR``: a seed peer (see ``preheat.peer.node.main``).

The command is where the seed peer meets the compiled-artifact store (``--artifacts``): ``preheat.artifacts`` finds
and fetches artifacts through peers, so it imports ``preheat.peer``, and the rest of this package never imports it
back. A package's ``__main__`` may (tests/unit/test_architecture.py): nothing imports a command.
"""

import sys

from preheat.artifacts.store import node_store
from preheat.peer.node import main

sys.exit(main(artifacts=lambda cache_dir: node_store(cache_dir).lookup))
