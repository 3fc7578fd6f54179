"""daemon/http/server.py against a real `moed serve`: the listeners and who may use them (TCP names
only, the unix socket's mode and paths, MOED_API_KEY), the bind rules of MOED_HTTP_HOST, bodies
too large or malformed, a full queue, and a client that goes away mid-generation."""

from __future__ import annotations

import os
import socket
import stat

import httpx
import pytest

from daemon.errors import ConfigError
from daemon.http.server import http_socket_path, is_loopback, parse_host

from .conftest import free_port

pytestmark = pytest.mark.slow


def unix(d) -> httpx.Client:
    return httpx.Client(base_url="http://moed", transport=httpx.HTTPTransport(uds=d.http_socket), timeout=60)


def tcp(d, **kw) -> httpx.Client:
    return httpx.Client(base_url=d.url, timeout=60, **kw)


# greedy from "The", the fixture runs ~1700 tokens (about a second) before its end-of-generation token
LONG = {"model": "tiny", "prompt": "The", "raw": True, "options": {"num_predict": 100000, "temperature": 0}}


# -- plain functions ----------------------------------------------------------------------------

def test_parse_host_takes_ollamas_forms():
    assert parse_host("127.0.0.1:11434") == ("127.0.0.1", 11434)
    assert parse_host("http://0.0.0.0:8080/") == ("0.0.0.0", 8080)
    assert parse_host("localhost") == ("localhost", 11434)
    assert parse_host(":9000") == ("127.0.0.1", 9000)
    assert parse_host("[::1]:9000") == ("::1", 9000)
    assert parse_host("off") is None
    for bad in ("host:port", "h:70000", "[::1"):
        with pytest.raises(ConfigError, match="MOED_HTTP_HOST"):
            parse_host(bad)


def test_loopback_and_the_socket_beside_moeds():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.com")
    assert http_socket_path("/run/user/1/moed.sock") == "/run/user/1/moed-http.sock"
    assert http_socket_path("/tmp/x/sock") == "/tmp/x/sock-http.sock"


# -- listeners ----------------------------------------------------------------------------------

def test_the_unix_socket_is_private_and_takes_paths(daemon):
    assert stat.S_IMODE(os.stat(daemon.http_socket).st_mode) == 0o600
    with unix(daemon) as c:
        r = c.post("/api/generate", json={"model": daemon.model, "prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 2, "temperature": 0}})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 2 and r.json()["model"] == daemon.model


def test_tcp_takes_names_never_paths(daemon):
    with tcp(daemon) as c:
        for path, body in (("/api/generate", {"model": daemon.model, "prompt": "Hi"}),
                           ("/v1/chat/completions",
                            {"model": daemon.model, "messages": [{"role": "user", "content": "x"}]}),
                           ("/api/show", {"model": "/etc/passwd"})):
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["error"]
            assert "never given as a path" in message


def test_model_management_over_tcp_needs_the_api_key(daemon):
    with tcp(daemon) as c:
        r = c.post("/api/copy", json={"source": "tiny", "destination": "copied"})
        assert r.status_code == 403 and "MOED_API_KEY" in r.json()["error"]
        r = c.request("DELETE", "/api/delete", json={"model": "tiny"})
        assert r.status_code == 403
    assert (daemon.models / "tiny.gguf").exists() and not (daemon.models / "copied.gguf").exists()


def test_copy_and_delete_with_the_key(start_daemon):
    d = start_daemon({"MOED_API_KEY": "s3cret"})
    with tcp(d) as c:
        assert c.post("/api/copy", json={"source": "tiny", "destination": "copied"}).status_code == 401
        bearer = {"Authorization": "Bearer s3cret"}
        wrong = {"Authorization": "Bearer nope"}
        assert c.post("/api/copy", json={"source": "tiny", "destination": "copied"}, headers=wrong).status_code == 401
        r = c.post("/api/copy", json={"source": "tiny", "destination": "copied"}, headers=bearer)
        assert r.status_code == 200, r.text
        link = d.models / "copied.gguf"
        assert link.is_symlink() and os.path.samefile(link, d.model)
        names = [m["name"] for m in c.get("/api/tags").json()["models"]]
        assert names == ["copied:latest", "tiny:latest"]
        # a generation needs no key on loopback
        r = c.post("/api/generate", json={"model": "copied", "prompt": "Hi", "stream": False,
                                          "options": {"num_predict": 1}})
        assert r.status_code == 200, r.text
        r = c.request("DELETE", "/api/delete", json={"model": "copied"}, headers=bearer)
        assert r.status_code == 200, r.text
        assert not link.exists() and os.path.exists(d.model)  # the link went, never the file


def test_a_non_loopback_bind_needs_the_key_for_everything(start_daemon):
    port = free_port()
    d = start_daemon({"MOED_HTTP_HOST": f"0.0.0.0:{port}", "MOED_API_KEY": None}, wait=False)
    assert d.proc.wait(60) == 1
    assert "MOED_API_KEY" in d.log and "loopback" in d.log
    d = start_daemon({"MOED_HTTP_HOST": f"0.0.0.0:{port}", "MOED_API_KEY": "k"})
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        r = c.get("/api/tags")
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/api/tags", headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_busy_port_asked_for_is_an_error(start_daemon):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        d = start_daemon(port=port, wait=False)
        assert d.proc.wait(60) == 1
    assert "MOED_HTTP_HOST" in d.log and f"127.0.0.1:{port}" in d.log
    assert not os.path.exists(d.socket)  # it let go of its own socket too


def test_a_busy_default_port_leaves_tcp_off_with_a_warning(start_daemon):
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 11434))
        holder.listen()
    except OSError:  # something (an Ollama) holds it already: busy all the same
        holder.close()
        holder = None
    try:
        d = start_daemon({"MOED_HTTP_HOST": None})
        assert "11434 is in use" in d.log and "HTTP over TCP is off" in d.log
        with unix(d) as c:  # HTTP on the unix socket stays on
            assert c.get("/api/version").status_code == 200
    finally:
        if holder is not None:
            holder.close()


def test_http_off_still_serves_the_unix_socket(start_daemon):
    d = start_daemon({"MOED_HTTP_HOST": "off"})
    with unix(d) as c:
        assert c.get("/api/tags").json()["models"][0]["name"] == "tiny:latest"
    assert "HTTP (Ollama's" not in d.log


# -- bad requests -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/generate", "/v1/completions"])
def test_bad_bodies_get_400_in_the_apis_shape(daemon, path):
    openai = path.startswith("/v1")

    def message(r):
        body = r.json()
        return body["error"]["message"] if openai else body["error"]

    with tcp(daemon) as c:
        r = c.post(path, content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in message(r)
        r = c.post(path, json={"model": "tiny", "prompt": "x", "stream": "yes"})
        assert r.status_code == 400 and "stream" in message(r)
        r = c.post(path, json={"prompt": "x"})
        assert r.status_code == 400 and "model is required" in message(r)
        r = c.post(path, json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and "nope" in message(r)
        r = c.post(path, json={"model": "bad name!", "prompt": "x"})
        assert r.status_code == 400
        r = c.post(path, content=b"x" * (17 * 2**20))
        assert r.status_code == 413 and "MOED_MAX_FRAME" in message(r)
    if openai:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_routes_and_methods_answer_in_shape(daemon):
    with tcp(daemon) as c:
        r = c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        r = c.get("/api/generate")
        assert r.status_code == 405 and isinstance(r.json()["error"], str)
        r = c.post("/api/pull", json={"model": "llama3"})
        assert r.status_code == 400 and "moed import" in r.json()["error"]


def test_a_full_queue_is_503(start_daemon):
    d = start_daemon({"MOED_QUEUE_SIZE": "1"})
    with tcp(d) as c, c.stream("POST", "/api/generate", json=LONG) as running:
        lines = running.iter_lines()  # kept: a dropped iterator closes the response, and so the request
        next(lines)  # decoding
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
        assert r.status_code == 503 and "MOED_QUEUE_SIZE" in r.json()["error"]
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert sum(1 for _ in lines) > 100  # the first went on meanwhile
