"""Named errors of the data plane. Bad input is a ValueError subclass and changes nothing."""

from __future__ import annotations

from rollout_recovery.errors import RecoveryError


class StoreError(Exception):
    """Base class of every data-plane error."""


class BadInputError(StoreError, ValueError):
    """The request itself is wrong; nothing was written."""


class InvalidKeyError(BadInputError):
    pass


class UnknownPartitionError(BadInputError):
    pass


class SchemaMismatchError(BadInputError):
    pass


class SchemaVersionError(BadInputError):
    pass


class BatchTooLargeError(BadInputError):
    pass


class SnapshotError(StoreError):
    """A snapshot could not be written, found or read."""


class SnapshotAborted(SnapshotError):
    """The attempt was aborted (or missed its deadline) before publication; nothing was
    published, and its unpublished directory is left for `gc`."""


class SnapshotCorruptError(SnapshotError):
    """A snapshot is partial or a file does not match its manifest; the error names the file."""


class OwnerFenced(SnapshotError, RecoveryError):
    """A newer controller claimed the snapshot root: this one stops without publishing or
    deleting anything (the message names the newer owner)."""


class OwnershipConflict(SnapshotError, RecoveryError):
    """Another controller claimed the same snapshot root at the same time."""
