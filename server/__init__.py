"""kubeinfer's serving engine and its HTTP API. Importing this package loads no torch."""

__version__ = "0.1.0"
