"""The report of tools/gpu_check.sh, from what its steps left in its output folder:

    python tools/gpu_summary.py OUT [--elapsed SECONDS --budget SECONDS]

writes OUT/report.json (every step with its status, exit code, seconds, time limit, log and why it
did not run; the environment and what the preflight found missing; the build; the tests, test by
test, from tests.tsv, which is there even when pytest was killed at its limit; the speed report)
and OUT/report.txt, the same to read, which it prints: every test that failed, erred or was cut
off by name, the others counted. Exit status 1 when a step failed, timed out, was not run or found
no time left. Standard library only, so that it reports even where torch does not import.
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

# Statuses gpu_check.sh writes; "skipped" is a step left out on request (--skip-build, --only).
FAILED = ("failed", "timed out", "out of time", "not run")
SLOWEST = 5


def read_steps(out: Path) -> list[dict]:
    steps = []
    for line in (out / "steps.tsv").read_text().splitlines():
        name, status, code, seconds, limit, log, command, note = line.split("\t")
        steps.append({"name": name, "status": status,
                      "exit_code": int(code) if code else None, "seconds": float(seconds),
                      "limit_s": int(limit) if limit else None, "log": log, "command": command,
                      "note": note})
    return steps


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_tests(tsv: Path) -> dict | None:
    """Each test's outcome from pytest_tsv's lines: counts, skip reasons, the failures and errors
    with their first line, the tests that started and never ended (cut off: a time limit, or a
    crash of pytest), how many were never reached, and the slowest."""
    try:
        lines = tsv.read_text().splitlines()
    except OSError:
        return None
    collected, outcomes, started = [], {}, []
    for line in lines:
        kind, _, rest = line.partition("\t")
        nodeid, *rest = rest.split("\t")
        if kind == "collected":
            collected.append(nodeid)
        elif kind == "started":
            started.append(nodeid)
        elif len(rest) == 2:  # a line cut in half by a kill has fewer fields
            outcomes[nodeid] = (kind, float(rest[0]), rest[1])
    counts = Counter(kind for kind, _, _ in outcomes.values())
    skip_reasons = Counter(message for kind, _, message in outcomes.values() if kind == "skipped")
    unfinished = [nodeid for nodeid in started if nodeid not in outcomes]
    slowest = sorted(outcomes.items(), key=lambda item: -item[1][1])[:SLOWEST]
    return {"collected": len(collected), "passed": counts["passed"], "failed": counts["failed"],
            "errors": counts["error"], "skipped": counts["skipped"],
            "unfinished": unfinished,
            "not_reached": len([nodeid for nodeid in collected
                                if nodeid not in outcomes and nodeid not in unfinished]),
            "skip_reasons": dict(skip_reasons.most_common()),
            "failures": [f"{kind.upper()} {nodeid}: {message}"
                         for nodeid, (kind, _, message) in outcomes.items()
                         if kind in ("failed", "error")],
            "slowest": [[nodeid, seconds] for nodeid, (_, seconds, _) in slowest]}


def _environment_line(env: dict) -> str:
    gpus = ", ".join(f"{g['name']} (sm_{g['capability'].replace('.', '')}, "
                     f"{g['memory_gib']} GiB)" for g in env["gpus"]) or "none"
    if env["torch"] is None:
        return f"python {env['python']}, torch does not import"
    return (f"python {env['python']}, torch {env['torch']} (CUDA "
            f"{env['torch_cuda'] or 'none: a CPU build'}, NCCL {env['nccl'] or '-'}), GPUs: "
            f"{gpus}; CUDA toolkit: "
            f"{env['cuda_home'] or ('none found' if env['torch_cuda'] else '-')}")


def _tests_lines(tests: dict, step: dict | None) -> list[str]:
    cut_off = "TIMED OUT" if step and step["status"] in ("timed out", "out of time") else (
        "CRASHED (pytest ended in it)")
    counts = (f"{tests['passed']} passed, {tests['failed']} failed, {tests['errors']} errors, "
              f"{tests['skipped']} skipped")
    if tests["unfinished"] or tests["not_reached"]:
        counts += f", {len(tests['unfinished'])} cut off, {tests['not_reached']} not reached"
    lines = [f"tests: {counts}, of {tests['collected']}"]
    lines += [f"  skipped {count}: {reason}" for reason, count in tests["skip_reasons"].items()]
    lines += [f"  {failure}" for failure in tests["failures"]]
    lines += [f"  {cut_off} {nodeid}" for nodeid in tests["unfinished"]]
    if tests["not_reached"]:
        lines.append(f"  NOT REACHED {tests['not_reached']}: the step's time ran out first")
    lines += [f"  slowest {seconds:6.1f} s  {nodeid}" for nodeid, seconds in tests["slowest"]
              if seconds >= 1]
    return lines


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
    if report.get("elapsed_s") is not None:
        verdict += f"; {report['elapsed_s']} s of {report['budget_s']}"
    lines = [f"ddpx GPU check: {verdict}"]
    preflight = report["preflight"]
    if preflight:
        lines.append(_environment_line(preflight["environment"]))
        if preflight["missing"]:
            lines.append(f"missing: {', '.join(preflight['missing'])} (see preflight.log)")
    lines.append("")
    width = max(len(step["name"]) for step in steps)
    for step in steps:
        code = "" if step["exit_code"] is None else f"exit {step['exit_code']}"
        limit = f"of {step['limit_s']}" if step["limit_s"] else ""
        note = f"  ({step['note']})" if step["note"] else ""
        lines.append(f"  {step['name']:<{width}}  {step['status']:<11} {code:<8} "
                     f"{step['seconds']:6.1f} s {limit:<6} {step['log']}{note}")
    build = report["build"]
    if build:
        lines.append("")
        if build.get("path"):
            lines.append(f"build: {build['path']} ({build.get('loaded', '-')}), CUDA kernels: "
                         f"{'yes' if build.get('cuda') else 'no'}")
        if build.get("failure"):
            lines.append(f"build: FAILED: {build['failure']}")
    if report["tests"]:
        step = next((step for step in steps if step["name"] == "tests"), None)
        lines += ["", *_tests_lines(report["tests"], step)]
    if speed_text:
        lines += ["", speed_text.rstrip()]
    if preflight and not preflight["environment"]["cuda_available"]:
        lines += ["", "NO GPU here: the GPU tests skipped and nothing was timed on a GPU; this "
                      "run checks only that every step runs and reports."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="gpu_check.sh's output folder")
    parser.add_argument("--elapsed", type=int, help="seconds the check has taken so far")
    parser.add_argument("--budget", type=int, help="its GPU_CHECK_BUDGET_S")
    args = parser.parse_args(argv)
    out = args.out
    report = {
        "steps": read_steps(out),
        "elapsed_s": args.elapsed,
        "budget_s": args.budget,
        "preflight": read_json(out / "preflight.json"),
        "build": read_json(out / "build_info.json"),
        "tests": read_tests(out / "tests.tsv"),
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
