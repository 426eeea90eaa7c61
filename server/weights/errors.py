"""Why a model could not be fetched: each kind carries the exit code the operator reads."""

from __future__ import annotations

from .. import exit_codes


class ModelSourceError(Exception):
    """A source that cannot be served as asked; the message names what is missing or wrong."""

    exit_code = exit_codes.MODEL_NOT_FOUND

    @property
    def reason(self) -> str:
        return exit_codes.REASONS[self.exit_code]


class NotFound(ModelSourceError):
    exit_code = exit_codes.MODEL_NOT_FOUND


class AccessDenied(ModelSourceError):
    exit_code = exit_codes.MODEL_ACCESS_DENIED


class Unreachable(ModelSourceError):
    exit_code = exit_codes.MODEL_SOURCE_UNREACHABLE


class CacheFull(ModelSourceError):
    exit_code = exit_codes.MODEL_CACHE_FULL


class DataCorrupt(ModelSourceError):
    exit_code = exit_codes.MODEL_DATA_CORRUPT
