"""Pod lifecycle on a sandbox node without devices: phases, exit codes, restarts with
CrashLoopBackOff, init containers, env and ``$(VAR)`` expansion, graceful deletion."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from e2e.sandbox.controlplane import ControlPlane
from e2e.sandbox.nodeagent import NodeAgent
from e2e.sandbox.nodeagent.testing import (
    condition,
    get_pod,
    wait_for,
    wait_pod_gone,
    wait_pod_phase,
)
from gpuslice_kube.raw import Obj, RawApi, resource_path

pytest_plugins = ("e2e.sandbox.nodeagent.fixtures",)
pytestmark = pytest.mark.timeout(60)

NodeFactory = Callable[..., NodeAgent]


def pod(namespace: str, name: str, node: str, script: str | None, **spec: Any) -> Obj:
    container: Obj = {"name": "main", "image": "busybox"}
    if script is not None:
        container["command"] = ["sh", "-c", script]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "demo"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 5,
            "containers": [container],
            **spec,
        },
    }


def run(kube: RawApi, namespace: str, obj: Obj) -> None:
    kube.create(resource_path("v1", "pods", namespace=namespace), obj)


def log_of(agent: NodeAgent, p: Obj, container: str = "main") -> str:
    return agent.pod_log(p["metadata"]["uid"], container)


def test_completed_and_failed_pods_report_exit_codes(
    kube: RawApi, namespace: str, node_agent: NodeAgent
) -> None:
    node = node_agent.name
    run(kube, namespace, pod(namespace, "ok", node, "echo hello", restartPolicy="Never"))
    run(
        kube, namespace, pod(namespace, "bad", node, "echo oops >&2; exit 3", restartPolicy="Never")
    )
    ok = wait_pod_phase(kube, namespace, "ok", "Succeeded")
    term = ok["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (0, "Completed")
    assert log_of(node_agent, ok) == "hello\n"
    ready = condition(ok, "Ready")
    assert ready is not None and (ready["status"], ready["reason"]) == ("False", "PodCompleted")

    bad = wait_pod_phase(kube, namespace, "bad", "Failed")
    term = bad["status"]["containerStatuses"][0]["state"]["terminated"]
    assert (term["exitCode"], term["reason"]) == (3, "Error")
    assert log_of(node_agent, bad) == "oops\n"
    # completed pods stay in place (no deletionTimestamp): the agent does not delete them
    assert get_pod(kube, namespace, "ok") is not None


def test_restart_always_restarts_with_crashloop_backoff(
    kube: RawApi, namespace: str, node_agent: NodeAgent
) -> None:
    run(kube, namespace, pod(namespace, "crash", node_agent.name, "echo once; exit 1"))

    def restarted_twice() -> Obj | None:
        p = get_pod(kube, namespace, "crash")
        statuses = (p or {}).get("status", {}).get("containerStatuses") or []
        return statuses[0] if statuses and statuses[0]["restartCount"] >= 2 else None

    status = wait_for(restarted_twice, 20, "two restarts")
    assert status["lastState"]["terminated"]["exitCode"] == 1

    def in_backoff() -> Obj | None:
        p = get_pod(kube, namespace, "crash")
        s = (p or {}).get("status", {}).get("containerStatuses") or [{}]
        waiting = s[0].get("state", {}).get("waiting")
        return waiting if waiting and waiting["reason"] == "CrashLoopBackOff" else None

    waiting = wait_for(in_backoff, 20, "CrashLoopBackOff")
    assert "restarting failed container=main" in waiting["message"]
    p = get_pod(kube, namespace, "crash")
    assert p is not None and p["status"]["phase"] == "Running"


def test_init_containers_env_and_expansion(
    kube: RawApi, namespace: str, node_agent: NodeAgent
) -> None:
    obj = pod(
        namespace,
        "env",
        node_agent.name,
        None,
        initContainers=[
            {"name": "init", "image": "busybox", "command": ["sh", "-c", "echo init done"]}
        ],
    )
    main = obj["spec"]["containers"][0]
    main["command"] = ["sh", "-c"]
    main["args"] = [
        "echo $(GREETING) pod=$POD_NAME ns=$NS app=$APP node=$NODE '$$(KEPT)'; sleep 60"
    ]
    main["env"] = [
        {"name": "WHO", "value": "world"},
        {"name": "GREETING", "value": "hello-$(WHO)"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    run(kube, namespace, obj)
    p = wait_pod_phase(kube, namespace, "env", "Running")
    assert log_of(node_agent, p, "init") == "init done\n"
    text = wait_for(lambda: log_of(node_agent, p), 10, "the main container's output")
    assert text == (f"hello-world pod=env ns={namespace} app=demo node={node_agent.name} $(KEPT)\n")
    init = p["status"]["initContainerStatuses"][0]["state"]["terminated"]
    assert init["exitCode"] == 0
    initialized = condition(p, "Initialized")
    assert initialized is not None and initialized["status"] == "True"


def test_pod_without_command_runs_and_deletion_is_graceful(
    kube: RawApi, namespace: str, node_agent: NodeAgent
) -> None:
    node = node_agent.name
    run(kube, namespace, pod(namespace, "idle", node, None))
    trap = "trap 'echo bye; exit 0' TERM; echo up; while true; do sleep 0.1; done"
    run(kube, namespace, pod(namespace, "trap", node, trap))
    stubborn = "trap '' TERM; echo up; while true; do sleep 0.1; done"
    run(
        kube, namespace, pod(namespace, "stubborn", node, stubborn, terminationGracePeriodSeconds=1)
    )
    wait_pod_phase(kube, namespace, "idle", "Running")
    trapping = wait_pod_phase(kube, namespace, "trap", "Running")
    wait_pod_phase(kube, namespace, "stubborn", "Running")
    wait_for(lambda: log_of(node_agent, trapping) == "up\n", 10, "the trap pod to be up")

    for name in ("idle", "trap", "stubborn"):
        kube.delete(resource_path("v1", "pods", namespace=namespace, name=name))
    for name in ("idle", "trap", "stubborn"):
        wait_pod_gone(kube, namespace, name, timeout=15)
    assert log_of(node_agent, trapping) == "up\nbye\n"


def test_kubectl_logs_reads_the_container_log_through_the_api_server(
    sandbox: ControlPlane, kube: RawApi, namespace: str, node_agent: NodeAgent
) -> None:
    run(kube, namespace, pod(namespace, "talker", node_agent.name, "echo one; echo two; sleep 60"))
    p = wait_pod_phase(kube, namespace, "talker", "Running")
    wait_for(lambda: log_of(node_agent, p) == "one\ntwo\n", 10, "the output")
    out = subprocess.run(
        [
            str(sandbox.binaries.path("kubectl")),
            f"--kubeconfig={sandbox.kubeconfig}",
            "-n",
            namespace,
            "logs",
            "talker",
            "--tail=1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == "two\n"


def test_stopping_the_agent_leaves_no_container_process(
    kube: RawApi, namespace: str, node_agents: NodeFactory
) -> None:
    agent = node_agents()
    run(kube, namespace, pod(namespace, "sleeper", agent.name, "sleep 300"))
    p = wait_pod_phase(kube, namespace, "sleeper", "Running")
    cdir = agent.config.pods_dir / p["metadata"]["uid"] / ".containers" / "main"
    pids = [
        int((cdir / "pid").read_text()),
        json.loads((cdir / "state.json").read_text())["shimPid"],
    ]
    agent.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
