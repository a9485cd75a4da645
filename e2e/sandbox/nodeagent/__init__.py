"""The node agent: a simulated kubelet for the node sandbox (docs/node-agent.md).

    agent = NodeAgent(NodeConfig(name="node-a", root=Path("/tmp/gsn-a"), timings=Timings.fast()),
                      kubeconfig).start()
    ...
    agent.stop()

It keeps a Node Ready (status + Lease), finds plugins in ``<root>/plugins_registry/``, speaks
the real registration, DRA (v1, v1beta1) and device-plugin (v1beta1) gRPC protocols, prepares
claims before "starting" a pod, resolves CDI ids into container edits, runs container commands
as local processes, reports pod status and finishes pod deletion.
"""

from e2e.sandbox.nodeagent.agent import NodeAgent
from e2e.sandbox.nodeagent.config import NodeConfig, Timings

__all__ = ["NodeAgent", "NodeConfig", "Timings"]
