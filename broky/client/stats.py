"""The counters of one client: `ClientStats`.

One instance per client, shared by every part of it (the publish path, the
Links, the subscriptions, the map refresh), each counting what it sees as a
plain attribute increment: nothing per message but the increment, and read
at any time. Its counters are slots: an instance dict of 30 or more
attributes leaves CPython 3.11's shared-keys fast path, and the publish and
delivery paths count here (bench/README.md, "Groups and acks in the SDK").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ClientStats:
    """Plain counters of one client (read them at any time)."""

    published: int = 0
    received: int = 0
    unmatched: int = 0  # deliveries no local subscription matched (e.g. after unsubscribe)
    dropped_local: int = 0  # deliveries dropped because a subscription's queue was full (twice over)
    pauses: int = 0  # times a connection was paused (Pause) because a subscription's queue was full
    server_lost: int = 0  # deliveries the server reported lost (LossNotice)
    misrouted: int = 0  # publishes refused with NOT_MY_VBUCKET and not resent (lost)
    denied: int = 0  # publishes refused with PERMISSION_DENIED (--users): not published
    resent: int = 0  # publishes refused with NOT_MY_VBUCKET, then sent to the owner of a fresh map
    refused: int = 0  # publishes refused: reconnect buffer full, or reconnecting given up
    # publishes written to a connection that dropped before a Pong confirmed them, whose
    # fate the server could not tell on the reconnect (no account): an upper bound of the loss
    unconfirmed_lost: int = 0
    resent_after_loss: int = (
        0  # publishes a dropped connection did not deliver, sent again after the reconnect
    )
    unsent_gave_up: int = 0  # publishes buffered for a worker when reconnecting to it was given up
    unsent_on_close: int = 0  # publishes still buffered for a down worker at close()
    reconnects: int = 0
    ping_timeouts: int = 0  # connections closed because max_outstanding_pings went unanswered
    duplicates_dropped: int = 0  # deliveries dropped as copies of ones a lost connection delivered
    # connections carrying subscriptions that were lost without an account (a server or node
    # restart, a node that died): deliveries may have been lost, how many is unknown (on_loss
    # is called with dropped 0 and LossReason.UNACCOUNTED)
    unaccounted: int = 0
    replayed: int = 0  # deliveries a start from positions replayed (a resume's in-flight messages)
    # EPOCH_CHANGED notices of a resume whose loss the worker's account counted exactly
    # (WORKER_RESTART): not reported to on_loss again
    epochs_changed: int = 0
    errors: int = 0
    map_refreshes: int = 0
    # Groups and acknowledgements (broky.client.groups)
    group_received: int = 0  # deliveries to group members (announced by a Delivery frame)
    redeliveries: int = 0  # of those, redeliveries (delivery_count > 1)
    group_paused: int = 0  # GroupNotice PAUSED: a member reached max_in_flight on a worker
    group_drain_expired: int = 0  # GroupNotice DRAIN_EXPIRED (each also reported to on_error)
    acks_sent: int = 0  # positions sent in Ack frames: ACK
    nacks_sent: int = 0  # ... NACK
    in_progress_sent: int = 0  # ... IN_PROGRESS
    # settlements not sent: their deliveries were lost (UNACKED_LOST) or their member is gone
    acks_dropped: int = 0
    # deliveries of ack members unsettled when the worker holding them restarted or left
    # (reported to on_loss with LossReason.UNACKED_LOST): nobody redelivers them
    unacked_lost: int = 0


__all__ = ["ClientStats"]
