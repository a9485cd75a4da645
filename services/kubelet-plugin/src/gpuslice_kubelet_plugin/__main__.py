"""``python -m gpuslice_kubelet_plugin`` runs the plugin (same as the console script)."""

import sys

from gpuslice_kubelet_plugin.cli import main

sys.exit(main())
