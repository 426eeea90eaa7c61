"""Shared test builders (tiny models, fake requests). Import as `from helpers.tiny_models import ...`."""
