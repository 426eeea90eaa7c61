"""`s3://bucket/prefix`: the objects under a prefix of any S3-compatible store, through MinIO's
Python SDK (`minio`, Apache-2.0; boto3's botocore pins python-dateutil<3, which the kubernetes
client we need cannot take).

AWS's standard environment applies: the endpoint from `AWS_ENDPOINT_URL_S3` or
`AWS_ENDPOINT_URL` (unset: AWS), credentials from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`
/ `AWS_SESSION_TOKEN`, else `~/.aws/credentials` (`AWS_PROFILE`), else web identity (IRSA) or
the instance/ECS role (`AWS_EC2_METADATA_DISABLED=true` skips the metadata service); region from
`AWS_REGION` / `AWS_DEFAULT_REGION`.

A bucket has no commits, so the revision is a digest of the listing (each object's key, size and
ETag): the same objects give the same cache entry, and a changed object a new one. Each object is
fetched with one GET conditional on the listed ETag (If-Match) and checked by size and, for
single-part uploads, by its ETag (the MD5).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from . import errors
from .cache import write_checked
from .hub import WEIGHT_SUFFIXES
from .uri import ModelSource

_CHUNK = 1 << 20
_PLAIN_MD5_ETAG = re.compile(r"^[0-9a-f]{32}$")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
           "AllAccessDisabled"}


@dataclass(frozen=True)
class RemoteObject:
    name: str   # the key below the prefix
    key: str
    size: int
    etag: str


def repo_cache_name(source: ModelSource) -> str:
    return f"s3--{source.location}" + (f"--{source.path.replace('/', '--')}" if source.path else "")


@contextmanager
def _s3_errors(source: ModelSource, endpoint: str) -> Iterator[None]:
    from minio.error import MinioException, S3Error
    from urllib3.exceptions import HTTPError

    try:
        yield
    except S3Error as error:
        if error.code == "NoSuchBucket":
            raise errors.NotFound(f"bucket {source.location!r} not found at {endpoint}") from error
        if error.code == "NoSuchKey":
            raise errors.NotFound(f"{source}: an object listed a moment ago is gone ({error})") from error
        if error.code in _DENIED:
            raise errors.AccessDenied(f"{endpoint} refused access to {source} ({error.code}): check the AWS "
                                      "credentials") from error
        if error.code == "PreconditionFailed":
            raise errors.DataCorrupt(f"{source}: an object changed while it was fetched; retry") from error
        raise errors.Unreachable(f"{endpoint} failed for {source}: {error}") from error
    except ValueError as error:   # minio's credential providers: none of them found a key
        if "credentials" not in str(error):
            raise
        raise errors.AccessDenied(f"no usable AWS credentials for {source} ({error}): set AWS_ACCESS_KEY_ID "
                                  "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / a role)") from error
    except (MinioException, HTTPError) as error:
        raise errors.Unreachable(f"cannot reach {endpoint} for {source} ({error})") from error


def client() -> Any:
    """A client for the endpoint and credentials AWS's environment variables name."""
    from minio import Minio
    from minio.credentials import AWSConfigProvider, ChainedProvider, EnvAWSProvider, IamAwsProvider

    endpoint = urlsplit(endpoint_url())
    providers = [EnvAWSProvider(), AWSConfigProvider()]
    if os.environ.get("AWS_EC2_METADATA_DISABLED", "").lower() != "true":
        providers.append(IamAwsProvider())
    return Minio(endpoint.netloc, secure=endpoint.scheme == "https", credentials=ChainedProvider(providers),
                 region=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None)


def endpoint_url() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://s3.amazonaws.com"


def resolve(source: ModelSource, s3: Any) -> tuple[str, list[RemoteObject]]:
    """(listing digest, objects) of the prefix; NotFound if nothing loadable is there."""
    endpoint = endpoint_url()
    prefix = f"{source.path}/" if source.path else ""
    objects = []
    with _s3_errors(source, endpoint):
        for item in s3.list_objects(source.location, prefix=prefix, recursive=True):
            name = item.object_name[len(prefix):]
            if name and not item.is_dir and not name.endswith("/"):   # "folder" markers hold nothing
                objects.append(RemoteObject(name, item.object_name, item.size, (item.etag or "").strip('"')))
    if not objects:
        raise errors.NotFound(f"no objects under {source} at {endpoint}")
    if not any(o.name.endswith(WEIGHT_SUFFIXES) for o in objects):
        raise errors.NotFound(f"no weights (.safetensors or .gguf) under {source} at {endpoint}; found "
                              f"{', '.join(sorted(o.name for o in objects)[:8])}")
    listing = json.dumps(sorted((o.name, o.size, o.etag) for o in objects)).encode()
    return hashlib.sha256(listing).hexdigest()[:40], objects


def download(source: ModelSource, objects: list[RemoteObject], partial: Path, s3: Any) -> int:
    endpoint = endpoint_url()
    total = 0
    for item in objects:
        if (partial / item.name).is_file():   # checked by an attempt that was killed later
            continue
        with _s3_errors(source, endpoint):
            response = s3.get_object(source.location, item.key, request_headers={"If-Match": f'"{item.etag}"'})
            try:
                md5 = hashlib.md5(usedforsecurity=False) if _PLAIN_MD5_ETAG.match(item.etag) else None

                def chunks() -> Iterator[bytes]:
                    for chunk in response.stream(_CHUNK):
                        if md5 is not None:
                            md5.update(chunk)
                        yield chunk

                def verify(size: int, item: RemoteObject = item) -> None:
                    if size != item.size:
                        raise errors.DataCorrupt(f"{source}: {item.name} is {size} bytes, the listing says "
                                                 f"{item.size}")
                    if md5 is not None and md5.hexdigest() != item.etag:
                        raise errors.DataCorrupt(f"{source}: {item.name} does not match its ETag (MD5 "
                                                 f"{md5.hexdigest()} != {item.etag})")

                total += write_checked(partial, item.name, chunks(), verify)
            finally:
                response.close()
                response.release_conn()
    return total

