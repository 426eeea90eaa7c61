"""Tracing's setup when the OpenTelemetry install is broken: a clear error naming the cause."""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("opentelemetry.sdk")

pytestmark = pytest.mark.unit


def test_stale_otlp_protos_fail_tracing_with_the_fix_named(monkeypatch) -> None:
    """xds-protos ships an older opentelemetry/proto/*; installed over opentelemetry-proto's, the
    OTLP exporter cannot import InstrumentationScope. Tracing then refuses to start naming the
    clash and the command that mends it, not with the bare ImportError from inside the exporter."""
    from kubeinfer.server.otel import make_tracer

    import opentelemetry.proto.common.v1.common_pb2 as current

    stale = types.ModuleType(current.__name__)   # the module as xds-protos ships it: no InstrumentationScope
    vars(stale).update({k: v for k, v in vars(current).items() if k != "InstrumentationScope" and k[:2] != "__"})
    monkeypatch.setitem(sys.modules, current.__name__, stale)
    for name in [n for n in sys.modules if n.startswith("opentelemetry.exporter.otlp.proto")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"InstrumentationScope.*xds-protos.*force-reinstall --no-deps opentelemetry-proto"):
        make_tracer("http://127.0.0.1:4318/v1/traces", 1.0, "test")
