"""``python -m gpuslice_device_plugin`` runs the service (same as ``gpuslice-device-plugin``)."""

import sys

from gpuslice_device_plugin.cli import main

sys.exit(main())
