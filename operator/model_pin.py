"""An hf:// revision (a branch or tag, which can move) resolved to one commit per generation.

Why in the operator: every pod of a generation must serve the same weights, so the commit goes
into the pod template, and the template is written before any pod runs. A "generation" here is
a pod template (a ReplicaSet), not metadata.generation, which every scale changes too: the
operator asks the hub when the template it would render without the pin is new, and records
the answer in `status.model` with that template's hash; later reconciles (scaling, the drift
timer, restarts) reuse it, so a branch head that moves changes nothing until the spec changes
in a way that rolls the pods anyway. A full commit sha is pinned already and never asked.
s3:// sources have no revisions to pin: the fetch keys the cache on a digest of the listing,
and status.model.revision shows the digest the latest engine pod's fetch found.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from .build import pod_spec
from .cold_start import new_cold_starts
from .resource import InferenceService, OperatorConfig
from .status import ColdStart, ModelStatus

COMMIT = re.compile(r"^[0-9a-f]{40}$")
RESOLVE_TIMEOUT_SECONDS = 10.0


class ResolveError(Exception):
    """The hub said no (or did not answer): `reason` is a condition reason, the message says what."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# (repo, revision, endpoint or None, token or None) -> commit sha
Resolver = Callable[[str, str, str | None, str | None], str]


def hub_resolver(repo: str, revision: str, endpoint: str | None, token: str | None) -> str:
    """Ask a Hugging Face hub (or mirror) which commit `revision` is, with huggingface_hub."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = endpoint or "huggingface.co"
    try:
        info = HfApi(endpoint=endpoint, token=token or False).model_info(repo, revision=revision,
                                                                         timeout=RESOLVE_TIMEOUT_SECONDS)
    except RevisionNotFoundError:
        raise ResolveError("ModelNotFound", f"revision {revision!r} not found in hf://{repo} at {where}") from None
    except GatedRepoError:
        raise ResolveError("ModelAccessDenied", f"hf://{repo} at {where} is gated: set model.tokenSecretRef to a "
                                                "Secret holding a token with access") from None
    except RepositoryNotFoundError:
        raise ResolveError("ModelNotFound", f"repository hf://{repo} not found at {where} (or it is private: "
                                            "set model.tokenSecretRef)") from None
    except HfHubHTTPError as exc:
        raise ResolveError("ModelSourceUnreachable", f"resolving hf://{repo}@{revision} at {where}: {exc}") from None
    except OSError as exc:  # connection refused, DNS, timeout
        raise ResolveError("ModelSourceUnreachable", f"{where} did not answer for hf://{repo}@{revision}: "
                                                     f"{exc}") from None
    return info.sha


@dataclass(frozen=True)
class Pin:
    model: ModelStatus | None  # what status.model says about the source (None: nothing to say)
    error: ResolveError | None = None


def pin(isvc: InferenceService, config: OperatorConfig, template_hash: str, previous: ModelStatus | None,
        read_token: Callable[[], str | None], resolve: Resolver = hub_resolver) -> Pin:
    """The commit pods of this template serve: the one recorded for it, the sha written in the
    source, or the hub's answer now."""
    source = isvc.spec.model.source
    if not source.startswith("hf://"):
        return Pin(ModelStatus(source=source) if source.startswith("s3://") else None)
    repo, _, revision = source.removeprefix("hf://").partition("@")
    revision = revision or "main"
    if COMMIT.match(revision):
        return Pin(ModelStatus(source=source, revision=revision, resolved_generation=isvc.generation,
                               template_hash=template_hash))
    if previous is not None and previous.source == source and previous.revision \
            and previous.template_hash == template_hash:
        return Pin(previous)
    try:
        commit = resolve(repo, revision, isvc.spec.model.endpoint or config.hf_endpoint, read_token())
    except ResolveError as exc:  # also raised by read_token
        return Pin(None, exc)
    return Pin(ModelStatus(source=source, revision=commit, resolved_generation=isvc.generation,
                           template_hash=template_hash))


def template_hash(isvc: InferenceService, config: OperatorConfig) -> str:
    """The engine pod template as it renders without a pin: what a resolution is valid for."""
    template = pod_spec(dataclasses.replace(isvc, resolved_revision=None), config)
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:16]


def model_status(isvc: InferenceService, pinned: ModelStatus | None, previous: ModelStatus | None,
                 pods: list[dict[str, Any]]) -> tuple[ModelStatus | None, list[ColdStart]]:
    """status.model: the pin, and the latest cold start of a pod serving this source (the
    pods' starts since the last one recorded are returned to be reported). An s3:// source's
    revision is the listing digest its latest fetch reported."""
    if pinned is None:
        return None, []
    same = previous is not None and previous.source == pinned.source
    last = previous.last_cold_start if same else None
    starts = new_cold_starts(pods, last)
    update: dict[str, Any] = {"last_cold_start": starts[-1] if starts else last}
    if pinned.source.startswith("s3://"):
        found = [s.revision for s in starts if s.revision]
        update["revision"] = found[-1] if found else previous.revision if same else None
    return pinned.model_copy(update=update), starts
