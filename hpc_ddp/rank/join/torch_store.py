"""The job's store as torch.distributed takes it: authstore.py's plain client wrapped as a
``torch.distributed.Store`` (init_process_group, PrefixStore and every user of a store take it
as they take a TCPStore), its errors as torch's (DistStoreError, DistNetworkError). Only the
processes that make a process group import this; a supervisor holds the plain client.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from hpc_ddp.rank.join.authstore import StoreServer
from hpc_ddp.rank.join.store_client import StoreClient, StoreLost

T = TypeVar("T")

# Every store made, for the life of the process: torch holds a Python store only by its C++
# part (a PrefixStore's inner store, the process group's), and once the Python object is
# collected its methods are gone ("Tried to call pure virtual function"). A process makes a
# handful; they close with it.
_ALIVE: list[AuthStore] = []


class AuthStore(dist.Store):  # type: ignore[misc]
    """store_client.StoreClient as a torch.distributed.Store: the same requests, torch's errors."""

    def __init__(self, host: str, port: int, key: str, timeout: timedelta,
                 connect_timeout_s: float = 10.0, server: StoreServer | None = None) -> None:
        super().__init__()
        self._client = StoreClient(host, port, key, timeout, connect_timeout_s, server)
        self.host, self.port = host, port
        super().set_timeout(timeout)
        _ALIVE.append(self)

    @classmethod
    def of(cls, client: StoreClient) -> AuthStore:
        """Another connection to ``client``'s store, as a torch store."""
        made = client.clone()
        store = cls.__new__(cls)
        dist.Store.__init__(store)
        store._client, store.host, store.port = made, made.host, made.port
        dist.Store.set_timeout(store, made.timeout)
        _ALIVE.append(store)
        return store

    def __repr__(self) -> str:
        return f"AuthStore({self.host}:{self.port})"

    def _do(self, request: Callable[[], T]) -> T:
        try:
            return request()
        except StoreLost as exc:
            raise dist.DistNetworkError(str(exc)) from None
        except RuntimeError as exc:  # StoreTimeout, StoreError
            raise dist.DistStoreError(str(exc)) from None

    def clone(self) -> AuthStore:
        """A second connection (a thread of its own: one request at a time per connection)."""
        return AuthStore.of(self._client)

    def set_timeout(self, timeout: timedelta) -> None:
        self._client.set_timeout(timeout)
        super().set_timeout(timeout)

    def set(self, key: str, value: bytes | str) -> None:
        self._do(lambda: self._client.set(key, value))

    def get(self, key: str) -> bytes:
        return self._do(lambda: self._client.get(key))

    def add(self, key: str, value: int) -> int:
        return self._do(lambda: self._client.add(key, value))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._do(lambda: self._client.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return self._do(lambda: self._client.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._do(lambda: self._client.wait(keys, timeout))

    def delete_key(self, key: str) -> bool:
        return self._do(lambda: self._client.delete_key(key))

    deleteKey = delete_key  # the names torch's C++ side calls (through PrefixStore)  # noqa: N815

    def num_keys(self) -> int:
        return self._do(self._client.num_keys)

    getNumKeys = num_keys  # noqa: N815

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._do(lambda: self._client.multi_get(keys))

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        self._do(lambda: self._client.multi_set(keys, values))

    def append(self, key: str, value: bytes | str) -> None:
        self._do(lambda: self._client.append(key, value))

    def has_extended_api(self) -> bool:
        return True

