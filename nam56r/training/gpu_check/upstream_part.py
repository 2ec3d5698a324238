"""The check's `upstream` part: the patch series' upstream tests on this GPU (`apply_patches.py upstream-tests --gpu`),
the release against the series, from the offline cache `cache fill` stored them in (`--upstream-tests-cache DIR`);
one manifest record per patch, with this host's stamp."""

from __future__ import annotations

import json

from nam56r.training.gpu_check.options import ROOT, Options
from nam56r.training.runs.logged_run import run_logged

UPSTREAM_TESTS_TIMEOUT_S = 900  # each side's pytest; the check as a whole aims at ten minutes
UPSTREAM_TESTS_JOBS = 8  # xdist workers per side: mamba's TileLang tests compile kernels per test


def upstream_part(opts: Options) -> dict:
    if opts.upstream_tests_cache is None:
        return {"status": "skipped", "reason": "no --upstream-tests-cache DIR (an offline cache `cache fill` stored the"
                " upstream tests in)", "problems": []}
    out = opts.out_dir / "upstream-tests"
    log = out / "upstream-tests.log"
    command = [opts.python, str(ROOT / "tools" / "apply_patches.py"), "--root", str(opts.root), "--cache",
               str(opts.upstream_tests_cache), "--python", opts.python, "upstream-tests", "--gpu", "--out", str(out),
               "--timeout-s", str(UPSTREAM_TESTS_TIMEOUT_S), "--jobs", str(UPSTREAM_TESTS_JOBS), *([] if opts.record else ["--no-record"])]
    run = run_logged(command, log, "upstream", opts.root, echo=opts.echo)
    reports = {path.parent.name: json.loads(path.read_text()) for path in sorted(out.glob("*/report.json"))}
    summary = {name: {"counts": r["counts"], "both_fail_causes": r["both_fail_causes"],
                      "regressions": [t["test"] for t in r["tests"] if t["kind"] == "regression"],
                      "updated_by_patches": sorted({p for t in r["tests"] for p in t["updated_by"]})}
               for name, r in reports.items()}
    problems = [f"{name}: unexplained regression {test}" for name, s in summary.items() for test in s["regressions"]]
    if run.exit_code != 0 and not problems:
        problems.append(f"upstream-tests exited {run.exit_code}; its log ends:\n{run.tail()}")
    return {"status": "failed" if problems else "passed", "command": command, "exit_code": run.exit_code, "log": str(log),
            "upstreams": summary, "problems": problems}
