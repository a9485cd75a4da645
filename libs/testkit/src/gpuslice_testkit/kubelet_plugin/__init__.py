"""Test doubles and clients shared by the unit tests, the e2e suites and bench/: stand-in
enforcer and MIG manager servers, a DRA socket client, allocation-result builders, the plugin
in-process (against the sandbox's real API server) and as a process. Never used by the plugin
itself; there is no API emulator here: tests that need the API use the sandbox's."""
