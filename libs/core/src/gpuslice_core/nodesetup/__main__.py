"""``python -m gpuslice_core.nodesetup``: the same as the ``gpuslice-node-setup`` script."""

import sys

from gpuslice_core.nodesetup.cli import main

sys.exit(main())
