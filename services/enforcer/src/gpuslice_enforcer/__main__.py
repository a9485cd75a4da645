"""``python -m gpuslice_enforcer`` runs the service (same as ``gpuslice-enforcer``)."""

import sys

from gpuslice_enforcer.cli import main

sys.exit(main())
