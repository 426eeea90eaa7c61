"""Model source strings, parsed in one place for the engine, `kubeinfer fetch` and the operator.

- `hf://org/name[@revision]`: a Hugging Face Hub repository (or a mirror, `HF_ENDPOINT`) at a
  branch, tag or full commit sha; no revision means `main`.
- `s3://bucket[/prefix]`: the objects under a prefix of an S3-compatible bucket.
- `pvc://claim[/path]`: a PersistentVolumeClaim (the operator mounts it; the engine sees a path).
- `embedded`, or a local directory / .gguf file.

Stdlib only: the operator and the router import no torch and no cloud client.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the Hub's repo ids: an optional namespace, then a name of letters, digits, '-', '_', '.'
_HF_REPO = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
_HF_REVISION = re.compile(r"^[\w.\-/]{1,255}$")
# S3's bucket naming rules (3-63 of lowercase letters, digits, '.', '-'; starts and ends alphanumeric)
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")
REMOTE_SCHEMES = ("hf", "s3")


class InvalidModelSource(ValueError):
    """A source string that names no place weights could come from."""


@dataclass(frozen=True)
class ModelSource:
    """A parsed source: `location` is the repo id, the bucket or the claim (or the local path);
    `path` the prefix in the bucket or the path in the claim; `revision` is the Hub's only."""

    scheme: str   # hf, s3, pvc, local or embedded
    location: str
    path: str = ""
    revision: str | None = None

    @property
    def remote(self) -> bool:
        """Fetched over the network into the local cache before it is loaded."""
        return self.scheme in REMOTE_SCHEMES

    @property
    def pinned(self) -> bool:
        """Names one immutable content: a full commit sha (a branch or tag can move)."""
        return self.revision is not None and is_commit_sha(self.revision)

    @property
    def display_name(self) -> str:
        """The name a client would use for this model (a repo id, as vLLM's served name is)."""
        if self.scheme == "hf":
            return self.location
        if self.scheme == "s3":
            return self.path.rstrip("/").rsplit("/", 1)[-1] or self.location
        return str(self)

    def __str__(self) -> str:
        if self.scheme in ("local", "embedded"):
            return self.location
        text = f"{self.scheme}://{self.location}" + (f"/{self.path}" if self.path else "")
        return text + (f"@{self.revision}" if self.revision else "")


def is_commit_sha(revision: str) -> bool:
    return bool(_COMMIT_SHA.match(revision))


def parse_model_source(text: str) -> ModelSource:
    """Parse a `--model` / `spec.model.source` string; raises InvalidModelSource with the rule broken."""
    if text == "embedded":
        return ModelSource("embedded", text)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return ModelSource("local", text)
    if scheme == "hf":
        repo, at, revision = rest.partition("@")
        if not _HF_REPO.match(repo):
            raise InvalidModelSource(f"model source {text!r}: expected hf://org/name[@revision] "
                                     f"(repo ids are letters, digits, '-', '_', '.'; at most one '/')")
        if at and not _HF_REVISION.match(revision):
            raise InvalidModelSource(f"model source {text!r}: the revision after '@' must be a branch, "
                                     "tag or commit sha")
        return ModelSource("hf", repo, revision=revision or None)
    if scheme == "s3":
        bucket, _, prefix = rest.partition("/")
        if not _S3_BUCKET.match(bucket):
            raise InvalidModelSource(f"model source {text!r}: expected s3://bucket[/prefix] with a valid "
                                     "bucket name (3-63 lowercase letters, digits, '.', '-')")
        if "@" in prefix:
            raise InvalidModelSource(f"model source {text!r}: s3:// sources take no @revision "
                                     "(pin a prefix that holds one version)")
        return ModelSource("s3", bucket, path=prefix.strip("/"))
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not claim:
            raise InvalidModelSource(f"model source {text!r}: expected pvc://claim[/path]")
        return ModelSource("pvc", claim, path=path.strip("/"))
    raise InvalidModelSource(f"model source {text!r}: unknown scheme {scheme!r} "
                             "(expected hf://, s3://, pvc://, a local path or 'embedded')")
