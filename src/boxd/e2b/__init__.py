"""A second front door: E2B's API over boxd's services (docs/e2b.md).

The unmodified ``e2b`` SDKs talk to one loopback TCP listener of the daemon
(``BOXD_E2B_LISTEN``): E2B's control routes (create, list, kill, timeout, pause,
connect, fork) and, routed by the ``E2b-Sandbox-Id`` header, the envd data plane (the
Connect JSON ``process.Process`` and ``filesystem.Filesystem`` services, ``/files``,
``/health``). Everything translates to the same `boxd.services.MachineService` the
HTTP API serves; nothing here reaches into the node.

This package root imports nothing heavy: the CLI uses `boxd.e2b.env` alone.
"""
