"""``kubectl gpuslice``: the cluster view of gpuslice's GPUs from a user's terminal.

The application (flags, output, the controller's view API client); the view itself is the
library ``gpuslice_view``. See docs/cluster-view.md.
"""

from gpuslice_view import __version__

__all__ = ["__version__"]
