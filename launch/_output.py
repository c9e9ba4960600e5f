"""Line-by-line output of launched tasks: prefixed onto one stream, or one log file per task.

Each task's stdout+stderr arrive on one pipe; a reader thread per task copies
whole lines, so lines of different tasks never interleave mid-line. The time of
a task's last line is kept for the launcher's silence ("heartbeat") rule.

Progress bars (Keras's `Progbar`, which redraws with backspaces and a carriage return
even into a pipe; tqdm) would arrive as one huge line of redraws per epoch. Here a
carriage return ends a *progress* line: its backspaces and colour codes are dropped and
at most one progress line per `PROGRESS_INTERVAL` seconds is passed on (always the
last state before a newline), as torchrun/Horovod users see in their logs.
"""

import contextlib
import os
import re
import threading
import time

__all__ = ["PROGRESS_INTERVAL", "OutputPump"]

PROGRESS_INTERVAL = 10.0  # seconds between two progress lines of one task
_LINE_END = re.compile(rb"\r\n|\n|\r")
_REDRAW = re.compile(rb"\x08|\x1b\[[0-9;]*[A-Za-z]")  # backspaces, colours, cursor moves


class OutputPump:
    """Copies the lines of task pipes to `sink` with a `[name] ` prefix, or to `log_dir/<name>.log`.

    Args:
        sink: a binary file object (the launcher's stdout) for prefixed lines.
        log_dir: if set, each task's lines go unprefixed to `<log_dir>/<name>.log`
            (":" in names becomes "-"), appended across restarts.
    """

    def __init__(self, sink, log_dir=None, progress_interval=PROGRESS_INTERVAL):
        self._sink = sink
        self._log_dir = log_dir
        self._progress_interval = progress_interval
        self._lock = threading.Lock()
        self._threads = []
        self._last_line = {}
        self._logs = {}  # task name -> its open log file, from `open_logs`

    def log_path(self, name):
        """Where the lines of task `name` go with `log_dir`, else None."""
        if self._log_dir is None:
            return None
        return os.path.join(self._log_dir, name.replace(":", "-") + ".log")

    def open_logs(self, names, header=None):
        """With `log_dir`: opens (appends to) the log of each task in `names` and writes `header`.

        Raises:
            OSError: a log cannot be opened or written (its `filename` says which); the
                logs opened are closed again, and those it created removed.
        """
        if self._log_dir is None:
            return
        created = []  # removed again on failure: nothing half-written
        try:
            for name in names:
                path = self.log_path(name)
                if not os.path.lexists(path):
                    created.append(path)
                try:
                    self._logs[name] = open(path, "ab")  # closed by the reader thread or close_logs
                    if header:
                        self._logs[name].write(header.encode() + b"\n")
                    self._logs[name].flush()  # a full file system fails here, before the task starts
                except OSError as e:
                    e.filename = e.filename or path
                    raise
        except OSError:
            self.close_logs()
            for path in created:
                with contextlib.suppress(OSError):
                    os.remove(path)
            raise

    def close_logs(self):
        """Closes the logs `open_logs` opened that no reader thread took over."""
        for log in self._logs.values():
            with contextlib.suppress(OSError):
                log.close()
        self._logs = {}

    def follow(self, name, pipe, header=None):
        """Starts copying `pipe` (a binary pipe, closed at EOF) for task `name`."""
        self._last_line[name] = time.monotonic()
        thread = threading.Thread(target=self._copy, args=(name, pipe, header), daemon=True)
        thread.start()
        self._threads.append(thread)

    def silent_for(self, name):
        """Seconds since task `name` last wrote a line (or was started)."""
        return time.monotonic() - self._last_line[name]

    def join(self, timeout=5.0):
        """Waits for the readers to reach EOF (a task's escaped grandchild may hold a pipe open)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]

    def _copy(self, name, pipe, header):
        log = self._logs.pop(name, None)
        if log is None and self._log_dir is not None:
            self.open_logs([name], header)
            log = self._logs.pop(name)
        prefix = f"[{name}] ".encode()
        lost = []

        def emit(line):
            if log is None:
                self._write(prefix + line + b"\n")
            elif not lost:
                try:
                    log.write(line + b"\n")
                    log.flush()
                except OSError as e:
                    # The file system filled up (or went away) mid-run: say so once and keep
                    # reading the pipe, so the task never blocks on a full pipe.
                    lost.append(e)
                    self._write(
                        f"tfscale-launch: cannot write {log.name!r} ({e.strerror or e}); the rest of "
                        f"{name}'s output is dropped\n".encode()
                    )

        try:
            self._copy_lines(name, pipe, emit)
        finally:
            pipe.close()
            if log is not None:
                with contextlib.suppress(OSError):
                    log.close()

    def _copy_lines(self, name, pipe, emit):
        progress = _Progress(emit, self._progress_interval)
        buffer = b""
        while True:
            chunk = pipe.read1(65536)
            buffer += chunk
            # ssh -tt turns "\n" into "\r\n": a trailing "\r" waits for the next chunk.
            usable = buffer[:-1] if chunk and buffer.endswith(b"\r") else buffer
            start = 0
            for end in _LINE_END.finditer(usable):
                self._last_line[name] = time.monotonic()
                progress.feed(buffer[start : end.start()], redraw=end.group() == b"\r")
                start = end.end()
            buffer = buffer[start:]
            if not chunk:
                break
        progress.close(buffer)

    def _write(self, data):
        with self._lock:
            try:
                self._sink.write(data)
                self._sink.flush()
            except (BrokenPipeError, ValueError):
                pass  # The reader of our stdout went away; keep supervising anyway.


class _Progress:
    """Turns one task's output pieces into lines: redraws (ended by a lone "\\r") are throttled."""

    def __init__(self, emit, interval):
        self._emit = emit
        self._interval = interval
        self._last = float("-inf")
        self._pending = None  # the newest redraw not passed on yet
        self._redrawing = False

    def feed(self, text, redraw):
        if self._redrawing or b"\x08" in text:
            text = _REDRAW.sub(b"", text)
        if not redraw:  # a line: plain text, or a progress bar's last state
            self._emit(text)
            self._pending, self._redrawing = None, False
            return
        self._redrawing = True
        if not text.strip():
            return
        if time.monotonic() - self._last >= self._interval:
            self._emit(text)
            self._last, self._pending = time.monotonic(), None
        else:
            self._pending = text

    def close(self, rest):
        if rest:
            self.feed(rest, redraw=False)
        elif self._pending is not None:
            self._emit(self._pending)
