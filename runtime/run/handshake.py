"""What the coordinator watches while its stages say hello: a host started with another plan.json is named
within a second or two, not after the handshake timeout.

A stage started from another plan.json says hello under that plan's hash; the coordinator's transport drops
the message (runtime/wire/frames.py), and the drop is read back here from the transport's rejections: the
run ends with one line naming the stage, its host and address, both plan hashes and what to copy where.
Only a drop that cannot be forged is believed: from an authenticated peer (one of this plan's keys), or any
peer when the plan has no keys (security none trusts the network).

With keys, a host holding another plan.json usually holds that plan's keys too, and no message of it ever
arrives: its connections fail the key check first. Then the coordinator's own connection to that stage's
address (dialed with this plan's keys) fails its handshake too, and the side that dialed knows whom it
dialed: the run ends with one line naming the stage, its host and address, this plan's hash and what to
copy (the other plan's hash is in that stage's own log: nothing of it can be read before the key check).
No anonymous host can cause this: it takes the process listening at that stage's address. Connections
that fail the key check at the coordinator's inbox are only a hint (anyone can fail one), with the peer
addresses the inbox found (runtime/wire/gatekeeper.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hetero.plan import Plan
from hetero.runtime.base.processes import StageFailedError

UNAUTHENTICATED = "unauthenticated peer "  # how the transport names a peer without keys (runtime/wire/inbox.py, _peer_address)


def connect_stages(transport: Any, plan: Plan, names: list[str]) -> None:
    """Connect the coordinator to every stage, with keys watched from the first attempt: a stage holding another
    plan's keys may refuse it only once (ZeroMQ does not retry a refused key), before any watch could start."""
    from hetero.runtime.wire.control import ConnectionWatch

    transport.watch_from_start(ConnectionWatch.events() if plan.security.mode != "none" else 0)
    for name, sp in zip(names, plan.stages, strict=True):
        transport.connect(name, sp.endpoint)
    transport.watch_from_start(0)  # HandshakeWatch claims these monitors; later connects start none


class HandshakeWatch:
    """Checks, every time the coordinator's mailbox idles before training, for stages of another plan."""

    def __init__(self, plan: Plan, transport: Any, names: list[str], endpoint: str, plan_path: Path,
                 earlier: set[str] | None = None) -> None:
        self.plan, self.transport, self.names = plan, transport, names
        # Hashes of the plans the run went through before this one (runtime.elastic): a stage of such a plan that has
        # not exited yet may still reach this endpoint; it is no misconfiguration.
        self.earlier = earlier or set()  # (the inbox knows them from the transport's start: coordinator_greeting.py)
        self.endpoint, self.plan_path = endpoint, plan_path
        self.keyed = plan.security.mode != "none"
        self.refused_before = transport.refused_handshakes()
        self.hinted = False
        from hetero.runtime.wire.control import ConnectionWatch

        self.dials: ConnectionWatch | None = ConnectionWatch(transport, names) if self.keyed else None

    def close(self) -> None:
        """Stop watching the coordinator's own connections (before anything else monitors them, and before the
        transport closes: its context waits for the monitors)."""
        if self.dials is not None:
            self.dials.close()
            self.dials = None

    def check(self) -> None:
        """Raise StageFailedError for a stage whose messages carry another plan's hash; hint once at key refusals."""
        from hetero.runtime.wire.frames import plan_mismatch  # torch: not at the CLI's import

        for peer, why in list(self.transport.rejections):
            found = plan_mismatch(why)
            if found is None:
                continue
            claimed, theirs = found
            if theirs in self.earlier:
                continue
            name = peer if peer in self.names else (claimed if not self.keyed else None)
            if name in self.names:
                raise StageFailedError(self.other_plan(self.names.index(name), theirs, peer))
        if self.dials is not None and (refusal := self.dials.refused()) is not None:
            peer, _, why = refusal
            raise StageFailedError(self.refuses_us(self.names.index(peer), why))
        if self.keyed and not self.hinted and (refused := self.refused()):
            self.hinted = True
            print(f"hetero run: {refused}", file=sys.stderr, flush=True)

    def other_plan(self, k: int, theirs: str, peer: str) -> str:
        """The one line for stage ``k``, which runs plan ``theirs``."""
        host = self.plan.stages[k].host
        address = self.plan.cluster.host(host).address
        if peer.startswith(UNAUTHENTICATED):  # where its message came from (an IPv4 peer of a dual-stack inbox: ::ffff:)
            address = peer[len(UNAUTHENTICATED):].removeprefix("::ffff:")
        keys = f" and its artifacts/{host}/keys" if self.keyed else ""
        return (f"stage {k} on host {host} ({address}) runs plan {theirs}, this run's plan is {self.plan.input_hash}: "
                f"it was started with another plan.json; copy {self.plan_path}{keys} to {host} and restart "
                f"`hetero worker plan.json --host {host} --coordinator {self.endpoint}` there")

    def refuses_us(self, k: int, why: str) -> str:
        """The one line for stage ``k``, whose address fails the handshake with this run's keys (``why``)."""
        host, endpoint = self.plan.stages[k].host, self.plan.stages[k].endpoint
        return (f"stage {k}'s address on host {host} ({endpoint}) refuses this run's keys ({why}): the `hetero worker` "
                f"there was started with another plan.json or older keys (its stage log names the plan it runs), or "
                f"another program holds that port; this run's plan is {self.plan.input_hash}: copy {self.plan_path} "
                f"and its artifacts/{host}/keys to {host} and restart `hetero worker plan.json --host {host} "
                f"--coordinator {self.endpoint}` there")

    def refused(self) -> str | None:
        """How many connections failed the key check since the watch began, as a hint; None if none did."""
        count = self.transport.refused_handshakes() - self.refused_before
        if count <= 0:
            return None
        peers = sorted(set(self.transport.refused_peers()))
        where = f" (from {', '.join(peers[-3:])})" if peers else ""
        return (f"{count} connection(s) to this coordinator failed the key check{where} while it waits for its stages' "
                "hello: "
                f"is a host running another plan.json or older keys? this run's plan is {self.plan.input_hash}; "
                f"copy {self.plan_path} and its artifacts/<host>/keys to that host and restart `hetero worker` there "
                "(its stage's log names the plan it runs)")
