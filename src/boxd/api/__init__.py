"""The daemon's HTTP API: app factory, routes, auth, the error map and ``serve()``."""

from boxd.api.app import create_app

__all__ = ["create_app"]
