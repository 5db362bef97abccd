"""Which Links carry each subscription of a client: `SubscriptionTable`.

Theory of operation
-------------------
An all-partition subscription goes to every worker of the map (the Links for
all of them are opened then); a partition-scoped one goes to the owner of its
partition. The table remembers, per sid, the Subscription and the Links that
carry it; each Link keeps the subscriptions it carries in its own Matcher and
re-sends them when it reconnects (broky.client.link), so a Link that is down
when a subscription is made sends it when it comes back.

When the map changes (`follow_map`), every all-partition subscription is
added to the Links of workers that are new to the map, and every
partition-scoped one moves to the Link that now owns its partition, and is
also put on the Link its partition is moving to while it moves (the map's
`incoming`): the cluster moves a vbucket only once its subscribers are on
both (schema/README.md section 6.3). A Link retired with its node
(`forget_link`) no longer carries anything. A worker
that refuses a subscription with NOT_MY_VBUCKET (`refused`) drops it at
once, without an Unsubscribe; the map refresh that follows moves it to its
owner, or reports it when the fresh map still names the refusing worker. A
worker that refuses it with SUBSCRIPTION_LIMIT (`limited`: that connection
holds as many subscriptions, or subscription bytes, as the server allows) or
BAD_GROUP (a group member whose settings differ from those of its group's
members there) or PERMISSION_DENIED (its user may not read it) drops it for
good: it is never sent to that Link again, not on a reconnect nor on a new
map. A refusal is told once: while `subscribe` waits for the subscription's
confirmations (`confirming`) it is what `subscribe` raises; after that it goes
to `on_error`, once per subscription and reason, however many workers refuse
it alike.

The table knows the map only through the two lookups `follow_map` is given,
so it opens no Link of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from broky.client.link import Link
from broky.client.subscription import Subscription
from broky.errors import BrokyError, ServerError


class SubscriptionTable:
    """Every open subscription of one client, by sid, and the Links that carry it."""

    def __init__(self, report: Callable[[BaseException], None]) -> None:
        self.report = report  # the client's `on_error` path
        self.subs: dict[int, Subscription[Any]] = {}
        self.links: dict[int, list[Link]] = {}  # sid -> the Links that carry it
        self.rejected: dict[int, Link] = {}  # sid -> the Link whose worker refused it (NOT_MY_VBUCKET)
        # sid -> (the last SUBSCRIPTION_LIMIT, BAD_GROUP or PERMISSION_DENIED Error, the Links
        # whose worker refused it)
        self.limited: dict[int, tuple[ServerError, list[Link]]] = {}
        self.confirming: set[int] = set()  # sids `subscribe` waits for: it raises their refusals
        self.told: dict[int, set[str]] = {}  # sid -> the refusals reported to on_error (their text)
        self.paused: dict[int, set[Link]] = {}  # sid -> the Links it paused (its queue is full)
        self.last_sid = 0

    def new_sid(self) -> int:
        self.last_sid += 1
        return self.last_sid

    def add(self, sub: Subscription[Any], links: list[Link]) -> None:
        """Register `sub` and send it on each of `links`."""
        self.subs[sub.sid] = sub
        self.links[sub.sid] = links
        for link in links:
            link.add_sub(sub)

    def remove(self, sub: Subscription[Any]) -> None:
        """Unsubscribe `sub` on every Link that carries it, then close it."""
        self.subs.pop(sub.sid, None)
        self.rejected.pop(sub.sid, None)
        self.limited.pop(sub.sid, None)
        self.told.pop(sub.sid, None)
        self.resume(sub)
        for link in self.links.pop(sub.sid, []):
            link.remove_sub(sub)
        sub.mark_closed()

    def pause(self, sub: Subscription[Any]) -> None:
        """`sub`'s queue is full: pause every Link that carries it (again: one it was
        put on since)."""
        paused = self.paused.setdefault(sub.sid, set())
        for link in self.links.get(sub.sid, []):
            paused.add(link)
            link.pause_for(sub.sid)

    def resume(self, sub: Subscription[Any]) -> None:
        """`sub` has room again: its Links may deliver (once no other subscription paused them)."""
        for link in self.paused.pop(sub.sid, ()):
            link.resume_for(sub.sid)

    def refused(self, sid: int, link: Link) -> None:
        """`link`'s worker refused subscription `sid` (NOT_MY_VBUCKET): it no longer has it."""
        sub = self.subs.get(sid)
        if sub is not None:
            link.remove_sub(sub, tell_server=False)
            self.links[sub.sid] = []
            self.rejected[sub.sid] = link

    def limited_by(self, link: Link, err: ServerError) -> None:
        """`link`'s worker refused subscription err.sid with SUBSCRIPTION_LIMIT, BAD_GROUP or
        PERMISSION_DENIED: forget it on that Link, so that neither a reconnect nor a new map
        sends it there again; and tell it, once (see the module's header)."""
        sub = self.subs.get(err.sid)
        if sub is None:  # unsubscribed, or refused while `subscribe` waited: it raised
            return
        link.remove_sub(sub, tell_server=False)
        links = self.links.get(sub.sid, [])
        if link in links:
            links.remove(link)
        refused_by = self.limited[sub.sid][1] if sub.sid in self.limited else []
        if link not in refused_by:
            refused_by.append(link)
        self.limited[sub.sid] = (err, refused_by)
        if sub.sid in self.confirming:  # `subscribe` raises it
            return
        told = self.told.setdefault(sub.sid, set())
        if str(err) not in told:  # every worker refuses alike: once
            told.add(str(err))
            self.report(err)

    def _limited_on(self, sub: Subscription[Any], link: Link) -> bool:
        limited = self.limited.get(sub.sid)
        return limited is not None and link in limited[1]

    def forget_link(self, link: Link) -> None:
        """`link` is retired (its node left the map): it carries no subscription any more."""
        for paused in self.paused.values():
            paused.discard(link)
        for links in self.links.values():
            if link in links:
                links.remove(link)
        for refused in list(self.limited.values()):
            if link in refused[1]:
                refused[1].remove(link)
        if self.rejected:
            for sid in [sid for sid, by in self.rejected.items() if by is link]:
                del self.rejected[sid]

    def follow_map(
        self,
        all_links: Callable[[], list[Link]],
        owner_link: Callable[[bytes], Link],
        incoming_link: Callable[[bytes], Link | None] = lambda kp: None,
    ) -> None:
        """Put each subscription on the Links a new map says (see the module's header).

        Args:
            all_links: the Links of every worker of the map (opening those not open yet);
                called only if there is an all-partition subscription.
            owner_link: the Link of the worker that owns a key_partition.
            incoming_link: the Link of the worker a key_partition is moving to, or None.
        """
        all_partition = [s for s in self.subs.values() if s.partition is None]
        if all_partition:
            for link in all_links():
                for sub in all_partition:
                    if sub.sid not in link.subs and not self._limited_on(sub, link):
                        link.add_sub(sub)
                        self.links[sub.sid].append(link)
        for sub in list(self.subs.values()):
            if sub.partition is None:
                continue
            owner = owner_link(sub.partition)
            incoming = incoming_link(sub.partition)
            wanted = [owner] if incoming is None or incoming is owner else [owner, incoming]
            wanted = [link for link in wanted if not self._limited_on(sub, link)]
            current = self.links.get(sub.sid, [])
            if current == wanted:
                continue
            rejected_by = self.rejected.pop(sub.sid, None)
            if rejected_by is owner:
                self.report(
                    BrokyError(f"{sub!r}: worker {owner.ref.worker} refuses it but owns it per the map")
                )
                continue
            for link in current:
                if link not in wanted:
                    link.remove_sub(sub)
            for link in wanted:
                if link not in current:
                    link.add_sub(sub)
            self.links[sub.sid] = wanted

    def close(self) -> None:
        """The client is closing: end every subscription (iterators end after what was received)."""
        for sub in self.subs.values():
            sub.mark_closed()


__all__ = ["SubscriptionTable"]
