"""Helpers the end-to-end tests share that are not fixtures (fixtures live in the conftest.py of
the folder whose tests share them). No test module imports another test module; what two of
them need is here, in e2e/sandbox (the sandbox cluster itself) or in gpuslice_testkit (helpers
that need no sandbox)."""
