"""One `kubeinfer route` command, two modes: the flags pick the mode and the defaults that go with it."""

from __future__ import annotations

import argparse

import pytest

from kubeinfer.server.router.cli import add_arguments, mode_defaults
from kubeinfer.server.router.flags import STRATEGIES
from kubeinfer.server.router.pickers import PICKERS, make_picker

pytestmark = pytest.mark.unit


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_backends_mean_standalone_on_loopback() -> None:
    args = parse(["--backend", "http://127.0.0.1:8001,http://127.0.0.1:8002"])
    assert mode_defaults(args) == "standalone"
    assert (args.host, args.port, args.activation_timeout) == ("127.0.0.1", 8000, 30.0)
    assert args.backend == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_an_inferenceservice_means_in_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "team-a")
    monkeypatch.setenv("KUBEINFER_ACTIVATION_TIMEOUT", "45")
    args = parse(["--inferenceservice", "chat"])
    assert mode_defaults(args) == "in-cluster"
    assert (args.host, args.port, args.activation_timeout, args.namespace) == ("0.0.0.0", 8080, 45.0, "team-a")


def test_one_mode_at_a_time() -> None:
    for argv in ([], ["--backend", "http://127.0.0.1:8001", "--inferenceservice", "chat"]):
        with pytest.raises(SystemExit, match="--backend URLs .* or --inferenceservice NAME"):
            mode_defaults(parse(argv))


def test_every_strategy_name_has_a_picker_that_declares_its_needs() -> None:
    assert sorted(PICKERS) == sorted(STRATEGIES)
    for name, picker in PICKERS.items():
        assert picker.strategy == name and isinstance(picker.keyed, bool) and isinstance(picker.warms, bool)
    assert not make_picker("round-robin", None).keyed and make_picker("prefix-aware", object()).warms
