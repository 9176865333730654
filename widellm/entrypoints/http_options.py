"""vLLM's HTTP-level flags of ``widellm serve``: CORS (``--allowed-origins`` ...), TLS
(``--ssl-*``, handed to uvicorn) and ``--root-path``. Kept apart from api_server.py so that
building the CLI parser imports neither FastAPI nor uvicorn."""

from __future__ import annotations

import argparse
import json
import ssl
from typing import Any

# Once CORS is on (--allowed-origins), methods and headers default to any, as vLLM's.
CORS_ANY = ["*"]
# --ssl-cert-reqs takes the ssl module's numbers: no client certificate, optional, required.
SSL_CERT_REQS = [int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)]
CORS_MODIFIERS = ("allowed_methods", "allowed_headers", "allow_credentials")
TLS_MODIFIERS = ("ssl_keyfile", "ssl_ca_certs")


def json_string_list(text: str) -> list[str]:
    """argparse ``type`` of the CORS flags: a JSON list of strings, e.g. '["GET", "POST"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); give a JSON list of strings, "
                                         f"e.g. '[\"https://example.com\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text}")
    return value


def add_http_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--root-path", type=str, default="",
                        help="the path prefix a proxy serves this server under: routes answer "
                             "with it (a proxy that forwards the prefix) and without it (one "
                             "that strips it), and the OpenAPI schema and /docs name it")
    parser.add_argument("--allowed-origins", type=json_string_list, default=None,
                        help='turn CORS on for these origins, as JSON: \'["*"]\' or '
                             '\'["https://app.example.com"]\' (default: off, so browsers refuse '
                             "other sites' calls; vLLM's default is every origin)")
    parser.add_argument("--allowed-methods", type=json_string_list, default=None,
                        help='CORS: the methods allowed, as JSON (default \'["*"]\'; needs '
                             "--allowed-origins)")
    parser.add_argument("--allowed-headers", type=json_string_list, default=None,
                        help='CORS: the request headers allowed, as JSON (default \'["*"]\'; '
                             "needs --allowed-origins)")
    parser.add_argument("--allow-credentials", action="store_true",
                        help="CORS: let browsers send cookies and Authorization headers "
                             "(needs --allowed-origins)")
    parser.add_argument("--ssl-certfile", type=str, default=None,
                        help="serve HTTPS with this PEM certificate (chain)")
    parser.add_argument("--ssl-keyfile", type=str, default=None,
                        help="the PEM private key of --ssl-certfile (default: inside it)")
    parser.add_argument("--ssl-ca-certs", type=str, default=None,
                        help="PEM CA certificates that client certificates are checked "
                             "against (with --ssl-cert-reqs)")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                        choices=SSL_CERT_REQS,
                        help="client certificates: 0 not asked for, 1 optional, 2 required "
                             "(Python's ssl.CERT_*; default %(default)s)")


def check_http_args(args: argparse.Namespace) -> None:
    """Refuse (ValueError) flags that would do nothing, and TLS files that cannot load, before
    the model loads: uvicorn would only find a bad key once the engine is up."""
    if args.root_path and not args.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    if args.allowed_origins is None:
        given = [name for name in CORS_MODIFIERS if getattr(args, name) not in (None, False)]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --allowed-origins "
                             f"(CORS is off without it)")
    if args.ssl_certfile is None:
        given = [name for name in TLS_MODIFIERS if getattr(args, name) is not None]
        if given or args.ssl_cert_reqs != int(ssl.CERT_NONE):
            flag = given[0] if given else "ssl_cert_reqs"
            raise ValueError(f"--{flag.replace('_', '-')} needs --ssl-certfile")
        return
    if args.ssl_cert_reqs != int(ssl.CERT_NONE) and args.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs needs --ssl-ca-certs to check client certificates "
                         "against")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: cannot load: {e}") \
            from None


class RootPathMiddleware:
    """Gives every request the ASGI ``root_path`` --root-path, as FastAPI's (now deprecated)
    ``root_path`` argument did and vLLM relies on. Starlette then routes ``/v1/models`` and
    ``/PREFIX/v1/models`` alike; uvicorn's own --root-path would instead prepend the prefix to
    every path, so a proxy that forwards the prefix would get 404s."""

    def __init__(self, app: Any, root_path: str) -> None:
        self.app = app
        self.root_path = root_path.rstrip("/")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def uses_tls(args: argparse.Namespace) -> bool:
    return args.ssl_certfile is not None


def uvicorn_tls_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (none without --ssl-certfile: plain HTTP)."""
    if not uses_tls(args):
        return {}
    return dict(ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)


def cors_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """CORSMiddleware's arguments, or None when CORS is off."""
    if args.allowed_origins is None:
        return None
    def or_any(value: list[str] | None) -> list[str]:
        return CORS_ANY if value is None else value

    return dict(allow_origins=args.allowed_origins, allow_methods=or_any(args.allowed_methods),
                allow_headers=or_any(args.allowed_headers),
                allow_credentials=args.allow_credentials)
