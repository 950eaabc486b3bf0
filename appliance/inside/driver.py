"""The in-jail driver: runs cells the way IPython does and reports over a pipe.

Runs inside the jail as `python -I -u driver.py`, standard library only. Channels:

- fd 0 at start: control messages from the server, one JSON object a line
  (`run`, `stdin`, `stdin_eof`, `interrupt`). Moved to a private fd at once; the
  code's own stdin becomes /dev/null and `input()` reads what `stdin` frames bring.
- fd 1 / fd 2: the code's stdout / stderr, raw, straight to the server.
- the fd named in argv[1]: events to the server, one JSON object a line (`ready`, `result`,
  `display`, `error`, `done`). Never inherited by the code's child processes.

Before any code runs it reports a self-check of its own jail (uid, no_new_privs,
seccomp, namespaces, interfaces); the server refuses to use a jail that fails it.
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import io
import json
import linecache
import os
import queue
import resource
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import CodeType
from typing import Any, Literal

# This file's own path as its code names it (which its frames carry): the driver also runs from
# its bytecode (`driver.pyc` beside it, compiled when the runtime is staged), as __file__ then.
DRIVER_FILE = os.path.abspath((lambda: None).__code__.co_filename)
# The runtime's root: this file is staged as <runtime>/appliance/inside/driver.py.
RUNTIME = os.path.dirname(os.path.dirname(os.path.dirname(DRIVER_FILE)))
if RUNTIME not in sys.path:
    # `python -I` puts no script directory on the path. The runtime holds appliance.inside (the
    # channel, the matplotlib backend, the tools' parts) and appliance.tools; it goes last, so
    # it shadows nothing of the interpreter's own.
    sys.path.append(RUNTIME)

from appliance.inside import channel, magics, notebook  # noqa: E402  (needs the runtime on the path, above)

MAX_TEXT_CHARS = 256 * 1024
MAX_IMAGE_BYTES = 8 * 1024 * 1024
REAP_S = 0.2  # longest wait for a cell's killed children to be reaped before its `done`

MIME_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
)


class Events:
    """Writes events to the server; serialised so threads cannot interleave lines."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self.pid = os.getpid()
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.Lock()

    def emit(self, event: channel.Event) -> None:
        """Send an event after the code's pending output, so the wire keeps program order."""
        if os.getpid() != self.pid:
            return  # a process the code forked is not the driver: it reports nothing
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # the code may have replaced its streams
                stream.flush()
        self.send(event)

    def send(self, event: channel.Event) -> None:
        if os.getpid() != self.pid:
            return
        line = channel.encode_event(event)
        with self._lock:
            view = memoryview(line)
            while view:
                written = os.write(self._fd, view)
                view = view[written:]


class EventStream(io.TextIOBase):
    """The code's sys.stdout / sys.stderr: line-buffered text sent as `stream` events.

    Going through the event pipe keeps print() output in program order with
    display/result/error events. Descriptor-level writes (C code, subprocesses,
    `.buffer`) still go straight to fd 1/2. A process the code forked is not the
    driver: its Python-level output goes to the descriptor directly.
    """

    CHUNK = 32768

    def __init__(self, events: Events, name: Literal["stdout", "stderr"], fd: int) -> None:
        self._events = events
        self._name = name
        self._fd = fd
        self._pending: list[str] = []
        self._lock = threading.RLock()
        self.buffer = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
        os.register_at_fork(after_in_child=self._reset_lock)

    def _reset_lock(self) -> None:
        self._lock = threading.RLock()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return "backslashreplace"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._fd

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            self._pending.append(text)
            if "\n" in text or sum(map(len, self._pending)) >= self.CHUNK:
                self.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if not self._pending:
                return
            text, self._pending = "".join(self._pending), []
        if os.getpid() != self._events.pid:
            os.write(self._fd, text.encode("utf-8", "backslashreplace"))
            return
        for start in range(0, len(text), self.CHUNK):
            event: channel.StreamEvent = {
                "ev": "stream",
                "name": self._name,
                "text": text[start : start + self.CHUNK],
            }
            self._events.send(event)


class StdinBuffer(io.TextIOBase):
    """The code's sys.stdin: fed by `stdin` frames, EOF when the client says so."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._buf = ""
        self._eof = False

    def feed(self, data: str) -> None:
        with self._cond:
            self._buf += data
            self._cond.notify_all()

    def close_input(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def readable(self) -> bool:
        return True

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        with self._cond:
            while "\n" not in self._buf and not self._eof:
                self._cond.wait()
            idx = self._buf.find("\n")
            end = len(self._buf) if idx < 0 else idx + 1
            if size is not None and size >= 0:
                end = min(end, size)
            line, self._buf = self._buf[:end], self._buf[end:]
            return line

    def read(self, size: int | None = -1) -> str:
        with self._cond:
            while not self._eof and (size is None or size < 0 or len(self._buf) < size):
                self._cond.wait()
            end = len(self._buf) if size is None or size < 0 else size
            data, self._buf = self._buf[:end], self._buf[end:]
            return data


class ImportClock:
    """Times what a cell spends loading modules its jail had not imported yet (the cost a
    warm jail of the right preload profile saves). Only the outermost import of the main
    thread counts; a module already loaded costs one dict lookup more."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._real = builtins.__import__
        self._main = threading.get_ident()
        self._depth = 0

    def install(self) -> None:
        builtins.__import__ = self._import

    def _import(
        self,
        name: str,
        globals: Any = None,
        locals: Any = None,  # the builtin's parameter names
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        if self._depth or (level == 0 and name in sys.modules) or threading.get_ident() != self._main:
            return self._real(name, globals, locals, fromlist, level)
        self._depth += 1
        started = time.perf_counter()
        try:
            return self._real(name, globals, locals, fromlist, level)
        finally:
            self._depth -= 1
            self.seconds += time.perf_counter() - started


class Cell:
    """A `run` op as the main thread takes it: code, uploads and the cell's own stdin."""

    def __init__(self, code: str, files: list[tuple[str, bytes]], stdin: StdinBuffer) -> None:
        self.code = code
        self.files = files
        self.stdin = stdin


Item = Cell | channel.CudaContextOp | channel.StateOp  # what the main thread does, in order


class ControlReader:
    """The control pipe, read in lines and exact byte counts through a buffer of its own, so
    that the main thread can tell whether it read past the first cell (`pending`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def pending(self) -> bool:
        return bool(self._buf)

    def readline(self) -> bytes:
        """One line with its newline; at EOF what is left (b"" when nothing is)."""
        start = 0
        while (end := self._buf.find(b"\n", start)) < 0:
            start = len(self._buf)
            chunk = os.read(self.fd, 65536)
            if not chunk:
                end = len(self._buf) - 1
                break
            self._buf += chunk
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        return line

    def read_exactly(self, size: int) -> bytes:
        """size bytes; EOFError if the pipe closes first (the server is gone)."""
        parts = [bytes(self._buf[:size])]
        del self._buf[:size]
        want = size - len(parts[0])
        while want > 0:
            chunk = os.read(self.fd, min(want, 1 << 20))
            if not chunk:
                raise EOFError
            parts.append(chunk)
            want -= len(chunk)
        return b"".join(parts)


class Driver:
    def __init__(self, control_fd: int, events: Events) -> None:
        self.events = events
        self.control = ControlReader(control_fd)
        # The reader thread sleeps here until the channel has a line for it or closes: the
        # main thread arms it for input as it hands the channel over, which wakes nobody
        # when nothing follows the first cell (a one-shot run): a thread woken for every run
        # costs the jail more CPU than 2% of a warm round trip (benchmarks/results/micro-opts.md).
        self.waker = select.epoll()
        self.waker.register(control_fd, 0)  # hang-ups only, until handed over
        self.doorbell = os.eventfd(0, os.EFD_CLOEXEC)
        self.waker.register(self.doorbell, select.EPOLLIN)
        # What the main thread runs, in order: SimpleQueue's get() is one lock, not a condition.
        self.runs: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        # Held until the main thread has read up to the first cell: the reader thread reads
        # from then on. A lock, not an Event: releasing it is one C call on the run's path.
        self.handed_over = threading.Lock()
        self.handed_over.acquire()
        self.stdin = StdinBuffer()
        self.first_stdin: StdinBuffer | None = StdinBuffer()
        self.in_user_code = False
        self.cell_count = 0
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        # What notebook lines (`!cmd`, `%pip install x`) call; a session keeps its installs.
        self.namespace[notebook.HOOK] = magics.Magics(self.namespace, os.environ)
        self.main_ident = threading.get_ident()
        self.imports = ImportClock()

    # -- control channel ----------------------------------------------------------------
    def take(self, raw: bytes) -> Item | None:
        """Act on one control line: stdin and interrupts at once; a `run` (its code and files
        follow on the pipe) or a `cuda_context` is returned for the main thread to do.
        EOFError when the pipe closed mid-message: the server is gone."""
        op = channel.parse_op(raw)
        if op is None:
            return None
        if op["op"] == "run":
            # The code and the files follow the header on the same pipe, exactly as counted.
            code, files = channel.read_run(op, self.control.read_exactly)
            # The cell's stdin is made here, in order with the stdin messages that follow; the
            # first cell's was made as the driver started, off the run's path.
            buffer, self.first_stdin = self.first_stdin or StdinBuffer(), None
            if op["stdin_eof"]:
                buffer.close_input()
            self.stdin = buffer
            return Cell(code, files, buffer)
        if op["op"] in ("cuda_context", "snapshot", "restore"):
            return op  # on the main thread, where the code runs (a GPU run's context: before it)
        if op["op"] == "stdin":
            self.stdin.feed(op["data"])
        elif op["op"] == "stdin_eof":
            self.stdin.close_input()
        elif op["op"] == "interrupt" and self.in_user_code:
            signal.pthread_kill(self.main_ident, signal.SIGINT)
        return None

    def first_cell(self) -> Cell | channel.StateOp | None:
        """Read the control channel on the main thread up to the first cell (None: it closed).

        A pooled jail's one run then starts where it was read, with no second thread to
        wake on the way (benchmarks/results/micro-opts.md). The reader thread takes the
        channel over as the cell starts (`hand_over`)."""
        try:
            for raw in iter(self.control.readline, b""):
                item = self.take(raw)
                if isinstance(item, Cell):
                    return item
                if item is None:
                    continue
                if item["op"] == "cuda_context":  # GPU jails: the run's CUDA context, before any code
                    self.events.emit(open_cuda_context(item["lib"]))
                elif item["op"] in ("snapshot", "restore"):  # a restored session's first step
                    return item
        except EOFError:
            pass
        return None

    def hand_over(self) -> None:
        """Give the control channel to the reader thread as the first cell starts, waking it
        only if it has something to read: the channel is armed for input (epoll wakes the
        reader when a line comes, at once if one is there), or, when the main thread read
        past the first cell into the buffer, its doorbell rings."""
        self.handed_over.release()
        if self.control.pending():
            os.eventfd_write(self.doorbell, 1)
        else:
            self.waker.modify(self.control.fd, select.EPOLLIN)

    def read_control(self) -> None:
        """The reader thread: every control line after the first cell's, so that stdin and
        interrupts reach a cell while it runs, and the channel's end (the server is gone)."""
        self.waker.poll()  # a line or the doorbell after `hand_over`; a hang-up at any time
        self.handed_over.acquire()  # (a hang-up before it: the main thread reads the EOF first)
        try:
            for raw in iter(self.control.readline, b""):
                item = self.take(raw)
                if item is not None:
                    self.runs.put(item)
        except EOFError:
            pass
        if self.in_user_code:
            # EOF mid-cell: the server is gone (killed) and can no longer enforce the wall
            # clock. End every process of this PID namespace and the jail with it.
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGKILL)
            os._exit(1)
        self.runs.put(None)

    # -- cells ---------------------------------------------------------------------------
    def serve(self) -> None:
        # The first cell's CPU baseline, read before the wait: nothing runs here until the
        # cell comes but a GPU run's CUDA context, which the cgroup counts to the run too.
        before: tuple[float, int] | None = _usage()
        item: Item | None = self.first_cell()
        self.hand_over()
        while item is not None:
            if isinstance(item, Cell):
                self.run(item, before or _usage())
            elif item["op"] == "cuda_context":
                self.events.emit(open_cuda_context(item["lib"]))
            else:
                self.state(item, before or _usage())
            before = None
            item = self.runs.get()

    def run(self, item: Cell, before: tuple[float, int]) -> None:
        sys.stdin = item.stdin
        self.imports.seconds = 0.0
        exit_code = 0
        try:
            write_uploads(item.files)
        except OSError as exc:
            self.events.emit(error_event(exc, skip_driver=False))
            exit_code = 1
        else:
            exit_code = self.run_cell(item.code)
        if os.getpid() != self.events.pid:
            os._exit(exit_code)  # a child the code forked fell out of its cell: end it here
        end_leftovers()
        after = _usage()
        self.events.emit(
            {
                "ev": "done",
                "exit_code": exit_code,
                "cpu_ms": int((after[0] - before[0]) * 1000),
                "max_rss_mb": round(after[1] / 1024, 1),
                "import_ms": int(self.imports.seconds * 1000),
            }
        )

    def state(self, op: channel.StateOp, before: tuple[float, int]) -> None:
        """A `snapshot` or `restore` op, reported like a cell: a `display` of SNAPSHOT_MIME
        with what was kept or restored (an `error` if it failed), then `done`. Pickling and
        unpickling run the objects' own code (__reduce__, __setstate__): it runs here, in the
        jail, as a cell's code does, interruptible and under the cell's limits."""
        exit_code = 0
        try:
            self.in_user_code = True
            try:
                # Imported here, not at the top: its tarfile, tempfile and pickle would add
                # to every jail's start, and few sessions ever take a snapshot.
                from appliance.inside import snapshot

                if op["op"] == "snapshot":
                    hook = self.namespace.get(notebook.HOOK)
                    paths = list(hook.paths) if isinstance(hook, magics.Magics) else []
                    report = snapshot.save(self.namespace, paths)
                else:
                    report = snapshot.restore(self.adopt)
            finally:
                self.in_user_code = False
            self.events.emit({"ev": "display", "data": {channel.SNAPSHOT_MIME: report}})
        except BaseException as exc:  # noqa: BLE001 (whatever stops it is reported as the op's error)
            self.in_user_code = False
            self.events.emit(error_event(exc, skip_driver=False))
            exit_code = 1
        end_leftovers()
        after = _usage()
        self.events.emit(
            {
                "ev": "done",
                "exit_code": exit_code,
                "cpu_ms": int((after[0] - before[0]) * 1000),
                "max_rss_mb": round(after[1] / 1024, 1),
                "import_ms": None,
            }
        )

    def adopt(self, namespace: dict[str, Any], paths: list[str]) -> None:
        """A restored namespace becomes the interpreter's: the very dict the restored functions
        have as their globals (appliance.inside.snapshot), with the driver's own names, and a
        notebook hook that knows the installs' paths (`%pip install` of the saved session)."""
        hook = magics.Magics(namespace, os.environ)
        hook.paths = list(paths)
        namespace.update({"__name__": "__main__", "__builtins__": builtins, notebook.HOOK: hook})
        self.namespace = namespace

    def run_cell(self, code: str) -> int:
        self.cell_count += 1
        filename = f"<cell-{self.cell_count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            body, last = compile_cell(notebook.translate(code, filename), filename)
        except Exception as exc:  # noqa: BLE001 (whatever stops the cell compiling is the cell's error: nesting too deep, null bytes)
            self.events.emit(error_event(exc, skip_driver=True))
            return 1
        try:
            self.in_user_code = True
            try:
                if body is not None:  # a cell of one expression (`print(2+2)`) has nothing before it
                    # S102: running the cell is the driver's job; the jail is the boundary
                    exec(body, self.namespace)  # noqa: S102
                # S307: the cell's last expression, as above
                value = eval(last, self.namespace) if last is not None else None  # noqa: S307
            finally:
                self.in_user_code = False
            if value is not None:
                self.namespace["_"] = value
                self.events.emit({"ev": "result", "data": mime_bundle(value)})
            flush_figures()
            return 0
        except SystemExit as exc:
            flush_figures()
            return exit_code_of(exc)
        except BaseException as exc:  # noqa: BLE001 (the cell's error, whatever it is, is the run's output)
            self.in_user_code = False
            self.events.emit(error_event(exc, skip_driver=True))
            flush_figures()
            return 1

    def display(self, *objs: Any, **_: Any) -> None:
        for obj in objs:
            self.events.emit({"ev": "display", "data": mime_bundle(obj)})


def compile_cell(source: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    """A cell's statements and its last expression (its value is the cell's result, as in
    Jupyter), compiled; SyntaxError (or what else compile raises) if the cell does not compile.

    The whole cell is compiled before any of it runs, as Python does a file, and with none of
    this module's `__future__` imports (postponed annotations would change the cell's own). A cell of one
    expression (`print(2+2)`, `df.head()`) compiles straight from its source: the `ast` route
    costs a warm run's jail far more in place (benchmarks/results/house-ab.md). A source that
    is not one expression fails that compile and takes the `ast` route, which says why."""
    try:
        return None, compile(source, filename, "eval", dont_inherit=True)
    except SyntaxError:
        pass
    tree = ast.parse(source, filename=filename, mode="exec")
    last = None
    if tree.body and isinstance(tail := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), filename, "eval", dont_inherit=True)
    return (compile(tree, filename, "exec", dont_inherit=True) if tree.body else None), last


# -- rich output -------------------------------------------------------------------------


def mime_bundle(obj: Any) -> dict[str, Any]:  # noqa: C901, PLR0912 (one branch per MIME type a result may carry, as IPython's formatter has)
    """A Jupyter-style MIME bundle for obj; a repr that raises or is huge never breaks it."""
    data: dict[str, Any] = {}
    if _is_figure(obj):
        png = _figure_png(obj)
        if png is not None:
            data["image/png"] = png
    for method, mime in MIME_METHODS:
        try:
            fn = getattr(obj, method, None)
            if fn is None or isinstance(obj, type) or not callable(fn):
                continue
            value = fn()
        except Exception:  # noqa: BLE001, S112 (a user object's _repr_*_ may raise anything: skip that MIME type)
            continue
        if value is None:
            continue
        if isinstance(value, tuple):  # (data, metadata) form
            value = value[0]
        if mime in ("image/png", "image/jpeg"):
            if isinstance(value, (bytes, bytearray)) and len(value) <= MAX_IMAGE_BYTES:
                data[mime] = base64.b64encode(bytes(value)).decode("ascii")
            elif isinstance(value, str):
                data[mime] = value
        elif mime == "application/json":
            try:
                json.dumps(value)
                data[mime] = value
            except (TypeError, ValueError):
                continue
        elif isinstance(value, str):
            data[mime] = _truncate(value)
    data["text/plain"] = safe_repr(obj)
    return data


def safe_repr(obj: Any) -> str:
    try:
        text = repr(obj)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned non-string")
    except Exception as exc:  # noqa: BLE001 (a user __repr__ may raise anything)
        try:
            kind = type(obj).__name__
        except Exception:  # noqa: BLE001 (even type(obj).__name__ can be a user property)
            kind = "object"
        text = f"<{kind} object; repr failed: {type(exc).__name__}>"
    return _truncate(text)


def _truncate(text: str) -> str:
    if len(text) <= MAX_TEXT_CHARS:
        return text
    return text[:MAX_TEXT_CHARS] + f"… [truncated {len(text) - MAX_TEXT_CHARS} characters]"


def _is_figure(obj: Any) -> bool:
    try:
        return type(obj).__module__.startswith("matplotlib.figure") and hasattr(obj, "savefig")
    except Exception:  # noqa: BLE001 (a user type's __module__ may raise anything)
        return False


def _figure_png(fig: Any) -> str | None:
    try:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return base64.b64encode(buf.getvalue()).decode("ascii")
    except Exception:  # noqa: BLE001 (a user figure's savefig may raise anything)
        return None


def flush_figures() -> None:
    """Every matplotlib figure still open becomes a display event, then is closed."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    try:
        numbers = list(plt.get_fignums())
    except Exception:  # noqa: BLE001 (the user's pyplot state may be broken)
        return
    for num in numbers:
        try:
            fig = plt.figure(num)
            builtins.display(fig)  # type: ignore[attr-defined]
            plt.close(fig)
        except Exception:  # noqa: BLE001, S112 (one broken figure must not hide the others)
            continue


# -- errors ------------------------------------------------------------------------------


def error_event(exc: BaseException, skip_driver: bool) -> channel.ErrorEvent:
    tb = exc.__traceback__
    if skip_driver:
        while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) == DRIVER_FILE:
            tb = tb.tb_next
    try:
        lines = traceback.format_exception(type(exc), exc, tb)
        text = "".join(lines)
    except Exception:  # noqa: BLE001 (formatting a user exception may raise anything)
        text = f"{type(exc).__name__}\n"
    try:
        evalue = str(exc)
    except Exception:  # noqa: BLE001 (a user exception's __str__ may raise anything)
        evalue = "<str() failed>"
    return {
        "ev": "error",
        "memory": isinstance(exc, MemoryError),
        "ename": type(exc).__name__,
        "evalue": _truncate(evalue),
        "traceback": _truncate(text).splitlines(),
    }


def exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        sys.stderr.write(f"{code}\n")
    return 1


# -- files in ----------------------------------------------------------------------------


def write_uploads(files: list[tuple[str, bytes]]) -> None:
    """Write uploaded files under the cwd, refusing to follow or replace any link."""
    for path, data in files:
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not parts or any(p == ".." for p in parts):
            raise OSError(f"refused upload path {path!r}")
        dir_fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=dir_fd)
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = nxt
            fd = os.open(
                parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=dir_fd
            )
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
        finally:
            os.close(dir_fd)


# The cgroup sub-group of the jail's where commands started from outside run (E2B's
# `sandbox.commands`; appliance.sandbox.cgroups.COMMANDS): they are not a cell's leftovers.
# Only root outside the jail places a process there; nothing in the jail can join it.
COMMANDS_GROUP = "commands"
KILL_ROUNDS = 64  # passes over /proc when commands run beside the cells (forks race the kill)


def _in_commands(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup", "rb") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return False
    return any(_commands_path(line.split(b":", 2)[-1]) for line in lines)


def _commands_path(path: bytes) -> bool:
    """Whether a cgroup path is the commands group's or a command's own in it (.../commands/c<n>):
    the path's end only, whatever the server's own placement is named."""
    parts = path.rstrip(b"/").split(b"/")
    name = COMMANDS_GROUP.encode()
    if parts[-1] == name:
        return True
    last = parts[-1]
    return len(parts) >= 2 and parts[-2] == name and last[:1] == b"c" and last[1:].isdigit()


def _jail_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _kill_all_but_commands() -> None:
    """What kill(-1) does, sparing the processes of the commands group: pass after pass, until a
    pass finds nothing left to kill (the server's freeze step kills what a fork race left)."""
    me = os.getpid()
    for _ in range(KILL_ROUNDS):
        victims = [pid for pid in _jail_pids() if pid not in (1, me) and not _in_commands(pid)]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def end_leftovers() -> None:
    """SIGKILL every process the cell left behind in this jail, before its `done`.

    The jail is its own PID namespace: kill(-1) reaches every process in it this uid may
    signal except the driver itself and the namespace's init. A session's limits then
    hold between cells too: nothing the code started runs on unseen while no cell does.
    (Threads the code started in the driver's own process do survive, as in Jupyter.)
    """
    # Nothing to kill when the cell left no process (one forked after this look races a
    # kill(-1) alike; between a session's cells the server's freeze kills it).
    me = os.getpid()
    others = [pid for pid in _jail_pids() if pid not in (1, me)]
    if others and not any(_in_commands(pid) for pid in others):
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
    elif others:
        _kill_all_but_commands()
    # Reap the driver's own children (zombies now): the rest were reparented to the
    # namespace's init, which reaps them. Bounded: a thread may still be forking.
    deadline = time.monotonic() + REAP_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.001)


# -- GPU: the run's CUDA client, made before any code ------------------------------------

_CUDA: list[Any] = []  # the library and the primary context: held for the process's lifetime


def open_cuda_context(lib: str) -> channel.CudaContextEvent:
    """Create this process's CUDA context (its MPS client) now, while the server holds the
    daemon-side limit at this run's budget; the code that follows reuses it."""
    import ctypes

    try:
        cuda = ctypes.CDLL(lib)
        device, ctx = ctypes.c_int(0), ctypes.c_void_p()
        steps: tuple[tuple[str, Callable[[], int]], ...] = (
            ("cuInit", lambda: int(cuda.cuInit(0))),
            ("cuDeviceGet", lambda: int(cuda.cuDeviceGet(ctypes.byref(device), 0))),
            (
                "cuDevicePrimaryCtxRetain",
                lambda: int(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device)),
            ),
            ("cuCtxSetCurrent", lambda: int(cuda.cuCtxSetCurrent(ctx))),
        )
        for step, call in steps:
            rc = call()
            if rc != 0:
                return {"ev": "cuda_context", "ok": False, "error": f"{step} returned CUDA error {rc}"}
    except (OSError, AttributeError) as exc:
        return {"ev": "cuda_context", "ok": False, "error": f"{type(exc).__name__}: {exc}"}
    _CUDA.extend((cuda, ctx))
    return {"ev": "cuda_context", "ok": True}


# -- self-check --------------------------------------------------------------------------


def self_check() -> dict[str, Any]:
    """What this process can see of its own confinement."""
    status: dict[str, str] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            status[key] = value.strip()
    try:
        interfaces = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        interfaces = []
    try:
        etc: list[str] | None = sorted(os.listdir("/etc"))
    except OSError:
        etc = None
    return {
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "no_new_privs": int(status.get("NoNewPrivs", "0")),
        "seccomp": int(status.get("Seccomp", "0")),
        "cap_eff": status.get("CapEff", ""),
        "pid_ns": os.readlink("/proc/self/ns/pid"),
        "net_ns": os.readlink("/proc/self/ns/net"),
        "interfaces": interfaces,
        "cwd": os.getcwd(),
        "home": os.environ.get("HOME", ""),
        "etc": etc,
    }


def _usage() -> tuple[float, int]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    return cpu, max(me.ru_maxrss, kids.ru_maxrss)


def preload(modules: list[str]) -> dict[str, str]:
    failures: dict[str, str] = {}
    for name in modules:
        try:
            __import__(name)
            if name == "matplotlib":
                __import__("matplotlib.pyplot")
        except Exception as exc:  # noqa: BLE001 (a preload failure of any kind is reported, not fatal)
            failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


def _prepare_matplotlib_cache() -> None:
    # The font cache was built once at setup; copy it into the jail's private /tmp.
    src = os.path.join(RUNTIME, "matplotlib")
    dst = os.environ.get("MPLCONFIGDIR", "")
    if not dst or not os.path.isdir(src):
        return
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        try:
            with open(os.path.join(src, name), "rb") as fin, open(os.path.join(dst, name), "wb") as fout:
                fout.write(fin.read())
        except OSError:
            pass


def main() -> None:
    # Take the control channel and the event pipe off the fds the code and its children use.
    control_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    inherited = int(sys.argv[1])
    events_fd = os.dup(inherited)  # os.dup gives a close-on-exec copy
    os.close(inherited)
    events = Events(events_fd)
    # No core dumps: a crash must not write the process's memory to disk, and the hard
    # limit of 0 cannot be raised again by the code.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # Line-buffered like a terminal; partial lines go out on flush(), before any event
    # and at the end of the cell.
    sys.stdout = EventStream(events, "stdout", 1)
    sys.stderr = EventStream(events, "stderr", 2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    driver = Driver(control_fd, events)
    builtins.display = driver.display  # type: ignore[attr-defined]
    check = self_check()
    _prepare_matplotlib_cache()
    started = time.monotonic()
    failures = preload([m for m in os.environ.get("APPLIANCE_PRELOAD", "").split(",") if m])
    driver.imports.install()  # after the preload: what the profile has loaded costs nothing
    # Started before "ready", so that a ready driver has all its threads: the reader sleeps
    # in epoll until the first cell is handed over or the channel hangs up.
    threading.Thread(target=driver.read_control, name="control", daemon=True).start()
    events.emit(
        {
            "ev": "ready",
            "check": check,
            "preload_failed": failures,
            "preload_ms": int((time.monotonic() - started) * 1000),
        }
    )
    driver.serve()


if __name__ == "__main__":
    main()
