"""gpuslice's cluster view: every GPU and MIG device our driver publishes, what is allocated on
it and to whom, its health taints and cordons; the reasons a claim does not schedule; and the
kubectl plugin ``kubectl gpuslice`` that shows them.

``model``: the view, built (and updated object by object) from ResourceSlices, ResourceClaims,
Pods and DeviceTaintRules as plain dicts, any of resource.k8s.io v1, v1beta2, v1beta1. It makes
no API calls, so the controller can feed it from its reflectors. ``reasons``: why a claim or pod
does not get a GPU, computed from the view. ``cel``: the subset of CEL that device selectors use,
evaluated to say which clause rules devices out. ``cordon``: the DeviceTaintRule of a cordon.
``cli``: the kubectl plugin.
"""

__version__ = "0.1.0"
