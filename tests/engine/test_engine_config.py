"""`EngineConfig` and `ENGINE_FLAGS` agree: one field per flag, the same defaults, so
`EngineConfig()` is what `kubeinfer serve` runs with no flags and the operator renders."""

from __future__ import annotations

from dataclasses import MISSING, fields

import pytest

from kubeinfer.server.engine.config import EngineConfig
from kubeinfer.server.flags import ENGINE_FLAGS

pytestmark = pytest.mark.unit


def test_every_engine_flag_is_a_config_field_with_the_same_default():
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(EngineConfig)}
    assert defaults == {flag.dest: flag.default for flag in ENGINE_FLAGS}


def test_kv_cache_dtype_is_checked():
    import pytest

    assert EngineConfig(kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int8")
