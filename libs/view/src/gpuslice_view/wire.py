"""The controller's view API as both ends name it: the controller serves it
(``gpuslice_controller.view.api``) and ``kubectl gpuslice`` calls it
(``gpuslice_kubectl.remote``)."""

from __future__ import annotations

#: Where ``kubectl gpuslice`` puts the user's bearer token for the controller to review (the
#: API server's proxy strips ``Authorization``).
TOKEN_HEADER = "X-Gpuslice-Authorization"  # noqa: S105 - a header name
