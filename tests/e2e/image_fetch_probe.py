"""The two sides of tests/e2e/test_image_ssrf_netns.py, each started in a network namespace of its own.

python -m tests.e2e.image_fetch_probe serve --bind ADDRESS --port PORT
    An HTTP server (the "public" one): /cat.png is a PNG, /redirect?to=URL a 302 to URL. Prints
    "ready" once listening, then one "hit PATH" line per request.

python -m tests.e2e.image_fetch_probe fetch --url URL --private-port PORT
    The gateway's side: starts a counting HTTP server on every address of its namespace at
    PORT (the "private" one: /secret.png is a PNG), resolves a Chat Completions body holding URL
    as an image part with recipe.images.resolve.resolve_images and the real address rule, and
    prints one JSON line: "fetched" (width, height) or "refused" (status, param, message), and
    "private_hits", the paths the private server was asked for.
"""

import argparse
import http.server
import io
import json
import sys
import threading
import urllib.parse

from PIL import Image

from recipe.api import ApiError, RequestLimits
from recipe.images.resolve import resolve_images


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), (200, 30, 90)).save(buffer, "PNG")
    return buffer.getvalue()


def start_server(bind: str, port: int, hits: list[str], *, redirects: bool) -> http.server.ThreadingHTTPServer:
    image = png()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            hits.append(self.path)
            if redirects:
                print(f"hit {self.path}", flush=True)
            url = urllib.parse.urlsplit(self.path)
            target = urllib.parse.parse_qs(url.query).get("to")
            if redirects and url.path == "/redirect" and target:
                self.send_response(302)
                self.send_header("location", target[0])
                self.send_header("content-length", "0")
                self.end_headers()
                return
            if url.path not in ("/cat.png", "/secret.png"):
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(image)))
            self.end_headers()
            self.wfile.write(image)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer((bind, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve(args: argparse.Namespace) -> None:
    server = start_server(args.bind, args.port, [], redirects=True)
    print("ready", flush=True)
    try:
        threading.Event().wait()
    finally:
        server.shutdown()


def fetch(args: argparse.Namespace) -> None:
    hits: list[str] = []
    server = start_server("0.0.0.0", args.private_port, hits, redirects=False)
    body = {
        "model": "any",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": args.url}},
                ],
            }
        ],
    }
    try:
        (image,) = resolve_images("chat.completions", body, RequestLimits(image_fetch_timeout_s=5))
        outcome = {"fetched": {"width": image.width, "height": image.height}}
    except ApiError as error:
        outcome = {"refused": {"status": error.status, "param": error.param, "message": error.message}}
    server.shutdown()
    print(json.dumps({**outcome, "private_hits": hits}), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sides = parser.add_subparsers(dest="side", required=True)
    public = sides.add_parser("serve")
    public.add_argument("--bind", required=True)
    public.add_argument("--port", type=int, required=True)
    gateway = sides.add_parser("fetch")
    gateway.add_argument("--url", required=True)
    gateway.add_argument("--private-port", type=int, required=True)
    args = parser.parse_args(argv)
    serve(args) if args.side == "serve" else fetch(args)


if __name__ == "__main__":
    main(sys.argv[1:])
