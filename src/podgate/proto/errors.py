"""The root of every protocol error podgate raises, split by who is at fault."""

from __future__ import annotations


class ProtocolError(Exception):
    """A protocol was violated. Subclasses say by whom and what goes on the wire."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class LocalProtocolError(ProtocolError):
    """Our own code asked for something the protocol forbids (a bug on this side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""
