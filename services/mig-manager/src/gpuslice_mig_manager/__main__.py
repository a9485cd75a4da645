"""``python -m gpuslice_mig_manager`` runs the service (same as ``gpuslice-mig-manager``)."""

import sys

from gpuslice_mig_manager.cli import main

sys.exit(main())
