"""OTLP/HTTP trace bodies (POST /v1/traces), read and written with the OpenTelemetry project's
own messages (opentelemetry-proto's ExportTraceServiceRequest), never decoded by hand.

A body is protobuf (`application/x-protobuf`, what vLLM's exporter sends) or OTLP's JSON
(`application/json`), optionally gzip-compressed (`Content-Encoding: gzip`). `decode` turns it
into plain span dicts holding what the replay uses of a span: its name, its start and end, and
its `gen_ai.*` attributes (vLLM's `llm_request` span carries the request id and the latency
split there, in seconds: vllm/tracing/utils.py's SpanAttributes); `export_body` writes the
same spans (replay sim's exporter). The receiver (replay.results.otlp_receiver) and the join
(replay.results.span_join) build on these.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

# The messages are imported where a body is read or written, not with this module: its names
# (the span attributes) are read by every run's end (replay.results.span_join), and protobuf and
# the messages are tens of ms of CPU that a replay without --otlp-receiver would pay at its start.

TRACES_PATH = "/v1/traces"
PROTOBUF = "application/x-protobuf"
JSON = "application/json"
KEPT_PREFIX = "gen_ai."  # the attributes a decoded span keeps

# vLLM's llm_request span (vllm/v1/engine/output_processor.py's do_tracing): one per finished
# request, its latencies in seconds.
LLM_REQUEST = "llm_request"
REQUEST_ID = "gen_ai.request.id"  # the engine's request id: vLLM's prefix + the client's X-Request-Id
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"  # queued -> scheduled
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"  # arrival -> first token
PREFILL = "gen_ai.latency.time_in_model_prefill"  # scheduled -> first token
DECODE = "gen_ai.latency.time_in_model_decode"  # first token -> last token
INFERENCE = "gen_ai.latency.time_in_model_inference"  # scheduled -> last token
E2E = "gen_ai.latency.e2e"  # arrival -> finished
COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"

Value = str | int | float | bool


class BadBody(ValueError):
    """A body that is not an OTLP trace export (answered 400)."""


class TooLarge(ValueError):
    """A body, or its gzip content, over the receiver's limit (answered 413)."""


def unzip(body: bytes, encoding: str | None, limit: int) -> bytes:
    """`body` as sent (`encoding`: its Content-Encoding), uncompressed within `limit` bytes: a
    small gzip body that would inflate past it is refused as TooLarge before it is held; one cut
    short, or with bytes after its end, as BadBody (what inflated of it would parse as an empty
    export, its spans lost without a count)."""
    encoding = (encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding != "gzip":
        raise BadBody(f"Content-Encoding {encoding!r}: only gzip or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadBody(f"not gzip: {e}") from None
    if len(data) > limit or inflater.unconsumed_tail:
        raise TooLarge(f"gzip content over {limit} bytes")
    if not inflater.eof:  # cut short: what inflated is part of a message, never an empty export
        raise BadBody("gzip content cut short")
    if inflater.unused_data:
        raise BadBody(f"{len(inflater.unused_data)} bytes after the gzip content")
    return data


def decode(body: bytes, content_type: str | None) -> list[dict]:
    """The spans of an ExportTraceServiceRequest body: [{"name", "start_ns", "end_ns",
    "attributes": {gen_ai.* name: value}}]. BadBody when it is not one (or its type is neither
    protobuf nor JSON)."""
    from google.protobuf import json_format
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    kind = (content_type or "").split(";")[0].strip().lower()
    message = ExportTraceServiceRequest()
    try:
        if kind == PROTOBUF:
            message.ParseFromString(body)
        elif kind == JSON:
            json_format.Parse(body, message, ignore_unknown_fields=True)
        else:
            raise BadBody(f"Content-Type {content_type!r}: expected {PROTOBUF} or {JSON}")
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, RecursionError) as e:
        raise BadBody(f"not an OTLP trace export ({kind}): {str(e)[:200]}") from None
    spans = []
    for resource_spans in message.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({"name": span.name, "start_ns": span.start_time_unix_nano,
                              "end_ns": span.end_time_unix_nano, "attributes": _attributes(span.attributes)})
    return spans


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Value]:
    kept: dict[str, Value] = {}
    for pair in pairs:
        if pair.key.startswith(KEPT_PREFIX):
            which = pair.value.WhichOneof("value")
            if which in ("string_value", "int_value", "double_value", "bool_value"):
                kept[pair.key] = getattr(pair.value, which)
    return kept


def _value(value: Value) -> AnyValue:
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue

    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


def export_body(spans: Iterable[Mapping], service: str) -> bytes:
    """An ExportTraceServiceRequest (protobuf) of `spans` as `decode` returns them, from one
    resource named `service`: each a SERVER span with a fresh trace and span id."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
    from opentelemetry.proto.resource.v1.resource_pb2 import Resource
    from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

    out = []
    for span in spans:
        out.append(Span(trace_id=os.urandom(16), span_id=os.urandom(8), name=span["name"], kind=Span.SPAN_KIND_SERVER,
                        start_time_unix_nano=span["start_ns"], end_time_unix_nano=span["end_ns"],
                        attributes=[KeyValue(key=k, value=_value(v)) for k, v in span["attributes"].items()]))
    resource = Resource(attributes=[KeyValue(key="service.name", value=AnyValue(string_value=service))])
    message = ExportTraceServiceRequest(resource_spans=[ResourceSpans(
        resource=resource, scope_spans=[ScopeSpans(scope=InstrumentationScope(name=service), spans=out)])])
    return message.SerializeToString()
