"""Line-by-line output of launched tasks: prefixed onto one stream, or one log file per task.

Each task's stdout+stderr arrive on one pipe; a reader thread per task copies
whole lines, so lines of different tasks never interleave mid-line. The time of
a task's last line is kept for the launcher's silence ("heartbeat") rule.
"""

import os
import threading
import time

__all__ = ["OutputPump"]


class OutputPump:
    """Copies the lines of task pipes to `sink` with a `[name] ` prefix, or to `log_dir/<name>.log`.

    Args:
        sink: a binary file object (the launcher's stdout) for prefixed lines.
        log_dir: if set, each task's lines go unprefixed to `<log_dir>/<name>.log`
            (":" in names becomes "-"), appended across restarts.
    """

    def __init__(self, sink, log_dir=None):
        self._sink = sink
        self._log_dir = log_dir
        self._lock = threading.Lock()
        self._threads = []
        self._last_line = {}

    def log_path(self, name):
        """Where the lines of task `name` go with `log_dir`, else None."""
        if self._log_dir is None:
            return None
        return os.path.join(self._log_dir, name.replace(":", "-") + ".log")

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
        log = None
        if self._log_dir is not None:
            log = open(self.log_path(name), "ab")  # closed below: lives with the thread
            if header:
                log.write(header.encode() + b"\n")
                log.flush()
        prefix = f"[{name}] ".encode()
        try:
            for raw in iter(pipe.readline, b""):
                self._last_line[name] = time.monotonic()
                # ssh -tt turns "\n" into "\r\n"; keep one line ending.
                line = raw.rstrip(b"\r\n") + b"\n"
                if log is not None:
                    log.write(line)
                    log.flush()
                else:
                    self._write(prefix + line)
        finally:
            pipe.close()
            if log is not None:
                log.close()

    def _write(self, data):
        with self._lock:
            try:
                self._sink.write(data)
                self._sink.flush()
            except (BrokenPipeError, ValueError):
                pass  # The reader of our stdout went away; keep supervising anyway.
