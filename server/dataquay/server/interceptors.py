"""Rebuilding a gRPC method handler around other behavior, in the same shape;
and parsing requests where a malformed one can be refused with a status.

Server interceptors that refuse or count calls (:mod:`dataquay.server.auth`,
:mod:`dataquay.server.limits`) wrap a method's behavior; gRPC wants the
wrapper as a handler of the same kind (unary or streaming, either way) with
the method's own (de)serializers.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Behavior = Callable[..., Any]


def reshaped(
    handler: grpc.RpcMethodHandler,
    unary: Callable[[Behavior], Behavior],
    streaming: Callable[[Behavior], Behavior],
    *,
    raw_requests: bool = False,
) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior passed through ``unary`` (for methods that
    answer once) or ``streaming`` (for methods that stream their answer).
    With ``raw_requests`` the new behavior gets the request bytes unparsed."""
    codecs = {
        "request_deserializer": None if raw_requests else handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **codecs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **codecs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **codecs)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **codecs)


class EncodedReplies(grpc.aio.ServerInterceptor):
    """Lets the named methods answer with bytes they encoded themselves: a
    reply kept and sent to many callers is encoded once, not once per call.

    Args:
        methods: full method names (``/package.Service/Method``).
    """

    def __init__(self, methods: frozenset[str]) -> None:
        self._methods = methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method not in self._methods or handler.unary_unary is None:
            return handler
        encode = handler.response_serializer

        def encoded(reply: Any) -> bytes:
            return reply if isinstance(reply, bytes) else encode(reply)

        return grpc.unary_unary_rpc_method_handler(
            handler.unary_unary, request_deserializer=handler.request_deserializer, response_serializer=encoded
        )


class RequestParsing(grpc.aio.ServerInterceptor):
    """Parses requests in the handler, where a malformed one can still be
    answered: bytes that are not the method's message end the call with
    INVALID_ARGUMENT, where gRPC itself would answer UNKNOWN and log a traceback.

    Install it last, so that it wraps the methods themselves and the
    interceptors before it see the raw bytes.
    """

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _parsing(handler)


def _parsing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` taking raw bytes and parsing them itself, in the same shape."""
    parse = handler.request_deserializer

    async def parsed(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return parse(raw)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")

    async def each_parsed(raw_messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for raw in raw_messages:
            yield await parsed(raw, context)

    async def requests(raw: bytes | AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
        """The request parsed, or for a method that streams its requests, the stream of them parsed."""
        return await parsed(raw, context) if isinstance(raw, bytes) else each_parsed(raw, context)

    async def answered(result: Any) -> AsyncIterator[Any]:
        """The items of a streaming method, whether it yields them or writes them itself."""
        if inspect.isasyncgen(result):
            async for item in result:
                yield item
        else:
            await result

    def unary(behavior: Behavior) -> Behavior:
        async def call(raw: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behavior(await requests(raw, context), context)

        return call

    def streaming(behavior: Behavior) -> Behavior:
        async def call(raw: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in answered(behavior(await requests(raw, context), context)):
                yield item

        return call

    return reshaped(handler, unary, streaming, raw_requests=True)
