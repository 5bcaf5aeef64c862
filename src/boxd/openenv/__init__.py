"""OpenEnv on boxd: every session is a fork of one warm source.

``BoxdProvider`` is an ``openenv.core.containers.runtime.ContainerProvider``: its
``start_container(image)`` takes the name of a machine (or snapshot) in which an OpenEnv
server already listens (on the guest's port 8080, or the ``port`` it is given), forks it
(or starts a machine from the snapshot) and returns the new machine's URL for that port,
so an unmodified ``EnvClient`` talks to a server that is warm from its first byte. A
boxd image's name (``boxd image build``/``import``) works too: the image starts once as
a baseline machine whose service serves the env (port 8000, as OpenEnv's images do),
and each session is a fork of it. See docs/openenv.md.

It is a client of ``boxd.sdk`` only (``pip install boxd[openenv]``).
"""

from __future__ import annotations

from boxd.openenv._provider import GUEST_PORT, BoxdProvider

__all__ = ["GUEST_PORT", "BoxdProvider"]
