"""`s3://bucket/prefix`: the objects under a prefix of any S3-compatible store, through boto3.

boto3's standard configuration applies: the endpoint from `AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` (unset: AWS), credentials from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`
/ `AWS_SESSION_TOKEN`, `AWS_PROFILE`, web identity or instance roles, region from `AWS_REGION`.

A bucket has no commits, so the revision is a digest of the listing (each object's key, size and
ETag): the same objects give the same cache entry, and a changed object a new one. Each object is
fetched with one GET conditional on the listed ETag and checked by size and, for single-part
uploads, by its ETag (the MD5); boto3 checks a stored SHA-256/CRC checksum itself where the
object has one (`ChecksumMode`).
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from . import errors
from .cache import write_checked
from .hub import WEIGHT_SUFFIXES
from .uri import ModelSource

_CHUNK = 1 << 20
_PLAIN_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "401", "ExpiredToken",
           "InvalidToken", "AllAccessDisabled"}


@dataclass(frozen=True)
class RemoteObject:
    name: str   # the key below the prefix
    key: str
    size: int
    etag: str


def repo_cache_name(source: ModelSource) -> str:
    return f"s3--{source.location}" + (f"--{source.path.replace('/', '--')}" if source.path else "")


def _endpoint(client: Any) -> str:
    return client.meta.endpoint_url


@contextmanager
def _s3_errors(source: ModelSource, endpoint: str) -> Iterator[None]:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    try:
        yield
    except (NoCredentialsError, PartialCredentialsError) as error:
        raise errors.AccessDenied(f"no usable AWS credentials for {source} ({error}): set AWS_ACCESS_KEY_ID "
                                  "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / a role)") from error
    except ClientError as error:
        code = str(error.response.get("Error", {}).get("Code", ""))
        if code == "NoSuchBucket":
            raise errors.NotFound(f"bucket {source.location!r} not found at {endpoint}") from error
        if code in ("NoSuchKey", "404"):
            raise errors.NotFound(f"{source}: an object listed a moment ago is gone ({error})") from error
        if code in _DENIED:
            raise errors.AccessDenied(f"{endpoint} refused access to {source} ({code}): check the AWS "
                                      "credentials") from error
        if code in ("PreconditionFailed", "412"):
            raise errors.DataCorrupt(f"{source}: an object changed while it was fetched; retry") from error
        raise errors.Unreachable(f"{endpoint} failed for {source}: {error}") from error
    except BotoCoreError as error:
        raise errors.Unreachable(f"cannot reach {endpoint} for {source} ({error})") from error


def client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 5},
                                            connect_timeout=10, read_timeout=120))


def resolve(source: ModelSource, s3: Any) -> tuple[str, list[RemoteObject]]:
    """(listing digest, objects) of the prefix; NotFound if nothing loadable is there."""
    endpoint = _endpoint(s3)
    prefix = f"{source.path}/" if source.path else ""
    objects = []
    with _s3_errors(source, endpoint):
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=source.location, Prefix=prefix):
            for item in page.get("Contents", ()):
                name = item["Key"][len(prefix):]
                if name and not name.endswith("/"):   # "folder" marker objects hold nothing
                    objects.append(RemoteObject(name, item["Key"], item["Size"], item["ETag"].strip('"')))
    if not objects:
        raise errors.NotFound(f"no objects under {source} at {endpoint}")
    if not any(o.name.endswith(WEIGHT_SUFFIXES) for o in objects):
        raise errors.NotFound(f"no weights (.safetensors or .gguf) under {source} at {endpoint}; found "
                              f"{', '.join(sorted(o.name for o in objects)[:8])}")
    listing = json.dumps(sorted((o.name, o.size, o.etag) for o in objects)).encode()
    return hashlib.sha256(listing).hexdigest()[:40], objects


def download(source: ModelSource, objects: list[RemoteObject], partial: Path, s3: Any) -> int:
    endpoint = _endpoint(s3)
    total = 0
    for item in objects:
        if (partial / item.name).is_file():   # checked by an attempt that was killed later
            continue
        with _s3_errors(source, endpoint):
            body = s3.get_object(Bucket=source.location, Key=item.key, IfMatch=item.etag,
                                 ChecksumMode="ENABLED")["Body"]
            md5 = hashlib.md5(usedforsecurity=False) if _PLAIN_MD5_ETAG.match(item.etag) else None

            def chunks() -> Iterator[bytes]:
                for chunk in body.iter_chunks(_CHUNK):
                    if md5 is not None:
                        md5.update(chunk)
                    yield chunk

            def verify(size: int, item: RemoteObject = item) -> None:
                if size != item.size:
                    raise errors.DataCorrupt(f"{source}: {item.name} is {size} bytes, the listing says {item.size}")
                if md5 is not None and md5.hexdigest() != item.etag:
                    raise errors.DataCorrupt(f"{source}: {item.name} does not match its ETag (MD5 "
                                             f"{md5.hexdigest()} != {item.etag})")

            total += write_checked(partial, item.name, chunks(), verify)
    return total

