"""Serving the cluster view (``gpuslice_view``): the ``/view/`` endpoints (``api``) behind
TokenReview and SubjectAccessReview (``auth``), the per-GPU and per-claim metrics (``metrics``)
and the Events on pods the scheduler cannot place (``diagnose``)."""
