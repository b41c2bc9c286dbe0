"""RolloutClient's HTTP plumbing against a local server that misbehaves the way uvicorn's keep-alive expiry
does: the connection is reset before a response."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from http.server import ThreadingHTTPServer

import pytest

from dapo_megatron.rollout.client import RolloutClient, RolloutError
from dapo_megatron.rollout.config import RolloutConfig
from tests.conftest import JsonHandler, local_http_server


class ResettingHandler(JsonHandler):
    """Resets the connection of the first `server.resets` requests (RST, no response), then answers."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.seen += 1  # type: ignore[attr-defined]
        if self.server.seen <= self.server.resets:  # type: ignore[attr-defined]
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True
            return
        self.reply_json({"ok": True})


@pytest.fixture
def server() -> Iterator[ThreadingHTTPServer]:
    with local_http_server(ResettingHandler, seen=0, resets=0) as httpd:
        yield httpd


def post(server: ThreadingHTTPServer) -> object:
    with RolloutClient(f"http://127.0.0.1:{server.server_address[1]}", RolloutConfig()) as client:
        return client._post(client.urls[0], "/abort_request", {"abort_all": True}, "abort_all", timeout=5)


def test_a_reset_connection_is_retried_once(server: ThreadingHTTPServer) -> None:
    server.resets = 1  # type: ignore[attr-defined]
    assert post(server) == {"ok": True}
    assert server.seen == 2  # type: ignore[attr-defined]


def test_a_second_reset_is_an_error_naming_the_request(server: ThreadingHTTPServer) -> None:
    server.resets = 2  # type: ignore[attr-defined]
    with pytest.raises(RolloutError, match=r"abort_all to http://127\.0\.0\.1:\d+ failed"):
        post(server)
    assert server.seen == 2  # type: ignore[attr-defined]
