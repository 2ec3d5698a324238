"""`python -m nam56r.training.gpu_check` on CPU: its options, its refusal without a GPU, and each part's summary
assembled from real sub-results (a real pytest run, a real `tools/packs.py run` on the fake upstream,
run directories written by nam56r.training.launcher's and nam56r.training.runs.summary's own writers, a real failed launch)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from trainrun_testlib import lm_loss, write_train_run

from nam56r.training.gpu_check import (
    COVERED_BY_TRAIN,
    Options,
    main,
    options_from,
    packs_part,
    parse_args,
    pytest_part,
    report,
    run_check,
    train_summary,
)
from nam56r.training.runs.logged_run import LoggedRun
from nam56r.training.runs.resume_check import ResumeCheck, TrainRun, assess

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "tools"))  # the fake upstream and fake pack of the patch-lane tests
from packs_testlib import BODY, PACK, REPRO, add_pack, pack_toml  # noqa: E402
from patchlane_testlib import SDIST, make_fake_upstream, make_lane  # noqa: E402

SAMPLE_TESTS = '''\
import pytest

pytestmark = pytest.mark.gpu


def test_passes():
    print("SAMPLE_SUM_OK sum=2")
    assert 1 + 1 == 2


def test_fails():
    assert 1 + 1 == 3, "arithmetic"


def test_skips():
    pytest.skip("no such device here")


class TestGroup:
    def test_in_a_class(self):
        pass
'''


def test_refuses_to_run_without_a_cuda_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    # Every part skipped and nothing recorded: were the refusal broken, nothing would touch this checkout.
    harmless = ["--skip-tests", "--skip-packs", "--skip-train", "--no-record"]

    proc = subprocess.run([sys.executable, "-m", "nam56r.training.gpu_check", "--out-dir", str(tmp_path / "out"), *harmless],
                          capture_output=True, text=True, env=env, cwd=ROOT)

    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpu-check needs a CUDA GPU: no CUDA GPU visible to torch" in proc.stderr
    assert "CUDA_VISIBLE_DEVICES=''" in proc.stderr and "Run it on a GPU node, after `nox -s build`" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_options_and_help(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    args = parse_args(["--out-dir", str(tmp_path), "--skip-packs", "--steps", "30", "--resume-at", "15", "--no-record",
                       "--", "--no-persist-layer-norm"])
    opts = options_from(args)

    assert opts.out_dir == tmp_path.resolve() and opts.skip == frozenset({"packs"}) and not opts.record
    assert (opts.check.recipe, opts.check.steps, opts.check.resume_at) == ("tiny-1gpu", 30, 15)
    assert opts.megatron_flags == ("--no-persist-layer-norm",) and opts.test_paths == ("tests",)
    default = options_from(parse_args([]))
    assert default.out_dir.parent == ROOT / "runs" and default.out_dir.name.startswith("gpu-check-")
    assert (default.check.steps, default.check.resume_at, default.skip, default.record) == (20, 10, frozenset(), True)

    assert main(["--steps", "10", "--resume-at", "10"]) == 2
    assert "resume_at 10 must lie strictly between 0 and steps 10" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--skip-tests", "--skip-packs", "--skip-train", "--out-dir", "Exit codes"))


def test_tests_part_has_every_tests_outcome_from_a_real_pytest_run(tmp_path: Path) -> None:
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "test_sample.py").write_text(SAMPLE_TESTS)
    (tmp_path / "suite" / "test_cpu_only.py").write_text("def test_not_marked():\n    pass\n")
    for args in (["init", "-q"], ["add", "suite"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "suite"]):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True)
    opts = Options(out_dir=tmp_path / "out", root=tmp_path, test_paths=("suite",), skip=frozenset({"train"}), echo=False)

    part = pytest_part(opts)

    outcomes = {t["id"]: t["outcome"] for t in part["tests"]}
    assert outcomes == {"suite/test_sample.py::test_passes": "passed", "suite/test_sample.py::test_fails": "failed",
                        "suite/test_sample.py::test_skips": "skipped", "suite/test_sample.py::TestGroup::test_in_a_class": "passed"}
    assert part["counts"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert part["status"] == "failed" and part["exit_code"] == 1
    assert part["problems"] == ["pytest exited 1: 1 failed, 0 error(s): suite/test_sample.py::test_fails"]
    failed = next(t for t in part["tests"] if t["outcome"] == "failed")
    assert "arithmetic" in failed["message"]
    assert "-m" in part["command"] and "gpu" in part["command"] and part["deselected"] == []
    assert Path(part["junit"]).is_file() and "test_fails FAILED" in Path(part["log"]).read_text()
    [record] = tomllib.loads((tmp_path / "patches" / "manifest.toml").read_text())["record"]
    assert part["records"] == [{**record, "sentinels": tuple(record["sentinels"]), "passed": tuple(record["passed"]),
                                "failed": tuple(record["failed"]), "skipped": tuple(record["skipped"])}]
    assert record["kind"] == "gpu-tests" and record["exit_code"] == 1 and record["sentinels"] == ["SAMPLE_SUM_OK sum=2"]
    assert record["failed"] == ["suite/test_sample.py::test_fails"] and len(record["passed"]) == 2
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["commit"] == head


def test_tests_part_leaves_the_resume_test_to_the_train_part(tmp_path: Path) -> None:
    owner = tmp_path / Path(COVERED_BY_TRAIN.split("::")[0])
    owner.parent.mkdir(parents=True)
    name = COVERED_BY_TRAIN.split("::")[1]
    owner.write_text(f"import pytest\n\npytestmark = pytest.mark.gpu\n\n\ndef {name}():\n    pass\n\n\ndef test_other():\n    pass\n")
    with_train = Options(out_dir=tmp_path / "a", root=tmp_path, test_paths=("tests",), echo=False, record=False)
    without_train = Options(out_dir=tmp_path / "b", root=tmp_path, test_paths=("tests",), skip=frozenset({"train"}), echo=False,
                            record=False)

    deselecting, keeping = pytest_part(with_train), pytest_part(without_train)

    assert deselecting["status"] == "passed" and [t["id"] for t in deselecting["tests"]] == [f"{owner.relative_to(tmp_path)}::test_other"]
    assert [d["id"] for d in deselecting["deselected"]] == [COVERED_BY_TRAIN]
    assert sorted(t["id"] for t in keeping["tests"]) == sorted([COVERED_BY_TRAIN, f"{owner.relative_to(tmp_path)}::test_other"])


@pytest.fixture
def packed_lane(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The patch-lane tests' fake upstream, built, with its pack (a CPU reproducer) and a pack that cannot run."""
    config = tmp_path / "gitconfig"
    config.write_text("[user]\n\tname = test\n\temail = test@example.invalid\n[init]\n\tdefaultBranch = main\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    fake = make_fake_upstream(tmp_path / "origin")
    (tmp_path / "cache").mkdir()
    shutil.copy(fake.sdist, tmp_path / "cache" / SDIST)
    lane = make_lane(tmp_path / "repo", tmp_path / "cache", fake)
    assert lane.build().code == 0
    add_pack(lane)
    broken = lane.root / "patches" / "packs" / "01-broken"
    broken.mkdir()
    (broken / "pack.toml").write_text(pack_toml(pack_id="01-broken", upstream="nope"))
    (broken / "body.md").write_text(BODY)
    (broken / "repro.py").write_text(REPRO)
    return lane


def test_packs_part_has_each_packs_verdict_and_the_records_it_appended(packed_lane, tmp_path: Path) -> None:
    opts = Options(out_dir=tmp_path / "out", root=packed_lane.root, packs_needs="cpu", echo=False)

    part = packs_part(opts)

    assert part["status"] == "failed" and part["exit_code"] == 1
    assert [(p["pack"], p["verdict"]) for p in part["packs"]] == [("01-broken", "ERROR"), (PACK, "passed")]
    assert part["counts"] == {"ERROR": 1, "passed": 1}
    assert part["packs"][1]["sides"] == [{"side": "base", "exit_code": 0, "sentinels": ["BUG_REPRODUCED"]},
                                         {"side": "patched", "exit_code": 0, "sentinels": ["FIX_VALIDATED"]}]
    assert len(part["problems"]) == 1 and part["problems"][0].startswith("01-broken: ERROR: 01-broken: pack.toml has problems")
    manifest = tomllib.loads((packed_lane.root / "patches" / "manifest.toml").read_text())["record"]
    appended = [(r["pack"], r["side"], r["tree_commit"]) for r in part["records"]]
    assert appended == [(r["pack"], r["side"], r["tree_commit"]) for r in manifest] and len(appended) == 2
    assert "[base] BUG_REPRODUCED" in Path(part["log"]).read_text()


def _run(name: str, run_dir: Path) -> TrainRun:
    """A run directory written without a launch: the launch it stands for exited 0."""
    launch = LoggedRun(["python", "-m", "nam56r.training.launcher", "--run-dir", str(run_dir)], 0, 1.0, run_dir.with_suffix(".log"))
    return TrainRun(name, run_dir, launch)


def test_train_part_has_each_runs_figures_the_resume_difference_and_the_records(tmp_path: Path) -> None:
    check = ResumeCheck(steps=20, resume_at=10)
    write_train_run(tmp_path / "train" / "full", range(1, 21), first_step_after_s=80.0)
    write_train_run(tmp_path / "train" / "resumed", range(11, 21), loss=lambda step: lm_loss(step) + (0.001 if step == 15 else 0.0),
                    first_step_after_s=20.0)
    opts = Options(out_dir=tmp_path, root=tmp_path / "checkout", echo=False)

    part = train_summary(opts, assess(check, _run("full", tmp_path / "train" / "full"), (_run("resumed", tmp_path / "train" / "resumed"),)),
                         tmp_path / "data")

    assert part["status"] == "passed", part["problems"]
    full, resumed = part["runs"]["full"], part["runs"]["resumed"]
    assert (full["first_step"], full["last_step"], resumed["first_step"], resumed["last_step"]) == (1, 20, 11, 20)
    assert full["loss_first"] == pytest.approx(lm_loss(1)) and full["loss_last"] == pytest.approx(lm_loss(20))
    assert full["time_to_first_step_s"] == pytest.approx(80.0, abs=1.0) and resumed["time_to_first_step_s"] == pytest.approx(20.0, abs=1.0)
    assert full["peak_memory_gib"] == pytest.approx(4.0) and full["tokens_per_s_per_gpu"] > 0 and full["tflops_per_s_per_gpu"] > 0
    assert part["resume"]["compared_steps"] == [11, 20] and part["resume"]["max_abs_loss_diff"] == pytest.approx(0.001, abs=1e-5)
    assert part["resume"]["runs"]["resumed"]["launcher_args"] == []
    manifest = tomllib.loads((tmp_path / "checkout" / "patches" / "manifest.toml").read_text())["record"]
    assert [(r["kind"], r["first_step"], r["last_step"]) for r in manifest] == [("train", 1, 20), ("train", 11, 20)]
    assert [r["run_dir"] for r in part["records"]] == [r["run_dir"] for r in manifest]


def test_train_part_fails_when_the_resumed_curve_departs_or_the_resume_restarted(tmp_path: Path) -> None:
    check = ResumeCheck(steps=20, resume_at=10)
    write_train_run(tmp_path / "full", range(1, 21))
    write_train_run(tmp_path / "restarted", range(1, 21), loss=lambda step: lm_loss(step) + 0.5)

    result = assess(check, _run("full", tmp_path / "full"), (_run("resumed", tmp_path / "restarted"),))

    assert not result.ok
    assert any("first logged step is 1, not 11: it did not continue from its checkpoint" in p for p in result.problems)
    assert any("differ from the uninterrupted run by up to 0.50000 (tolerance 0.02)" in p for p in result.problems)


def test_each_resumed_run_is_judged_on_its_own_and_the_summary_names_its_options(tmp_path: Path) -> None:
    """Two resumed runs from one checkpoint (the saving run's EP, then EP=2): the one that departs fails the part
    by name, and the summary and report give each run's options and difference."""
    check = ResumeCheck(steps=20, resume_at=10, train_args=("--ep", "4"), resumes=((), ("--ep", "2")))
    write_train_run(tmp_path / "train" / "full", range(1, 21))
    write_train_run(tmp_path / "train" / "resumed", range(11, 21), loss=lambda step: lm_loss(step) + 0.002)
    write_train_run(tmp_path / "train" / "resumed-2", range(11, 21), loss=lambda step: lm_loss(step) + 0.3)
    opts = Options(out_dir=tmp_path, root=tmp_path / "checkout", echo=False, record=False)
    runs = tuple(_run(name, tmp_path / "train" / name) for name in check.resumed_names)

    part = train_summary(opts, assess(check, _run("full", tmp_path / "train" / "full"), runs), tmp_path / "data")

    assert check.resumed_names == ("resumed", "resumed-2") and part["status"] == "failed"
    assert part["problems"] == ["the resumed-2 run's steps 11-20 differ from the uninterrupted run by up to 0.30000 (tolerance 0.02)"]
    runs = part["resume"]["runs"]
    assert runs["resumed"]["launcher_args"] == [] and runs["resumed"]["max_abs_loss_diff"] == pytest.approx(0.002, abs=1e-5)
    assert runs["resumed-2"]["launcher_args"] == ["--ep", "2"] and runs["resumed-2"]["max_abs_loss_diff"] == pytest.approx(0.3, abs=1e-5)
    assert part["resume"]["max_abs_loss_diff"] == pytest.approx(0.3, abs=1e-5) and part["train_args"] == ["--ep", "4"]
    summary = {"status": "failed", "seconds": 1.0, "host": {"gpu": "cpu"}, "commit": "0" * 40, "dirty": False,
               "parts": {"train": {**part, "seconds": 1.0}}}
    text = report(summary)
    assert "resumed (the saving run's options): steps 11-20 within 0.00200" in text
    assert "resumed-2 (--ep 2): steps 11-20 within 0.30000" in text


def test_the_train_parts_launcher_options_are_the_launchers_and_are_refused_before_any_run(tmp_path: Path, capsys) -> None:
    four_ranks = "--gpus-per-node 4 --mbs 4 --ep 4 --moe-dispatch megatron --reshardable-ckpt on"
    args = parse_args(["--out-dir", str(tmp_path), "--train-args", four_ranks,
                       "--resume-args", "", "--resume-args", "--ep 2"])
    check = options_from(args).check
    assert check.train_args == ("--gpus-per-node", "4", "--mbs", "4", "--ep", "4", "--moe-dispatch", "megatron", "--reshardable-ckpt", "on")
    assert check.resumes == ((), ("--ep", "2"))
    assert options_from(parse_args(["--out-dir", str(tmp_path)])).check.resumes == ((),)
    # the tiny model's 4 experts do not split over 3 expert-parallel ranks: the recipe's own check refuses it
    assert main(["--out-dir", str(tmp_path), "--train-args", "--gpus-per-node 3 --mbs 4 --gbs 12 --ep 3 --moe-dispatch megatron"]) == 2
    assert "the train part's launcher options" in capsys.readouterr().err
    assert main(["--out-dir", str(tmp_path), "--resume-args=--no-such-option"]) == 2
    assert "are not the launcher's" in capsys.readouterr().err
    with pytest.raises(ValueError, match="hold '--'"):
        ResumeCheck(train_args=("--", "--lr", "1"))


def test_a_failed_part_fails_the_check_and_the_summary_says_why(tmp_path: Path) -> None:
    """The train part launches the real nam56r.training.launcher, which refuses the recipe: the check exits 1,
    the skipped parts say so, and the summary on disk is the one returned."""
    opts = Options(out_dir=tmp_path / "out", root=tmp_path / "checkout", skip=frozenset({"tests", "packs"}),
                   check=ResumeCheck(recipe="no-such-recipe"), data=tmp_path / "data", echo=False)

    summary = run_check(opts)

    assert summary["status"] == "failed" and summary["exit_code"] == 1
    assert summary["parts"]["tests"] == {"status": "skipped", "reason": "--skip-tests"}
    assert summary["parts"]["packs"] == {"status": "skipped", "reason": "--skip-packs"}
    train = summary["parts"]["train"]
    assert train["status"] == "failed" and train["seconds"] >= 0 and train["records"] == []
    assert "the full run exited 2" in train["problems"][0] and "invalid choice: 'no-such-recipe'" in train["problems"][0]
    assert train["runs"]["full"]["exit_code"] == 2 and "resumed" not in train["runs"]
    assert train["resume"]["runs"]["resumed"]["max_abs_loss_diff"] is None
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == json.loads(json.dumps(summary, default=str))
    assert summary["host"]["gpu"] == "cpu" and summary["schema"] == "nam56r.gpu_check/1" and summary["finished_utc"]
    text = report(summary)
    assert "gpu-check FAILED" in text and "train  failed" in text and "tests  skipped (--skip-tests)" in text


@pytest.mark.parametrize("concurrent", [True, False])
def test_parts_run_at_the_same_time_unless_sequential(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, concurrent: bool) -> None:
    """Each part waits for the other at a barrier: only parts that really run at the same time pass it.
    Every part's result lands in the summary on disk, in the parts' order."""
    import threading

    from nam56r.training.gpu_check import runner

    meeting = threading.Barrier(2, timeout=2 if not concurrent else 30)

    def meets(name: str):
        def part(opts: Options) -> dict:
            meeting.wait()
            return {"status": "passed", "who": name}
        return part

    alone_runs: list[int] = []

    def packs_alone(opts: Options) -> dict:
        alone_runs.append(meeting.n_waiting)  # nothing else is running by now
        return {"status": "passed", "packs": [{"pack": "12-timed", "verdict": "passed"}], "records": [], "problems": [],
                "command": ["packs", "run", "--alone", "only"], "exit_code": 0, "log": "packs-alone.log", "report": "packs-alone.json"}

    monkeypatch.setattr(runner, "PART_RUNNERS", {"tests": meets("tests"), "packs": meets("packs"), "train": meets("train"),
                                                 "packs-alone": packs_alone})
    opts = Options(out_dir=tmp_path / "out", skip=frozenset({"train", "upstream"}), echo=False, concurrent=concurrent)

    summary = run_check(opts)

    on_disk = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(on_disk["parts"]) == ["tests", "packs", "train", "upstream"] and on_disk["concurrent"] is concurrent
    if concurrent:
        assert summary["status"] == "passed" and [on_disk["parts"][n]["who"] for n in ("tests", "packs")] == ["tests", "packs"]
        # the `alone` packs ran once, after the parts, and their verdicts joined the packs part
        assert alone_runs == [0] and on_disk["parts"]["packs"]["packs"] == [{"pack": "12-timed", "verdict": "passed"}]
        assert on_disk["parts"]["packs"]["alone"]["command"][-1] == "only"
    else:
        assert alone_runs == [], "a sequential check runs the alone packs inside its packs part"
        assert summary["status"] == "failed" and "BrokenBarrierError" in summary["parts"]["tests"]["problems"][0]
    assert on_disk["parts"]["train"] == {"status": "skipped", "reason": "--skip-train"}


def test_the_upstream_part_without_a_cache_is_skipped_saying_why(tmp_path: Path) -> None:
    from nam56r.training.gpu_check.upstream_part import upstream_part

    part = upstream_part(Options(out_dir=tmp_path, echo=False))

    assert part["status"] == "skipped" and "--upstream-tests-cache" in part["reason"]
