"""A pytest plugin for the device check (bench/gpu/check.py passes `-p instafail`): each failure's
report is printed when it happens, not in the final summary, so a run stopped at its time limit
still shows what failed and why."""
from __future__ import annotations


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n", flush=True)
