"""Digest vectors: computed once, checked in. A change here breaks every staged prefix."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from rollout_recovery.data_plane.digest import (
    CHAIN_ROOT,
    chain_digest,
    chain_digests,
    token_digest,
)

VECTORS = {
    (): "5df18fcf800490a117d893169cf14998d05113bed847c9b3e750f1a2e9202140",
    (1, 2, 3): "d8b4511cf8dfbe3b2ea6224b242b52b43474e5205b1aea35b1c36d78915a508d",
    (0, 2**31 - 1, 65): "ebc3f778a12ace760d8f475f23010a5976c2dbc53ee4689af53fd1a5c39cdc1f",
}
CHAIN = (
    [[5, 6], [7], []],
    [
        "c3d9c64b5faa358961dc0171eefaf86d846ee63702bf52e8bdcb7f278b0c70b3",
        "ac09824471a1a876744f50737c1c6eb3c92ea6f86b6218054d55a9679774d738",
        "91b9efe65abe1d8e172d325fcfd6349c6e52e9c9806434f1f273540516c9cf9d",
    ],
)


@pytest.mark.parametrize(("ids", "hexdigest"), VECTORS.items())
def test_token_digest_vectors(ids, hexdigest):
    assert token_digest(list(ids)).hex() == hexdigest
    assert token_digest(np.array(ids, dtype=np.int64)).hex() == hexdigest


def test_token_digest_is_the_documented_construction():
    ids = [1, 2, 3]
    expected = hashlib.sha256(
        b"rollout_recovery/tokens/v1\x00" + struct.pack("<Q", 3) + struct.pack("<3i", *ids)
    ).hexdigest()
    assert token_digest(ids).hex() == expected


def test_chain_vectors_and_construction():
    deltas, hexes = CHAIN
    assert [d.hex() for d in chain_digests(deltas)] == hexes
    first = hashlib.sha256(
        b"rollout_recovery/chunk/v1\x00"
        + bytes(32)
        + struct.pack("<Q", 2)
        + struct.pack("<2i", 5, 6)
    ).hexdigest()
    assert first == hexes[0]


def test_chain_depends_on_split_order_and_content():
    whole = chain_digest(CHAIN_ROOT, [5, 6, 7])
    split = chain_digests([[5, 6], [7]])[-1]
    assert whole != split  # the chain commits to chunk boundaries
    assert chain_digests([[7], [5, 6]])[-1] != split
    assert chain_digests([[5, 6], [8]])[-1] != split
    # Length prefix: no two splits collide by concatenation.
    assert token_digest([1, 2]) != token_digest([1, 2, 0])


def test_bad_token_ids_are_refused():
    with pytest.raises(ValueError):
        token_digest([-1])
    with pytest.raises(ValueError):
        token_digest([2**31])
    with pytest.raises(ValueError):
        token_digest(np.array([1.5]))
    with pytest.raises(ValueError):
        chain_digest(b"short", [1])
