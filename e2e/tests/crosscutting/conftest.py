"""Tests that hold several services to one rule rather than testing one service: objects a tenant
can write must not crash or stall any component that reads them (test_hostile_objects.py),
what the controller's claims webhook refuses prepare refuses too (test_claim_checks_agree.py),
and the node services behave the same on the mock libnvidia-ml as on the fake NVML
(test_nvml_mock_services.py). They use the fixtures of e2e/tests/conftest.py; nothing is shared
by this folder's modules alone.
"""
