"""Where a fork batch's children go, and their launch node by node (the control
plane's `Machines.fork` claims them between the two).

A container image's machine forks like any other: a node that receives its template
first gets the image's blobs from the control plane's store (once per node), and
re-points the template's root at its own tree of that image (`Templates.receive`), on
engines that can (`Engine.portable_image_templates`)."""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Awaitable, Callable, Mapping

from boxd.control.nodes import Cluster
from boxd.control.placement import Placement, Room, check_hint, no_room
from boxd.errors import BoxdError, InvalidRequest
from boxd.node.base import Node
from boxd.state import MachineRecord

log = logging.getLogger("boxd.control")


class ForkPlacement:
    """A fork batch's targets and launch; remembers which nodes received a source's
    template (placement prefers them: copy-on-write there again)."""

    def __init__(
        self, nodes: Callable[[], Mapping[str, Node]], cluster: Callable[[], Cluster | None],
        placement: Placement, room: Callable[[], Awaitable[dict[str, Room]]],
        forget: Callable[[str, Node], Awaitable[None]],
        push_image: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self._nodes = nodes
        self._push_image = push_image  # (node id, image digest): the node holds it after
        self._cluster = cluster
        self._placement = placement
        self._room = room
        self._forget_ = forget
        # source machine id -> nodes that received its template
        self.received: dict[str, set[str]] = {}

    async def source_gone(self, source_id: str) -> None:
        """The machine was deleted: the nodes that received its template let it go (it
        was kept there for further forks; nothing else tells them the source is gone)."""
        cluster = self._cluster()
        for nid in self.received.pop(source_id, set()):
            node = cluster.nodes.get(nid) if cluster is not None else None
            if node is None or not node.alive:
                continue
            try:
                await node.drop_received(source_id)
            except BoxdError as exc:  # the node's next restart collects it
                log.warning("node=%s source=%s event=drop_received_failed error=%s",
                            nid, source_id, exc)

    async def launch(
        self, src: MachineRecord, node: Node, claimed: builtins.list[MachineRecord | Exception]
    ) -> dict[str, Exception | None]:
        """Launch the claimed children, node by node: each child's error or None.

        The source's node first: it makes the template the other nodes then fetch. If
        the source cannot be forked at all, the request fails and no child is left."""
        by_node: dict[str, builtins.list[str]] = {}
        for c in claimed:
            if isinstance(c, MachineRecord):
                by_node.setdefault(c.node_id, []).append(c.id)
        results: dict[str, Exception | None] = {}
        if node.id in by_node:
            ids = by_node.pop(node.id)
            try:
                results.update(zip(ids, await node.fork(src.id, ids), strict=True))
            except BaseException:
                for c in claimed:
                    if isinstance(c, MachineRecord):
                        await self._forget_(c.id, self._nodes()[c.node_id])
                raise
        await asyncio.gather(*(self._fork_on(nid, ids, src, node, results)
                               for nid, ids in by_node.items()))
        return results

    async def _fork_on(self, nid: str, ids: builtins.list[str], src: MachineRecord,
                       node: Node, results: dict[str, Exception | None]) -> None:
        """Children ``ids`` on node ``nid`` (not the source's): it gets the image of an
        image machine first, then receives the template. Each child's error or None goes
        into ``results``; a failure there is those children's only."""
        # children off the source's node exist only on a cluster (`targets`)
        cluster = self._cluster()
        assert cluster is not None
        target, source = cluster.nodes[nid], cluster.nodes[node.id]
        try:
            if src.run_image is not None:  # its template's root is the image's tree
                await self._push_image(nid, src.run_image.digest)
            results.update(zip(ids, await target.fork_from(source, src.id, ids),
                               strict=True))
            self.received.setdefault(src.id, set()).add(nid)
        except Exception as exc:  # that node's children failed; the others go on
            for cid in ids:
                await self._forget_(cid, target)
                results[cid] = exc

    async def targets(
        self, src: MachineRecord, node: Node, count: int, hint: str | None = None
    ) -> builtins.list[Node | Exception]:
        """Where each of ``count`` children goes, every node up to its cap: the source's
        node while it has room (copy-on-write there), then, when the source's engine
        can move its template (`ClusterNode.portable_templates`; a container image's
        machine's too, on its own root of the image there), the other nodes (the
        template streams to them); with a ``hint``, that node only. A child that fits
        nowhere is its item's `ResourceExhausted`. One host has no cap.

        Raises:
            NotFound: ``hint`` names no node.
            InvalidRequest: ``hint`` names another node and the template cannot move.
        """
        check_hint(hint, self._nodes())
        cluster = self._cluster()
        if cluster is None:
            return [node] * count
        portable = await cluster.nodes[node.id].portable_templates(
            src.engine, src.run_image is not None)
        only = _fork_only(src, node.id, hint, portable)
        room = await self._room()
        if only is not None:
            room = {only: room[only]} if only in room else {}
        chosen = self._placement.fork_targets(room, node.id, count,
                                             self.received.get(src.id, set()))
        why = "" if portable else f"{_forks_of(src)} stay on its node ({_cannot(src)})"
        return [self._nodes()[nid] if nid is not None else no_room(room, chosen, only=only,
                                                                 why=why)
                for nid in chosen]


def _fork_only(src: MachineRecord, source_node: str, hint: str | None,
               portable: bool) -> str | None:
    """The one node a fork's children may go to, if any: the ``hint``, or the source's
    node when its engine cannot move its template.

    Raises:
        InvalidRequest: ``hint`` names another node and the template cannot move.
    """
    if hint is not None and hint != source_node and not portable:
        raise InvalidRequest(
            f"{_forks_of(src)} stay on its node ({source_node}): {_cannot(src)}",
            hint="prepare a baseline on that node (`boxd machine new --node`) "
            "and fork it there, or fork without a node", field="node")
    return hint if hint is not None or portable else source_node


def _forks_of(src: MachineRecord) -> str:
    """The source's forks, as a placement message names them."""
    return (f"a {src.engine} machine's forks" if src.run_image is None else
            f"the forks of a {src.engine} machine of a container image")


def _cannot(src: MachineRecord) -> str:
    """Why the source's template cannot move (`ClusterNode.portable_templates`)."""
    if src.run_image is None:
        return f"the {src.engine} engine cannot move a template to another node"
    return (f"the {src.engine} engine cannot move the template of a container image's "
            "machine to another node")


__all__ = ["ForkPlacement"]
