"""The server's log lines written by the writer thread (server/log_writer.py): every line reaches the
handlers the logger had, in order, with their levels and formatters, and none is lost at stop."""
from __future__ import annotations

import io
import logging
import threading

from tokenmill.server.log_writer import LogWriter


class WrittenBy(logging.Filter):
    """Notes which threads the handler wrote from."""

    def __init__(self):
        super().__init__()
        self.threads: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        self.threads.add(threading.current_thread().name)
        return True


def test_lines_reach_the_loggers_own_handlers_in_order_and_off_the_logging_thread():
    logger = logging.getLogger("tokenmill.test.log_writer")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    out, warnings = io.StringIO(), io.StringIO()
    every = logging.StreamHandler(out)
    every.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    only_warnings = logging.StreamHandler(warnings)
    only_warnings.setLevel(logging.WARNING)
    every.addFilter(writers := WrittenBy())
    logger.handlers[:] = [every, only_warnings]
    writer = LogWriter()
    try:
        writer.take_over("tokenmill.test.log_writer")
        writer.take_over("tokenmill.test.log_writer")  # twice: still one queue in front of the handlers
        assert len(logger.handlers) == 1
        for i in range(200):
            logger.info("line %d of %s", i, "200")
        logger.warning("the end")
    finally:
        writer.stop()
        logger.handlers.clear()
    lines = out.getvalue().splitlines()
    assert lines == [f"INFO line {i} of 200" for i in range(200)] + ["WARNING the end"]
    assert warnings.getvalue() == "the end\n"
    assert writers.threads == {"tokenmill-log-writer"}


def test_a_line_logged_after_stop_is_written_where_it_is_logged():
    logger = logging.getLogger("tokenmill.test.log_writer.late")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(writers := WrittenBy())
    logger.handlers[:] = [handler]
    writer = LogWriter()
    try:
        writer.take_over("tokenmill.test.log_writer.late")
        logger.info("before")
        writer.stop()
        logger.info("after")
    finally:
        logger.handlers.clear()
    assert out.getvalue() == "before\nafter\n"
    assert writers.threads == {"tokenmill-log-writer", threading.current_thread().name}


def test_a_logger_without_handlers_is_left_alone():
    logger = logging.getLogger("tokenmill.test.log_writer.bare")
    writer = LogWriter()
    try:
        writer.take_over("tokenmill.test.log_writer.bare")
        assert logger.handlers == []
    finally:
        writer.stop()
