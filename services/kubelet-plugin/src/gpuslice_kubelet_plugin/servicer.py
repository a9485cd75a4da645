"""The driver's side of the DRA calls (``gpuslice_draplugin.Plugin``): each call is one call
into the device state, nothing else.

The helper (``gpuslice_draplugin``) serves the kubelet's DRA v1 and v1beta1 services and turns
these per-claim answers into the wire's: one bad claim is an error in its own answer, never a
failed call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuslice_draplugin import ClaimRef
from gpuslice_kubelet_plugin.claims import ClaimError
from gpuslice_kubelet_plugin.state import DeviceState, Outcome


class DraServicer:
    def __init__(self, state: DeviceState) -> None:
        self.state = state

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, Outcome]:
        return self.state.prepare(list(claims))

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimError | None]:
        return self.state.unprepare(list(claims))
