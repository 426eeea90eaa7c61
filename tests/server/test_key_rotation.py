"""Key rotation without a restart: the key and tenant files, laid out as the kubelet lays out a
Secret volume and swapped the way it swaps them, are looked at again after `--key-reload-seconds`;
a good version replaces keys, tenants and quotas at once, a broken one is refused (counted,
logged without a key) while the keys in force stay."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers.secret_volume import Clock, publish
from prometheus_client import CollectorRegistry

from kubeinfer.server.credentials import CredentialFiles
from kubeinfer.server.tenancy import RateLimiter, TenantTable

pytestmark = pytest.mark.unit

TENANTS = """
tenants:
  - name: team-a
    keys_file: keys/team-a
    quotas: {requests_per_minute: 60}
  - name: team-b
    keys: [sk-b-1]
"""


def watched(volume: Path, clock: Clock, interval: float = 10.0) -> CredentialFiles:
    return CredentialFiles(["sk-static"], str(volume / "api-keys"), str(volume / "tenants.yaml"),
                           require_key=True, interval=interval, clock=clock)


def test_a_rotated_secret_applies_after_the_interval_and_only_then(tmp_path: Path) -> None:
    publish(tmp_path, {"api-keys": "sk-old\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a-old\n"})
    clock, seen = Clock(), []
    files = watched(tmp_path, clock)
    files.subscribe(seen.append)
    assert files.current.api_keys == ["sk-static", "sk-old"]
    assert files.current.table.by_name()["team-a"].keys == ["sk-a-old"]

    publish(tmp_path, {"api-keys": "sk-new\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a-new\nsk-a-2\n"})
    clock.now += 9.9
    files.refresh()
    assert seen == [] and files.current.api_keys == ["sk-static", "sk-old"]   # not yet looked at
    clock.now += 0.2
    files.refresh()
    assert len(seen) == 1 and seen[0] is files.current
    assert files.current.api_keys == ["sk-static", "sk-new"]
    assert files.current.table.by_name()["team-a"].keys == ["sk-a-new", "sk-a-2"]   # a tenant's own Secret

    clock.now += 60
    files.refresh()
    assert len(seen) == 1   # unchanged files: nothing applied again


def test_a_broken_version_is_refused_once_and_the_keys_in_force_stay(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    publish(tmp_path, {"api-keys": "sk-old\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a-old\n"})
    clock, registry, seen = Clock(), CollectorRegistry(), []
    files = watched(tmp_path, clock)
    files.count_reloads(registry)
    files.subscribe(seen.append)
    broken = [
        {"api-keys": "# sk-commented-out\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a-x\n"},   # no key
        {"api-keys": "sk-y\n", "tenants.yaml": TENANTS + "  - name: team-b\n", "keys/team-a": "sk-a-y\n"},
        {"api-keys": "sk-z\n", "tenants.yaml": "tenants: [", "keys/team-a": "sk-a-z\n"},
        {"api-keys": "sk-w\n", "tenants.yaml": TENANTS, "keys/team-a": b"\xff\xfe sk-binary"},
    ]
    with caplog.at_level(logging.WARNING, logger="kubeinfer.credentials"):
        for version in broken:
            publish(tmp_path, version)
            for _ in range(3):   # looked at three times, refused and counted once
                clock.now += 10
                files.refresh()
    assert seen == []
    assert files.current.api_keys == ["sk-static", "sk-old"]
    assert files.current.table.by_name()["team-a"].keys == ["sk-a-old"]
    assert registry.get_sample_value("kubeinfer:credential_reloads_total", {"outcome": "refused"}) == 4
    assert registry.get_sample_value("kubeinfer:credential_reloads_total", {"outcome": "applied"}) == 0
    assert len(caplog.records) == 4
    assert not any(secret in caplog.text for secret in ("sk-commented", "sk-y", "sk-z", "sk-w", "sk-a-", "sk-binary"))

    publish(tmp_path, {"api-keys": "sk-fixed\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a-fixed\n"})
    clock.now += 10
    files.refresh()
    assert files.current.api_keys == ["sk-static", "sk-fixed"] and len(seen) == 1
    assert registry.get_sample_value("kubeinfer:credential_reloads_total", {"outcome": "applied"}) == 1


def test_a_tenant_added_with_its_own_key_file_is_watched_from_then_on(tmp_path: Path) -> None:
    publish(tmp_path, {"api-keys": "sk-old\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a\n"})
    clock = Clock()
    files = watched(tmp_path, clock)
    more = TENANTS + "  - name: team-c\n    keys_file: keys/team-c\n"
    publish(tmp_path, {"api-keys": "sk-old\n", "tenants.yaml": more, "keys/team-a": "sk-a\n", "keys/team-c": "sk-c-1\n"})
    clock.now += 10
    files.refresh()
    assert files.current.table.by_name()["team-c"].keys == ["sk-c-1"]
    publish(tmp_path, {"api-keys": "sk-old\n", "tenants.yaml": more, "keys/team-a": "sk-a\n", "keys/team-c": "sk-c-2\n"})
    clock.now += 10
    files.refresh()   # only team-c's key file changed
    assert files.current.table.by_name()["team-c"].keys == ["sk-c-2"]


def test_quotas_follow_the_table_and_unchanged_ones_keep_what_they_owe() -> None:
    clock = Clock()
    table = TenantTable.model_validate({"tenants": [
        {"name": "a", "quotas": {"requests_per_minute": 60}},
        {"name": "b", "quotas": {"requests_per_minute": 60}},
        {"name": "c", "quotas": {"tokens_per_minute": 600}}]})
    limiter = RateLimiter(table, clock=clock)
    for tenant in ("a", "b"):
        assert limiter.check(tenant) is None   # one second's worth: one request each
        assert limiter.check(tenant) is not None
    limiter.update(TenantTable.model_validate({"tenants": [
        {"name": "a", "quotas": {"requests_per_minute": 60}},       # unchanged: still owes
        {"name": "b", "quotas": {"requests_per_minute": 120}},      # changed: a new, full bucket
        {"name": "d", "quotas": {"requests_per_minute": 60}}]}))    # c removed, d new
    assert limiter.check("a") is not None
    assert limiter.check("b") is None and limiter.check("b") is None   # two a second now
    refusal = limiter.check("b")
    assert refusal is not None and refusal.value == 120
    assert limiter.check("c") is None and "c" not in limiter.tokens   # no quota any more
    assert limiter.check("d") is None


KEYS = st.lists(st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=",#"), min_size=1,
                        max_size=12), max_size=3)
VERSION = st.fixed_dictionaries({
    "api-keys": st.one_of(KEYS.map(lambda keys: "\n".join(keys)), st.binary(max_size=16)),
    "tenants.yaml": st.sampled_from([TENANTS, "tenants: [", "", "tenants:\n  - name: 'bad name'\n",
                                     TENANTS + "  - name: team-a\n"]),
    "keys/team-a": st.one_of(KEYS.map(lambda keys: ",".join(keys)), st.binary(max_size=16)),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(versions=st.lists(VERSION, min_size=1, max_size=5))
def test_any_sequence_of_versions_leaves_the_last_good_one_in_force(tmp_path_factory: pytest.TempPathFactory,
                                                                    versions: list[dict]) -> None:
    volume = tmp_path_factory.mktemp("secret")
    publish(volume, {"api-keys": "sk-start\n", "tenants.yaml": TENANTS, "keys/team-a": "sk-a\n"})
    clock = Clock()
    files = watched(volume, clock, interval=1)
    expected = files.current
    for version in versions:
        publish(volume, version)
        clock.now += 1
        files.refresh()   # never raises, whatever the files hold
        try:
            expected = CredentialFiles(["sk-static"], str(volume / "api-keys"), str(volume / "tenants.yaml"),
                                       require_key=True, interval=0).current
        except ValueError:
            pass   # refused: the previous good version stays
        assert files.current == expected


@pytest.mark.parametrize("variable, value, message", [
    ("KUBEINFER_KEY_RELOAD_SECONDS", "-3", "must be 0 or more seconds"),
    ("KUBEINFER_KEY_RELOAD_SECONDS", "soon", "could not convert"),
    ("KUBEINFER_MAX_QUEUED_REQUESTS", "many", "invalid literal"),
])
def test_an_env_value_that_does_not_parse_is_a_usage_error_naming_it(
        capsys: pytest.CaptureFixture, variable: str, value: str, message: str) -> None:
    """As argparse answers a bad --flag: exit status 2 and the variable's name, no traceback."""
    import argparse

    from kubeinfer.server.flags import SERVER_FLAGS, add_flags

    with pytest.raises(SystemExit) as stopped:
        add_flags(argparse.ArgumentParser(prog="kubeinfer serve"), SERVER_FLAGS, environ={variable: value})
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert f"kubeinfer serve: error: environment variable {variable}: " in error and message in error


@pytest.mark.parametrize("variable, value", [
    ("KUBEINFER_KV_CACHE_DTYPE", "bad"),
    ("KUBEINFER_QUANTIZE_LM_HEAD", "q4"),
    ("KUBEINFER_DTYPE", "int8"),
])
def test_an_env_value_outside_the_flags_choices_is_a_usage_error_naming_it(
        capsys: pytest.CaptureFixture, variable: str, value: str) -> None:
    """argparse checks a --flag's choices only on the command line: the environment's get the same."""
    import argparse

    from kubeinfer.server.flags import ENGINE_FLAGS, add_flags

    with pytest.raises(SystemExit) as stopped:
        add_flags(argparse.ArgumentParser(prog="kubeinfer serve"), ENGINE_FLAGS, environ={variable: value})
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert f"kubeinfer serve: error: environment variable {variable}: invalid choice: '{value}' (choose from " in error


def test_an_env_value_among_the_choices_is_the_default() -> None:
    import argparse

    from kubeinfer.server.flags import ENGINE_FLAGS, add_flags

    parser = argparse.ArgumentParser()
    add_flags(parser, ENGINE_FLAGS, environ={"KUBEINFER_QUANTIZE_LM_HEAD": "none", "KUBEINFER_KV_CACHE_DTYPE": "fp8"})
    args = parser.parse_args([])
    assert (args.quantize_lm_head, args.kv_cache_dtype) == ("none", "fp8")
