"""Rebuilding a gRPC method handler around other behavior, in the same shape.

Server interceptors that refuse or count calls (:mod:`dataquay.server.auth`,
:mod:`dataquay.server.limits`) wrap a method's behavior; gRPC wants the
wrapper as a handler of the same kind (unary or streaming, either way) with
the method's own (de)serializers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

Behavior = Callable[..., Any]


def reshaped(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior passed through ``unary`` (for methods that
    answer once) or ``streaming`` (for methods that stream their answer)."""
    codecs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codecs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **codecs)
