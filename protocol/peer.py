"""The registration channel: how a local peer proves who it is and hands over its memory.

Beside an ``ipc://PATH`` control endpoint the daemon listens on the Unix ``SOCK_SEQPACKET``
socket ``PATH + PEER_SUFFIX`` (same directory, mode and group). A peer connects and sends
ONE message, ``Register``, with the file descriptors of its shared-memory regions attached
(``SCM_RIGHTS``, in the order the regions' ``ShmHandle.fd`` index them). The daemon reads the
peer's uid, gid and pid from the kernel (``SO_PEERCRED``), checks the descriptors and answers
ONE message: ``Registered`` (a random one-time ``token`` and what the kernel said about the
peer) or ``RegisterRefused`` (an ``ErrorCode`` and why). Then it closes the connection.

The token is good for one ``Hello`` (or ``GetStats``) sent on the control socket by the
ZeroMQ routing id named in ``Register.identity``, within a short time; the session it opens
belongs to that uid, gid and pid and owns those descriptors. Nothing a Hello says about its
sender is believed instead. A ``tcp://`` control endpoint has no such channel (see
docs/security.md).

Frames are msgpack, one per seqpacket message, at most ``MAX_MESSAGE`` bytes.
"""

from __future__ import annotations

import msgspec

PEER_SUFFIX = ".peer"
MAX_MESSAGE = 4096
PEER_PROTOCOL_VERSION = 1
FDS_PER_MESSAGE = 250  # the kernel takes at most 253 descriptors per message (SCM_MAX_FD)
MORE_DESCRIPTORS = b"+"  # payload of the messages that only carry more descriptors


class Register(msgspec.Struct, frozen=True, tag="register"):
    """A peer's only message: its ZeroMQ routing id and how many descriptors ride along."""

    protocol_version: int
    identity: bytes
    descriptors: int = 0


class Registered(msgspec.Struct, frozen=True, tag="registered"):
    """Accepted: the one-time ``token`` for the Hello, and the peer as the kernel sees it
    (``pid`` in the daemon's pid namespace, 0 where it is not visible)."""

    token: bytes
    uid: int
    gid: int
    pid: int


class RegisterRefused(msgspec.Struct, frozen=True, tag="refused"):
    """Refused: ``code`` is a ``protocol.errors.ErrorCode`` value."""

    code: int
    message: str


PeerReply = Registered | RegisterRefused

_encoder = msgspec.msgpack.Encoder()
_register_decoder = msgspec.msgpack.Decoder(Register)
_reply_decoder = msgspec.msgpack.Decoder(PeerReply)


def encode_peer(message: Register | Registered | RegisterRefused) -> bytes:
    """One msgpack frame."""
    return _encoder.encode(message)


def decode_register(frame: bytes) -> Register:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` on bad input."""
    return _register_decoder.decode(frame)


def decode_peer_reply(frame: bytes) -> PeerReply:
    """Raises ``msgspec.DecodeError`` / ``ValidationError`` on bad input."""
    return _reply_decoder.decode(frame)


def peer_socket_path(endpoint: str) -> str | None:
    """The registration socket beside an ``ipc://`` control endpoint; None for others."""
    if not endpoint.startswith("ipc://"):
        return None
    return endpoint[len("ipc://") :] + PEER_SUFFIX
