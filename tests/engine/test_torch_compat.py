"""`_torch_compat.store_has_key` on every store type, through both of its branches, without waiting."""

import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from lightning_bagua.engine._torch_compat import store_has_key
from tests.distributed import free_port


class _StoreWithoutCheck:
    # The part of the Store API torch 2.2 has: no `check`, so `store_has_key` takes its compare_set branch.
    def __init__(self, store: dist.Store) -> None:
        self._store = store

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(key, expected, desired)


def _stores(tmp_path):
    return {
        "tcp": dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10)),
        "file": dist.FileStore(str(tmp_path / "store"), 1),
        "hash": dist.HashStore(),
    }


@pytest.mark.parametrize("kind", ["tcp", "file", "hash"])
@pytest.mark.parametrize("without_check", [False, True], ids=["check", "compare_set"])
def test_store_has_key_answers_at_once_and_creates_nothing(tmp_path, kind, without_check):
    store = dist.PrefixStore("reports", _stores(tmp_path)[kind])
    looked_at = _StoreWithoutCheck(store) if without_check else store
    keys_before = store.num_keys()
    started = time.monotonic()
    assert not store_has_key(looked_at, "rank1")  # type: ignore[arg-type]
    assert time.monotonic() - started < 1.0
    assert store.num_keys() == keys_before
    store.set("rank1", "RuntimeError: boom")
    assert store_has_key(looked_at, "rank1")  # type: ignore[arg-type]
    assert not store_has_key(looked_at, "rank0")  # type: ignore[arg-type]
    assert store.get("rank1") == b"RuntimeError: boom"
