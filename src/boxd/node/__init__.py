"""The node runtime: one host's machines, its engine, templates, spares and recovery."""

from boxd.node._host import Host
from boxd.node._services import SERVICE_ID, service_argv
from boxd.node.base import Boot, FromSnapshot, Node
from boxd.node.runtime import NodeRuntime

__all__ = ["SERVICE_ID", "Boot", "FromSnapshot", "Host", "Node", "NodeRuntime", "service_argv"]
