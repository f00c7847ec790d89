"""A pytest plugin that writes each test's result to a TSV file the moment the test ends:

    PYTHONPATH=tools python -m pytest -p pytest_tsv --tsv OUT/tests.tsv ...

pytest's --junitxml writes its file only when the session ends, so a run that is killed at its
time limit leaves none; this file has every test that finished by then, and says which test was
running. Lines (tab-separated):

    collected  NODEID                     every test that will run, in order, once collected
    started    NODEID                     as the test begins
    OUTCOME    NODEID  SECONDS  MESSAGE   as it ends: passed, failed, error (setup or teardown
                                          failed) or skipped; MESSAGE: the first line of the
                                          failure or the skip's reason

tools/gpu_summary.py reads it. Standard library and pytest only.
"""

import pytest

# Which phase's failure names the outcome: the test's own, else its fixtures'.
_FAILED_IN = {"setup": "error", "call": "failed", "teardown": "error"}


def pytest_addoption(parser):
    parser.addoption("--tsv", metavar="PATH", help="where each test's result goes, as it ends")


def _first_line(text: str) -> str:
    line = next((line.strip() for line in str(text).splitlines() if line.strip()), "")
    return line.replace("\t", " ")[:300]


def _skip_reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}".rstrip(": ")
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: why")
        return _first_line(report.longrepr[2]).removeprefix("Skipped: ")
    return _first_line(report.longrepr)


def _failure(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    return _first_line(crash.message if crash is not None else report.longrepr)


class _Writer:
    def __init__(self, path: str):
        # Line-buffered: each line reaches the file as it is written, whatever kills pytest later.
        self.file = open(path, "a", buffering=1)
        self.results = {}

    def write(self, *fields) -> None:
        self.file.write("\t".join(map(str, fields)) + "\n")

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.write("collected", item.nodeid)

    def pytest_runtest_logstart(self, nodeid, location):
        self.results[nodeid] = ["passed", 0.0, ""]
        self.write("started", nodeid)

    def pytest_runtest_logreport(self, report):
        result = self.results.setdefault(report.nodeid, ["passed", 0.0, ""])
        result[1] += report.duration
        if result[0] != "passed":
            return  # the first phase that did not pass says what happened
        if report.skipped:
            result[0], result[2] = "skipped", _skip_reason(report)
        elif report.failed:
            result[0], result[2] = _FAILED_IN[report.when], _failure(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, seconds, message = self.results.pop(nodeid, ["passed", 0.0, ""])
        self.write(outcome, nodeid, f"{seconds:.2f}", message)

    def pytest_unconfigure(self, config):
        self.file.close()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    path = config.getoption("--tsv")
    if path:
        config.pluginmanager.register(_Writer(path), "pytest_tsv_writer")
