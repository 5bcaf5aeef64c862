"""HTTP routes (prefix ``/v1``): they parse requests and call services, nothing more."""

from boxd.api.routes import keys, machines, snapshots, system

__all__ = ["keys", "machines", "snapshots", "system"]
