"""The server's log lines written by a thread of their own, not by the thread that logs them.

A handler's write releases the GIL for its system call, and taking it back behind the engine thread
(busy in Python between two model calls) can take up to the interpreter's switch interval, 5 ms: with
256 streams on a tiny model, the event loop spent a quarter of its time in uvicorn's access-log line
(one per request), so every stream's next chunk waited there. Here a logger's handlers sit behind one
queue: the logging thread only enqueues the record, and the writer thread formats and writes it with
the handlers the logger had (their levels, formatters and streams unchanged), in the order logged.
Not logging.handlers.QueueHandler: its prepare() merges a record's args into its message, and uvicorn's
access formatter reads the args; and one listener there serves one set of handlers, where each logger
here keeps its own."""
from __future__ import annotations

import atexit
import logging
import queue
import threading

_STOP = None


class _Enqueue(logging.Handler):
    """Stands in for a logger's handlers: each record goes to the writer with those handlers."""

    def __init__(self, writer: "LogWriter", targets: list[logging.Handler]):
        super().__init__(logging.NOTSET)
        self.writer, self.targets = writer, targets

    def emit(self, record: logging.LogRecord) -> None:
        if self.writer.running:
            self.writer.records.put((self.targets, record))
        else:  # after stop (a line logged later at exit): written here, as without the writer
            self.writer.write(self.targets, record)


class LogWriter:
    """One daemon thread writing the records of every logger it took over (take_over)."""

    def __init__(self):
        self.records: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="tokenmill-log-writer", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def take_over(self, *names: str) -> None:
        """Move the handlers of these loggers ("" the root) behind the queue."""
        for name in names:
            logger = logging.getLogger(name)
            targets = [h for h in logger.handlers if not isinstance(h, _Enqueue)]
            if not targets:
                continue
            for h in targets:
                logger.removeHandler(h)
            logger.addHandler(_Enqueue(self, targets))

    @property
    def running(self) -> bool:
        return not self._stopped

    def stop(self, timeout: float = 2.0) -> None:
        """Write what is queued, then end the thread (at exit: the last lines are not lost)."""
        if not self._stopped:
            self._stopped = True
            self.records.put(_STOP)
            self._thread.join(timeout)
            while True:  # a line enqueued as the writer stopped
                try:
                    item = self.records.get_nowait()
                except queue.Empty:
                    return
                if item is not _STOP:
                    self.write(*item)

    @staticmethod
    def write(targets: list[logging.Handler], record: logging.LogRecord) -> None:
        for handler in targets:
            if record.levelno >= handler.level:
                handler.handle(record)  # its own lock, formatter and error handling

    def _run(self) -> None:
        while (item := self.records.get()) is not _STOP:
            self.write(*item)
