"""Who sent a request, and where its reply may go (docs/reliability.md, "Threat model").

Two modes (``QLM_PRODUCER_IDENTITY``):

* ``body`` (default): the tenant is the request's ``tenant`` field. Producers are trusted not
  to impersonate each other; qlm only keeps replies out of its own queues.
* ``broker``: the tenant is the AMQP ``user_id`` property, which RabbitMQ refuses to deliver
  unless it equals the publishing connection's user - so it cannot be forged. A request
  without it is refused; a body ``tenant`` that says otherwise is refused. Replies go only to
  RabbitMQ direct reply-to or to the tenant's own reply queues (``qlm.reply.<tenant>.*``, which
  per-user broker permissions let only that user read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qlm.coordinator.validation import InvalidRequest
from qlm.types import ErrorCode

IdentityMode = Literal["body", "broker"]

REPLY_PREFIX = "qlm.reply."
DIRECT_REPLY_TO = "amq.rabbitmq.reply-to"
# a reply goes to a direct reply-to *address* (the bare name only subscribes; publishing to it
# closes the publishing channel with a precondition failure)
DIRECT_REPLY_ADDRESS = DIRECT_REPLY_TO + "."


def reply_prefix(tenant: str) -> str:
    """The reply-queue prefix reserved for ``tenant`` (``qlm.reply.<tenant>.``)."""
    return f"{REPLY_PREFIX}{tenant}."


@dataclass(frozen=True)
class ProducerIdentity:
    mode: IdentityMode = "body"

    def tenant_of(
        self, body_tenant: str | None, user_id: str | None, request_id: str | None
    ) -> str | None:
        """The tenant a message speaks for, or :class:`InvalidRequest`."""
        if self.mode == "body":
            return body_tenant
        if not user_id:
            raise InvalidRequest(
                ErrorCode.IDENTITY_REQUIRED,
                "this coordinator takes the tenant from the AMQP user_id property "
                "(QLM_PRODUCER_IDENTITY=broker); publish with user_id set to your broker user",
                request_id,
            )
        if body_tenant is not None and body_tenant != user_id:
            raise InvalidRequest(
                ErrorCode.TENANT_MISMATCH,
                f"tenant {body_tenant!r} in the body is not the publishing user {user_id!r}",
                request_id,
            )
        return user_id

    def reply_route(self, reply_to: str | None, tenant: str | None) -> str | None:
        """``reply_to`` if a reply may go there (e.g. an error reply to invalid input), else
        None: a reply never lands in a queue its producer may not use."""
        try:
            self.check_reply_to(reply_to, tenant, None)
        except InvalidRequest:
            return None
        return reply_to or None

    def check_reply_to(
        self, reply_to: str | None, tenant: str | None, request_id: str | None
    ) -> None:
        """Refuse a reply route the producer may not use: qlm's own queues and exchanges'
        names always; in ``broker`` mode anything but direct reply-to or the tenant's prefix."""
        if not reply_to:
            return
        if reply_to.startswith(DIRECT_REPLY_ADDRESS) and len(reply_to) > len(DIRECT_REPLY_ADDRESS):
            return
        if self.mode == "broker":
            if tenant is not None and reply_to.startswith(reply_prefix(tenant)):
                return
            raise InvalidRequest(
                ErrorCode.INVALID_REPLY_TO,
                f"reply_to must be {DIRECT_REPLY_TO!r} or start with "
                f"{reply_prefix(tenant or '<tenant>')!r}",
                request_id,
            )
        if reply_to.startswith("amq.") or (
            reply_to.startswith("qlm.") and not reply_to.startswith(REPLY_PREFIX)
        ):
            raise InvalidRequest(
                ErrorCode.INVALID_REPLY_TO,
                f"reply_to {reply_to[:128]!r} names a queue of qlm or the broker; use a "
                f"queue of your own (e.g. {REPLY_PREFIX}<name>) or {DIRECT_REPLY_TO!r}",
                request_id,
            )
