"""The report of tools/gpu_check.sh, from what its steps left in its output folder:

    python tools/gpu_summary.py OUT

writes OUT/report.json (every step with its status, exit code, seconds, time limit and log; the
environment; the build; the tests' counts, the reasons of their skips and their failures, from
junit.xml; the speed report) and OUT/report.txt, the same to read, which it prints. Exit status 1
when a step failed, timed out or found no time left to run. Standard library only, so that it
reports even where torch does not import.
"""

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

# Statuses gpu_check.sh writes; "skipped" is a step left out on request (--skip-build).
FAILED = ("failed", "timed out", "out of time")


def read_steps(out: Path) -> list[dict]:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, status, code, seconds, limit, log, command = line.split("\t")
        steps.append({"name": name, "status": status,
                      "exit_code": int(code) if code else None, "seconds": float(seconds),
                      "limit_s": int(limit) if limit else None, "log": log, "command": command})
    return steps


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def junit_counts(junit: Path) -> dict | None:
    """Passed, failed, errors and skipped test cases of a pytest junit XML file, the skips counted
    by reason, and each failure's test id with the first line of its message."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = Counter()
    skip_reasons = Counter()
    failures = []
    for case in root.iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")),
                       None)
        if outcome is None:
            counts["passed"] += 1
            continue
        message = (outcome.get("message") or outcome.text or "").strip()
        first_line = message.splitlines()[0] if message else ""
        if outcome.tag == "skipped":
            counts["skipped"] += 1
            skip_reasons[first_line] += 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failures.append(f"{test}: {first_line}")
    return {"passed": counts["passed"], "failed": counts["failed"], "errors": counts["errors"],
            "skipped": counts["skipped"], "skip_reasons": dict(skip_reasons.most_common()),
            "failures": failures}


def summary_text(report: dict, speed_text: str | None) -> str:
    steps = report["steps"]
    failed = [step for step in steps if step["status"] in FAILED]
    skipped = [step["name"] for step in steps if step["status"] == "skipped"]
    if failed:
        names = ", ".join(step["name"] for step in failed)
        verdict = f"FAILED: {len(failed)} of {len(steps)} steps ({names})"
    else:
        verdict = f"{len(steps) - len(skipped)} steps passed" + (
            f", {len(skipped)} skipped on request ({', '.join(skipped)})" if skipped else "")
    lines = [f"ddpx GPU check: {verdict}"]
    env = report["environment"]
    if env:
        gpus = ", ".join(f"{g['name']} (sm_{g['capability'].replace('.', '')}, "
                         f"{g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
        lines.append(f"python {env['python']}, torch {env['torch']} (CUDA "
                     f"{env['torch_cuda'] or 'none: a CPU build'}, NCCL {env['nccl'] or '-'}), "
                     f"GPUs: {gpus}; CUDA toolkit: "
                     f"{env['cuda_home'] or ('none found' if env['torch_cuda'] else '-')}")
    lines.append("")
    width = max(len(step["name"]) for step in steps)
    for step in steps:
        code = "" if step["exit_code"] is None else f"exit {step['exit_code']}"
        lines.append(f"  {step['name']:<{width}}  {step['status']:<11} {code:<8} "
                     f"{step['seconds']:6.1f} s  {step['log']}")
    build = report["build"]
    if build:
        lines += ["", f"build: {build.get('path', '-')} ({build.get('loaded', '-')}), CUDA "
                      f"kernels: {'yes' if build.get('cuda') else 'no'}"]
        if build.get("failure"):
            lines.append(f"  FAILED: {build['failure']}")
    tests = report["tests"]
    if tests:
        lines += ["", f"tests/test_cuda.py: {tests['passed']} passed, {tests['failed']} failed, "
                      f"{tests['errors']} errors, {tests['skipped']} skipped"]
        lines += [f"  skipped {count}: {reason}" for reason, count in tests["skip_reasons"].items()]
        lines += [f"  FAILED {failure}" for failure in tests["failures"]]
    if speed_text:
        lines += ["", speed_text.rstrip()]
    if env and not env["cuda_available"]:
        lines += ["", "NO GPU here: the GPU tests skipped and nothing was timed on a GPU; this "
                      "run checks only that every step runs and reports."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    report = {
        "steps": read_steps(out),
        "environment": read_json(out / "environment.json"),
        "build": read_json(out / "build_info.json"),
        "tests": junit_counts(out / "junit.xml"),
        "speed": read_json(out / "speed.json"),
    }
    report["ok"] = not any(step["status"] in FAILED for step in report["steps"])
    speed_path = out / "speed.txt"
    text = summary_text(report, speed_path.read_text() if speed_path.is_file() else None)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.txt").write_text(text + "\n")
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
