"""geventhttpclient's private names, used by the client, are checked on its first use, within the
range pyproject.toml pins."""

import pytest
from geventhttpclient import HTTPClient
from geventhttpclient.connectionpool import ConnectionPool
from geventhttpclient.response import HTTPSocketPoolResponse

from replay.protocol import gevent_pool
from replay.protocol.gevent_pool import require, self_check, tested_range


def without(cls, name):
    """A stand-in for `cls` lacking the class attribute `name` (the library's class is untouched)."""
    return type(cls.__name__, (), {k: v for k, v in vars(cls).items() if k != name})


class PoolWithoutQueue(ConnectionPool):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        del self._socket_queue


class ClientWithoutQueue(HTTPClient):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._connection_pool.__class__ = PoolWithoutQueue
        del self._connection_pool._socket_queue


class ResponseWithoutBuffer(HTTPSocketPoolResponse):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        del self._body_buffer


def test_installed_version_passes_and_is_in_the_pinned_range():
    assert self_check() is None
    tested = tested_range()
    assert tested == ">=2.6,<2.7"  # the pin, read from pyproject.toml: a new pin means checking gevent_pool again
    major, minor = (int(x) for x in gevent_pool.GEVENTHTTPCLIENT_VERSION.split(".")[:2])
    assert tested == f">={major}.{minor},<{major}.{minor + 1}"


def test_the_range_is_read_from_the_installed_distribution_without_a_checkout(monkeypatch, tmp_path):
    monkeypatch.setattr(gevent_pool, "PYPROJECT", tmp_path / "pyproject.toml")
    monkeypatch.setattr(gevent_pool.metadata, "requires", lambda name: ["orjson", "geventhttpclient <2.7, >=2.6",
                                                                        'pytest; extra == "test"'])
    gevent_pool.tested_range.cache_clear()
    try:
        assert tested_range() == "<2.7,>=2.6"
        monkeypatch.setattr(gevent_pool.metadata, "requires", lambda name: None)
        gevent_pool.tested_range.cache_clear()
        assert tested_range() == gevent_pool.UNKNOWN_RANGE
    finally:
        gevent_pool.tested_range.cache_clear()


@pytest.mark.parametrize("classes, name", [
    ({"pool_cls": without(ConnectionPool, "_create_socket")}, "ConnectionPool._create_socket()"),
    ({"pool_cls": without(ConnectionPool, "return_socket")}, "ConnectionPool.return_socket()"),
    ({"response_cls": without(HTTPSocketPoolResponse, "feed")}, "HTTPSocketPoolResponse.feed()"),
    ({"client_cls": ClientWithoutQueue, "pool_cls": PoolWithoutQueue}, "PoolWithoutQueue._socket_queue"),
    ({"response_cls": ResponseWithoutBuffer}, "ResponseWithoutBuffer._body_buffer"),
])
def test_a_missing_name_fails_loudly(classes, name):
    assert self_check(**classes) == name
    with pytest.raises(ImportError) as raised:
        require(**classes)
    message = str(raised.value)
    assert name in message
    assert f"geventhttpclient {gevent_pool.GEVENTHTTPCLIENT_VERSION}" in message
    assert f"geventhttpclient{tested_range()}" in message
