"""One owner of template lifetime: who holds each fork template right now.

A template (the memory image and frozen disk a fork batch starts from) lives while any
holder keeps a reference to it. Two holders are durable and live in the database: a
machine whose record names it (a child maps its files), and its living source while it
is the source's current one (the next fork reuses it). The others live only in this
process, and each takes and drops a reference here:

- ``launch``: a launch in flight from it (a fork child, a standby child being made, a
  peer's fetch being described, the children of a received template starting);
  counted, one per launch;
- ``offer``: a peer fetching it (`boxd.node._offers`), one per offer, from the moment
  it is described until the peer says it is done or its lease lapses;
- ``standby:<vm id>``: a standby fork child (`boxd.node._spares`) made from it, from
  the moment it is made until it is claimed (its record then names the template) or
  discarded;
- ``received:<source id>``: the newest template this node received of another node's
  source (`Templates.receive`), so that later forks of that source here reuse it.

Collection (`Templates.collect`) asks one question of each template: does a record,
the source's currency or a reference here hold it. When the last reference here is
dropped, `TemplateRefs` says so (``on_free``), and the node collects at that moment if
nothing durable holds the template either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable


class TemplateRefs:
    """The in-memory references to each template, by holder."""

    def __init__(self, on_free: Callable[[str], None]) -> None:
        self._on_free = on_free
        self._holders: dict[str, Counter[str]] = {}

    def acquire(self, template_id: str, holder: str) -> None:
        """``holder`` keeps ``template_id`` (a holder may hold it more than once)."""
        self._holders.setdefault(template_id, Counter())[holder] += 1

    def release(self, template_id: str, holder: str) -> None:
        """``holder`` lets one reference to ``template_id`` go. Releasing what the
        holder does not hold is a no-op (a clean-up path may run twice); the last
        reference's release calls ``on_free``."""
        held = self._holders.get(template_id)
        if held is None or held[holder] <= 0:
            return
        held[holder] -= 1
        if held[holder] <= 0:
            del held[holder]
        if not held:
            del self._holders[template_id]
            self._on_free(template_id)

    def held(self) -> set[str]:
        """The templates some in-memory holder keeps."""
        return set(self._holders)

    def holders(self, template_id: str) -> dict[str, int]:
        """Who holds ``template_id``, and how many times (for tests and logs)."""
        return dict(self._holders.get(template_id, {}))


__all__ = ["TemplateRefs"]
