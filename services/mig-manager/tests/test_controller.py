"""The label-driven controller against a recording reporter (no API server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import tenacity

from gpuslice_mig_manager.apply import LayoutState, apply_layout
from gpuslice_mig_manager.controller import Backoff, LayoutController
from gpuslice_mig_manager.kube import LABEL_CONFIG
from gpuslice_mig_manager.layouts import LayoutConfig
from gpuslice_mig_manager.manager import MigManager
from gpuslice_mig_manager.sources import ConfigMapLayouts, FileLayouts
from gpuslice_nvml.fake import FakeNvml, FakeNvmlControl
from gpuslice_testkit import core as testing

from .conftest import default_layouts_text

pytestmark = pytest.mark.timeout(30)
T = TypeVar("T")
FAST = Backoff(initial=0.02, maximum=0.2)


class Recorder:
    """Collects state labels and Events like the Node would."""

    def __init__(self) -> None:
        self.states: list[str] = []
        self.events: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()

    def set_state(self, state: str | None) -> None:
        with self._lock:
            self.states.append(state or "<removed>")

    def event(self, type_: str, reason: str, message: str) -> None:
        with self._lock:
            self.events.append((type_, reason, message))

    def reasons(self) -> list[str]:
        with self._lock:
            return [r for _, r, _ in self.events]

    @property
    def state(self) -> str | None:
        with self._lock:
            return self.states[-1] if self.states else None


def wait_for(predicate: Callable[[], T | None], what: str, timeout: float = 15) -> T:
    return testing.wait_for(predicate, timeout, what, interval=0.01, max_interval=0.2)


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def controller(
    manager: MigManager, layouts_file: Path, recorder: Recorder
) -> Iterator[LayoutController]:
    c = LayoutController(manager, FileLayouts(layouts_file), recorder, backoff=FAST)
    c.start()
    yield c
    c.stop()


def test_label_goes_pending_then_success(
    fake: FakeNvml, controller: LayoutController, recorder: Recorder
) -> None:
    controller.on_labels({LABEL_CONFIG: "all-1g.5gb", "other": "x"})

    wait_for(lambda: recorder.state == "success", "state success")
    assert recorder.states == ["pending", "success"]
    assert recorder.reasons() == ["MigConfigApplied"]
    assert "56 instances created" in recorder.events[0][2]
    assert sum(len(fake.gpu_instances(i)) for i in range(8)) == 56

    controller.on_labels({LABEL_CONFIG: "all-1g.5gb", "other": "y"})  # same value: nothing
    controller.on_labels({"other": "y"})  # removed: the state label goes, MIG stays

    wait_for(lambda: recorder.state == "<removed>", "state label removed")
    assert recorder.states == ["pending", "success", "<removed>"]
    assert sum(len(fake.gpu_instances(i)) for i in range(8)) == 56


def test_unknown_layout_fails_with_an_event(
    controller: LayoutController, recorder: Recorder
) -> None:
    controller.on_labels({LABEL_CONFIG: "all-typo"})

    wait_for(lambda: recorder.state == "failed", "state failed")
    type_, reason, message = recorder.events[-1]
    assert (type_, reason) == ("Warning", "MigConfigFailed")
    assert "no layout named 'all-typo'" in message and "all-1g.5gb" in message


def test_a_busy_instance_makes_the_layout_wait_then_complete(
    fake: FakeNvml,
    control: FakeNvmlControl,
    manager: MigManager,
    layouts: LayoutConfig,
    controller: LayoutController,
    recorder: Recorder,
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    busy = next(d for d in fake.mig_devices(5) if d.placement.start == 5)
    control.add_process(31337, busy.uuid)

    controller.on_labels({LABEL_CONFIG: "all-balanced"})

    wait_for(lambda: "MigConfigWaiting" in recorder.reasons(), "a waiting event")
    waiting = next(e for e in recorder.events if e[1] == "MigConfigWaiting")
    assert waiting[0] == "Warning"
    assert "GPU 5" in waiting[2] and "31337" in waiting[2] and "1g.5gb at 5:1" in waiting[2]
    assert recorder.state == "pending"
    wait_for(
        lambda: manager.metrics.apply_total.labels(result="pending")._value.get() >= 3,
        "retries with backoff",
    )
    assert recorder.reasons().count("MigConfigWaiting") == 1  # one Event per distinct reason

    control.remove_process(31337)

    wait_for(lambda: recorder.state == "success", "state success")
    assert recorder.states == ["pending", "success"]
    assert len(fake.gpu_instances(5)) == 4


def test_a_new_label_while_waiting_takes_over(
    fake: FakeNvml,
    control: FakeNvmlControl,
    manager: MigManager,
    layouts: LayoutConfig,
    recorder: Recorder,
    layouts_file: Path,
) -> None:
    apply_layout(manager, "all-1g.5gb", layouts)
    busy = next(d for d in fake.mig_devices(0) if d.placement.start == 4)
    control.add_process(4, busy.uuid)
    slow = Backoff(initial=60, maximum=60)  # without the takeover this would wait a minute
    c = LayoutController(manager, FileLayouts(layouts_file), recorder, backoff=slow)
    c.start()
    try:
        c.on_labels({LABEL_CONFIG: "all-balanced"})
        wait_for(lambda: "MigConfigWaiting" in recorder.reasons(), "waiting")

        started = time.monotonic()
        c.on_labels({LABEL_CONFIG: "all-1g.5gb"})

        wait_for(lambda: recorder.state == "success", "the new layout")
        assert time.monotonic() - started < 10
        assert recorder.states == ["pending", "pending", "success"]
        # GPUs that were free took all-balanced meanwhile; GPU 0 waited, untouched.
        assert (
            "applied MIG layout all-1g.5gb: 8 GPUs, 35 instances created"
            in (recorder.events[-1][2])
        )
        assert busy.uuid in {d.uuid for d in fake.mig_devices(0)}
    finally:
        c.stop()


def test_configmap_changes_reapply_the_selected_layout(
    fake: FakeNvml, manager: MigManager, recorder: Recorder
) -> None:
    source = ConfigMapLayouts("ns", "layouts")
    c = LayoutController(manager, source, recorder, backoff=FAST)
    source.on_change = c.on_layouts_changed
    c.start()
    try:
        c.on_labels({LABEL_CONFIG: "mine"})
        wait_for(lambda: recorder.state == "failed", "failed without the ConfigMap")
        assert "ConfigMap ns/layouts key config.yaml" in recorder.events[-1][2]

        source.update(
            {
                "config.yaml": "version: v1\nmig-configs:\n  mine:\n    - devices: [7]\n"
                "      mig-enabled: true\n      mig-devices: {'4g.20gb': 1}\n"
            }
        )

        wait_for(lambda: recorder.state == "success", "success after the ConfigMap appears")
        assert [d.profile for d in fake.mig_devices(7)] == ["4g.20gb"]
    finally:
        c.stop()


def test_backoff_grows_exponentially_up_to_the_maximum() -> None:
    wait = Backoff(initial=1, maximum=8).wait()
    delays = []
    for attempt in range(1, 7):
        state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
        state.attempt_number = attempt
        delays.append(wait(state))
    assert 1 <= delays[0] <= 1.5
    assert 2 <= delays[1] <= 2.5
    assert 4 <= delays[2] <= 4.5
    assert all(d <= 8 for d in delays)
    assert delays[-1] == 8


def test_default_layouts_text_is_the_configmap(layouts: LayoutConfig) -> None:
    assert "all-balanced" in default_layouts_text()
    assert layouts.names()[0] == "all-1g.10gb"
    assert LayoutState.REBOOTING.value == "rebooting"
