"""vLLM's HTTP flags on a real ``widellm serve``: TLS with a self-signed certificate made here,
CORS preflights, --root-path, --enable-log-requests with --max-log-len, all given partly
through --config FILE.yaml (whose values the command line overrides). One server start."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess

import httpx
import pytest

from tests.e2e.server_harness import MODEL_ARCH, REQUEST_TIMEOUT_S, SERVED_NAME, ServerProcess

ROOT_PATH = "/widellm"
ORIGIN = "https://app.example"
OTHER_ORIGIN = "https://elsewhere.example"
MAX_LOG_LEN = 5
PROMPT = "Hello world, how are you"
# The file says 1; ServerProcess passes --max-n 4 on the command line, which must win.
FILE_MAX_N = 1
CERT_DAYS = "1"
BOUND_HTTPS = re.compile(r"https://127\.0\.0\.1:(\d+)(?= \(OpenAI)")
CONFIG_YAML = f"""\
served-model-name: [{SERVED_NAME}]
allowed_origins: ["{ORIGIN}"]
allow-credentials: true
root-path: {ROOT_PATH}
enable-log-requests: true
max-log-len: {MAX_LOG_LEN}
max-n: {FILE_MAX_N}
"""


class TLSServer(ServerProcess):
    bound_url = BOUND_HTTPS

    def __init__(self, *args, cafile: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tls = ssl.create_default_context(cafile=cafile)

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health", verify=self.tls, timeout=1.0).status_code == 200


def _self_signed(folder) -> tuple[str, str]:
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key, "-out", cert,
                    "-days", CERT_DAYS, "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder)
    config = folder / "serve.yaml"
    config.write_text(CONFIG_YAML)
    proc = TLSServer(model_dir(MODEL_ARCH), folder / "server.log",
                     ["--config", str(config), "--ssl-certfile", cert, "--ssl-keyfile", key,
                      "--disable-log-stats"], cafile=cert)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server.url, verify=server.tls,
                      timeout=REQUEST_TIMEOUT_S) as c:
        yield c


def test_https_with_the_self_signed_certificate(server, client):
    assert server.url.startswith("https://")
    models = client.get("/v1/models")
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [SERVED_NAME]
    with pytest.raises(httpx.TransportError):  # no plain HTTP on a TLS port
        httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5.0)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(server.url + "/health", timeout=5.0)  # the system CAs do not trust it


def test_root_path_serves_with_and_without_the_prefix(client):
    assert client.get(ROOT_PATH + "/v1/models").json() == client.get("/v1/models").json()
    schema = client.get("/openapi.json").json()
    assert schema["servers"] == [{"url": ROOT_PATH}]
    assert "/v1/completions" in schema["paths"]
    assert f"'{ROOT_PATH}/openapi.json'" in client.get("/docs").text


def test_cors_preflight_and_response_headers(client):
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert preflight.headers["access-control-allow-headers"] == "authorization,content-type"
    refused = client.options("/v1/chat/completions", headers={
        "Origin": OTHER_ORIGIN, "Access-Control-Request-Method": "POST"})
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers
    simple = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in client.get("/v1/models").headers


def test_requests_are_logged_cut_to_max_log_len_and_the_command_line_wins(server, client):
    response = client.post("/v1/completions", json={
        "model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 2, "n": 2,
        "temperature": 0.0})
    assert response.status_code == 200, response.text  # n=2 > the file's max-n 1: CLI won
    engine_id = response.json()["id"] + "-0"  # the engine's id of the request's first prompt
    line = next(x for x in server.log().splitlines() if f"received request {engine_id}:" in x)
    assert line.endswith(f"prompt: {PROMPT[:MAX_LOG_LEN]!r}")
    assert re.search(rf"received request {engine_id}: \d+ prompt tokens, params: "
                     r"SamplingParams\(n=2,", line), line
