"""The data plane's authentication and encryption: ZMQ CURVE with one keypair for the whole cluster.

The control plane generates the keypair (controlplane.topology: a new version per rotation) and
exports it to each host as a key file (`manage.py export_data_plane_key FILE`). Every process that
speaks ZMQ over the network loads that file once, at start, and hands the key to the code that makes
its sockets; every socket is bound or connected through `bind` / `connect` here, which apply one rule:

- ipc:// and inproc:// sockets stay plain: they are local, and the file system guards them.
- With a key, every other endpoint (tcp://, loopback included) is CURVE: servers (the worker's
  ROUTER, PUB and PULL, the registry's ROUTER) use the keypair as their own; clients (the gateway's
  DEALER and SUB, the control DEALER, the prefill PUSH, the registry's SUB, the registration DEALER)
  present it as theirs and expect it as the server's. The ZAP handler on each server's context admits
  only clients whose public key is the cluster's, so holding the secret key is what membership means:
  a client that knows only the public key cannot finish the handshake, one with another keypair is
  refused, one without CURVE never gets past the greeting. Traffic is encrypted either way.
- Without a key, only loopback tcp:// is allowed (tests, development); anything else raises
  CurveError, which a process reports as its one line at start.

The key file is ZMQ's certificate format (zmq.auth.load_certificate reads it), with the version in
its metadata.
"""

import ipaddress
import logging
import os
import re
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

log = logging.getLogger(__name__)

KEY_FILE_VARIABLE = "SLUICE_CURVE_KEY_FILE"
HOW_TO_GET_KEYS = (
    "create the cluster's key with `python manage.py create_data_plane_key`, write it to a file with "
    "`python manage.py export_data_plane_key FILE` and give that file to the process "
    f"(--curve-key-file FILE or {KEY_FILE_VARIABLE}=FILE)"
)
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
_KEY_CHARS = 40  # a 32-byte key in Z85
_Z85 = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_FIELD = re.compile(r'^\s*(public-key|secret-key|version)\s*=\s*"([^"\n]*)"\s*$', re.MULTILINE)
_MAX_REFUSALS_LOGGED = 1024  # distinct peer addresses whose refusals are logged (then silence)


class CurveError(ValueError):
    """A key file that cannot be used, or an endpoint that needs a key this process lacks."""


@dataclass(frozen=True, slots=True)
class CurveKey:
    """The cluster's keypair, as Z85 text (40 bytes each)."""

    version: int  # the control plane's version; 0: a certificate that names none
    public_key: bytes
    secret_key: bytes

    def __repr__(self) -> str:
        return f"CurveKey(version={self.version}, public_key={self.public_key!r})"  # never the secret

    @property
    def zap_domain(self) -> str:
        """The ZAP domain of the servers using this key: their context's handler admits this key there."""
        return f"sluice-{self.public_key.decode()}"


def generate_key(version: int) -> CurveKey:
    public_key, secret_key = zmq.curve_keypair()
    return CurveKey(version=version, public_key=public_key, secret_key=secret_key)


def key_file_text(key: CurveKey) -> str:
    return (
        f"#   sluice data-plane CURVE key, version {key.version}\n"
        "#   Secret: whoever holds this file can join the cluster's data plane. Keep it mode 0600.\n"
        "metadata\n"
        f'    version = "{key.version}"\n'
        "curve\n"
        f'    public-key = "{key.public_key.decode()}"\n'
        f'    secret-key = "{key.secret_key.decode()}"\n'
    )


def parse_key_file(text: str, source: str) -> CurveKey:
    """The key in a key file's text; CurveError naming `source` for anything but a whole valid key."""
    fields: dict[str, list[str]] = {}
    for name, value in _FIELD.findall(text):
        fields.setdefault(name, []).append(value)
    values = {}
    for name in ("public-key", "secret-key"):
        found = fields.get(name, [])
        if len(found) != 1:
            what = "no" if not found else "several"
            raise CurveError(f"CURVE key file {source}: {what} {name} line (truncated or not a key file?)")
        if not _Z85.fullmatch(found[0]):
            raise CurveError(f"CURVE key file {source}: {name} is not {_KEY_CHARS} characters of Z85")
        values[name] = found[0].encode()
    if zmq.curve_public(values["secret-key"]) != values["public-key"]:
        raise CurveError(f"CURVE key file {source}: the secret key does not belong to the public key")
    version = fields.get("version", ["0"])
    if len(version) != 1 or not version[0].isdigit():
        raise CurveError(f"CURVE key file {source}: version must be one whole number, got {version}")
    return CurveKey(version=int(version[0]), public_key=values["public-key"], secret_key=values["secret-key"])


def load_key_file(path: str | os.PathLike) -> CurveKey:
    """The key in the file at `path`; CurveError naming the file when it is missing or not a key."""
    try:
        raw = Path(path).read_bytes()
    except OSError as error:
        raise CurveError(f"CURVE key file {path}: cannot be read ({error.strerror}); {HOW_TO_GET_KEYS}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise CurveError(f"CURVE key file {path}: not text (garbage or not a key file)") from None
    key = parse_key_file(text, str(path))
    if Path(path).stat().st_mode & 0o077:
        log.warning("CURVE key file %s is readable by other users: keep it mode 0600", path)
    return key


def write_key_file(path: str | os.PathLike, key: CurveKey, *, overwrite: bool = False) -> None:
    """Write the key file, mode 0600. An existing file raises FileExistsError unless `overwrite`, when
    it is replaced at once (a reader sees the old file or the new one, never a part)."""
    path = Path(path)
    text = key_file_text(key).encode()
    if not overwrite:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(text)
        return
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def key_file_from_environment() -> str:
    """The key file this process was given through the environment ("" when none)."""
    return os.environ.get(KEY_FILE_VARIABLE, "")


def is_local(endpoint: str) -> bool:
    """ipc:// and inproc://: never CURVE."""
    return endpoint.startswith(("ipc://", "inproc://"))


def is_loopback(endpoint: str) -> bool:
    """A tcp:// endpoint on a loopback address (a wildcard, an interface or a host name is not, but
    "localhost" is)."""
    scheme, _, address = endpoint.partition("://")
    if scheme != "tcp":
        return False
    host = address.rpartition(";")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uses_curve(endpoint: str, key: CurveKey | None) -> bool:
    """Whether a socket at `endpoint` is CURVE in a process holding `key`; CurveError when the endpoint
    reaches past this host and there is no key."""
    if is_local(endpoint):
        return False
    if key is not None:
        return True
    if is_loopback(endpoint):
        return False
    raise CurveError(f"refusing {endpoint} without the cluster's CURVE key: {HOW_TO_GET_KEYS}")


def check_endpoints(endpoints: list[str], key: CurveKey | None) -> None:
    """CurveError for the first endpoint `uses_curve` refuses: call at start, before slow work."""
    for endpoint in endpoints:
        uses_curve(endpoint, key)


def bind(socket: zmq.Socket, endpoint: str, key: CurveKey | None) -> None:
    """Bind `socket` at `endpoint`, as a CURVE server admitting only the cluster's key where the rule
    says so. A socket is bound once (the CURVE options stay on it)."""
    if uses_curve(endpoint, key):
        _zap_handler(socket.context).admit(key)
        socket.curve_secretkey = key.secret_key
        socket.curve_publickey = key.public_key
        socket.curve_server = True
        socket.zap_domain = key.zap_domain.encode()
    socket.bind(endpoint)


def connect(socket: zmq.Socket, endpoint: str, key: CurveKey | None) -> None:
    """Connect `socket` to `endpoint`, as a CURVE client where the rule says so. libzmq takes a
    connection's security options when it is made, so one socket may connect to CURVE and plain
    endpoints (the registry's SUB follows tcp:// and ipc:// workers)."""
    if uses_curve(endpoint, key):
        socket.curve_secretkey = key.secret_key
        socket.curve_publickey = key.public_key
        socket.curve_serverkey = key.public_key
    elif socket.mechanism != zmq.NULL:
        socket.curve_server = False  # back to the NULL mechanism for the connections made from now on
    socket.connect(endpoint)


class _ZapHandler:
    """A context's ZAP handler: libzmq asks it about each CURVE handshake on the context's server
    sockets, and it admits a client whose public key is the one of the server's domain.

    Its socket is made outside `context.socket()`, so Context.destroy() does not close it under the
    thread (not thread-safe); the thread closes it when the context terminates (ETERM), so term() and
    destroy() finish with no stop of their own."""

    def __init__(self, context: zmq.Context) -> None:
        self._admitted: dict[bytes, bytes] = {}  # ZAP domain → the raw 32-byte public key it admits
        self._lock = threading.Lock()
        self._refusals_logged: set[bytes] = set()
        socket = zmq.Socket(context, zmq.REP)
        socket.linger = 0
        socket.bind(ZAP_ENDPOINT)
        threading.Thread(target=self._serve, args=(socket,), name="curve-zap", daemon=True).start()

    def admit(self, key: CurveKey) -> None:
        with self._lock:
            self._admitted[key.zap_domain.encode()] = z85.decode(key.public_key)

    def _serve(self, socket: zmq.Socket) -> None:
        try:
            while True:
                socket.send_multipart(self._answer(socket.recv_multipart()))
        except zmq.ContextTerminated:
            socket.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id, domain, address, _identity, mechanism, *credentials = request
        with self._lock:
            admitted = self._admitted.get(domain)
        if mechanism == b"CURVE" and admitted is not None and credentials == [admitted]:
            return [version, request_id, b"200", b"OK", b"cluster", b""]
        if address not in self._refusals_logged and len(self._refusals_logged) < _MAX_REFUSALS_LOGGED:
            self._refusals_logged.add(address)
            log.warning("refused a %s client from %s: not the cluster's key", mechanism.decode(), address.decode())
        return [version, request_id, b"400", b"not the cluster's key", b"", b""]


_zap_handlers: "weakref.WeakKeyDictionary[zmq.Context, _ZapHandler]" = weakref.WeakKeyDictionary()
_zap_handlers_lock = threading.Lock()


def _zap_handler(context: zmq.Context) -> _ZapHandler:
    """The context's handler, started on its first CURVE server (libzmq allows one per context)."""
    with _zap_handlers_lock:
        handler = _zap_handlers.get(context)
        if handler is None:
            handler = _zap_handlers[context] = _ZapHandler(context)
        return handler
