"""offloadd's wire: msgspec Structs shared by the daemon, the rank client and event consumers.

This package imports msgspec and the standard library only, so that clients and third-party
consumers can import it cheaply (no torch, no zmq).
"""

PROTOCOL_VERSION = 1
