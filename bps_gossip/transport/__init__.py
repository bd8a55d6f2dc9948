"""Transport: ZeroMQ sockets, message framing, and the payload data paths."""

from .framing import MAX_HEADER_BYTES, bind_random_port, endpoint_host, recv_message, send_message

__all__ = ["MAX_HEADER_BYTES", "bind_random_port", "endpoint_host", "recv_message", "send_message"]
