"""Tests of the local cluster itself: its pod runner, service proxy, binaries and lifecycle."""
