"""The filesystem layer at the bottom of the data plane: every storage location (a local path or
a pyarrow.fs URI such as s3://) resolved to a filesystem and a path, URIs joined keeping their
query options, the one fsync seam that orders durability (a file's bytes, then its name in
its directory), and the create-only write (`create_only`: a hard link locally, a conditional
PUT on S3). Snapshots (`snapshot_io.py`, `retention.py`), the ownership log (`ownership.py`)
and the run's storage (`storage.py`) all build on it, so none needs another for a path, an
fsync or a create.
"""

from __future__ import annotations

import errno
import os
import uuid
from functools import lru_cache
from urllib.parse import urlsplit, urlunsplit

import pyarrow as pa
import pyarrow.fs as pafs

from rollout_recovery import faults
from rollout_recovery.data_plane.errors import SnapshotError


def resolve(uri: str, filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path or a pyarrow.fs URI (query options allowed).

    A given `filesystem` replaces the URI's own for the same path, so that tests can put a
    fault-injecting filesystem in front of the real one.
    """
    if "://" not in uri:
        fs, path = pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
        fs = faults.local_filesystem(fs)
    else:
        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (pa.ArrowInvalid, ValueError, OSError) as err:
            raise SnapshotError(f"cannot open {uri!r}: {err}") from None
    return (fs if filesystem is None else filesystem), path


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def child_uri(root_uri: str, name: str) -> str:
    """The URI of `name` under a root URI, keeping a URI's query options (e.g. an endpoint)."""
    if "://" not in root_uri:
        return os.path.join(os.path.abspath(os.path.expanduser(root_uri)), name)
    parts = urlsplit(root_uri)
    return urlunsplit(parts._replace(path=join(parts.path, name) if parts.path else "/" + name))


def _is_local(fs: pafs.FileSystem) -> bool:
    return isinstance(fs, pafs.LocalFileSystem)


def is_object_store(fs: pafs.FileSystem) -> bool:
    """Whether `fs` stores whole objects (a PUT is atomic and durable, there is no append and
    no cheap rename) rather than files on a disk, seeing through a fault-injecting wrapper."""
    handler = getattr(fs, "handler", None)
    if handler is not None and hasattr(handler, "object_store"):
        return bool(handler.object_store)
    return not _is_local(fs)


def _fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync(fs: pafs.FileSystem, path: str, directory: bool) -> None:
    """The one fsync seam: a handler that models durability (faultfs) records it, a local disk
    runs it, an object store needs none (an upload is durable once its stream closes)."""
    handler_fsync = getattr(getattr(fs, "handler", None), "fsync", None)
    if handler_fsync is not None:
        handler_fsync(path, directory)
    elif _is_local(fs):
        _fsync_path(path, directory)


def sync_file(fs: pafs.FileSystem, path: str) -> None:
    """Make a closed file's bytes durable; an error ends the snapshot attempt."""
    _sync(fs, path, directory=False)


def sync_dir(fs: pafs.FileSystem, path: str) -> None:
    """Make the names in a directory (creates, renames) durable."""
    _sync(fs, path, directory=True)


def make_dirs(fs: pafs.FileSystem, path: str) -> None:
    """Create `path` and any missing ancestors, each one's name made durable in its parent."""
    missing = []
    while path and fs.get_file_info(path).type == pafs.FileType.NotFound:
        missing.append(path)
        path = path.rsplit("/", 1)[0] if "/" in path.strip("/") else ""
    for new in reversed(missing):
        fs.create_dir(new, recursive=True)
        if "/" in new.strip("/"):
            sync_dir(fs, new.rsplit("/", 1)[0])


# ---------------------------------------------------------------------------- create-only


def create_only(fs: pafs.FileSystem, path: str, data: bytes) -> bool:
    """Create `path` with `data` unless the name exists: True when this call created it,
    False when it already existed (never overwritten). Durable on return (locally: the file
    and its directory are fsynced)."""
    handler_create = getattr(getattr(fs, "handler", None), "create_only", None)
    if handler_create is not None:
        return handler_create(path, data)
    if isinstance(fs, pafs.LocalFileSystem):
        return _create_local(path, data)
    if isinstance(fs, pafs.S3FileSystem):
        return _create_s3(fs, path, data)
    raise SnapshotError(
        f"no create-only write on {fs.type_name} filesystems: snapshot ownership (owner "
        "epochs) needs a local disk or S3 (put with If-None-Match)"
    )


def _create_local(path: str, data: bytes) -> bool:
    parent, name = path.rsplit("/", 1)
    tmp = f"{parent}/.{name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    sync_dir(pafs.LocalFileSystem(), parent)
    return True


@lru_cache(maxsize=16)
def _s3_client(settings: tuple[tuple[str, str], ...]):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    kw = dict(settings)
    endpoint = kw.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{kw.get('scheme') or 'https'}://{endpoint}"
    config = Config(signature_version=UNSIGNED) if kw.get("anonymous") == "True" else None
    return boto3.client(
        "s3",
        region_name=kw.get("region") or None,
        endpoint_url=endpoint,
        aws_access_key_id=kw.get("access_key") or None,
        aws_secret_access_key=kw.get("secret_key") or None,
        aws_session_token=kw.get("session_token") or None,
        config=config,
    )


def _create_s3(fs: pafs.S3FileSystem, path: str, data: bytes) -> bool:
    """One PUT with If-None-Match: *: S3 answers 412 when the key exists. The client is built
    from the settings pyarrow's filesystem was built with (credentials, endpoint, region)."""
    from botocore.exceptions import ClientError

    kwargs = fs.__reduce__()[1][0]
    keys = ("access_key", "secret_key", "session_token", "anonymous", "region", "scheme",
            "endpoint_override")  # fmt: skip
    client = _s3_client(tuple((k, str(kwargs.get(k) or "")) for k in keys))
    bucket, _, key = path.lstrip("/").partition("/")
    for _ in range(5):
        try:
            client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as err:
            code = err.response.get("Error", {}).get("Code", "")
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                return False
            if code == "ConditionalRequestConflict" or status == 409:
                continue  # a concurrent conditional write to the key: ask again
            raise OSError(errno.EIO, f"create-only put of s3://{path} failed: {err}") from None
    raise OSError(errno.EIO, f"create-only put of s3://{path} kept conflicting")
