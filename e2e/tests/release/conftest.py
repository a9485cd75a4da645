"""The release path without GitHub: the loopback registry (gpuslice_testkit.registry), the push
steps of a release against it (gpuslice_testkit.release, ``make release-local``) and the
workflow that does them on a tag (.github/workflows/release.yml) agreeing with the chart's
default image references. docs/release.md describes them.

``helm_bin`` is a fixture in e2e/tests/conftest.py. No fixture is shared by this folder alone.
"""
