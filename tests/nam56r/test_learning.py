"""Learning against the yardsticks (nam56r.training.runs.learning): run directories as the launcher leaves them, the
baselines of a real built data directory, the validation split checked, the verdicts and the plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainrun_testlib import write_train_run

from nam56r.training.data.baselines import compute
from nam56r.training.data.build import CorpusConfig, build
from nam56r.training.runs.learning import main


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for i in range(40):
        (src / f"f{i}.h").write_text("".join(f"int value_{j % 7} = {j};\n" for j in range(i, i + 30)))
    out = tmp_path_factory.mktemp("data") / "pinned-v300"
    build(out, 300, CorpusConfig(sources=(src,), valid_fraction=0.2))
    (out / "baselines.json").write_text(json.dumps({"schema": "nam56r.data_baselines/1", **compute(out).__dict__}))
    return out


def _run(path: Path, data: Path, valid: float, drift: float = 0.0) -> Path:
    write_train_run(path, range(1, 41), recipe_steps=40, loss=lambda s: 6.0 - 0.05 * s,
                    valid_loss=lambda s: valid + drift + 2.0 / s, valid_every=10)
    command = path / "command.sh"
    command.write_text(command.read_text().strip() + f" --valid-data-path {data / 'valid_text_document'}\n")
    return path


def test_arms_against_the_bigram_and_each_other_at_equal_tokens(data: Path, tmp_path: Path) -> None:
    bigram = json.loads((data / "baselines.json").read_text())["bigram_nats"]
    nam = [_run(tmp_path / f"n{i}", data, bigram - 0.6, drift) for i, drift in enumerate((0.0, 0.02))]
    ref = [_run(tmp_path / f"r{i}", data, bigram + 0.4, drift) for i, drift in enumerate((0.0, 0.03))]
    out = tmp_path / "plot" / "learning.png"

    code = main(["--arm", "nam56r=" + ",".join(map(str, nam)), "--arm", "reference=" + ",".join(map(str, ref)),
                 "--versus", "reference", "--baselines", str(data / "baselines.json"), "--out", str(out)])

    assert code == 0 and out.is_file()
    record = json.loads(out.with_suffix(".json").read_text())
    arms = {a["name"]: a for a in record["arms"]}
    assert arms["nam56r"]["beats_bigram"] and not arms["reference"]["beats_bigram"]
    assert arms["nam56r"]["last_step"] == 40 and record["data_checked"]
    (versus,) = record["versus"]
    assert versus["verdict"] == "below" and versus["difference"] == pytest.approx(-1.0 - 0.005, abs=1e-6)
    assert versus["tokens"] == arms["nam56r"]["tokens"] == 40 * json.loads((nam[0] / "summary.json").read_text())[
        "median_over_window"]["global_batch_size"] * 512


def test_runs_on_another_split_than_the_baselines_are_refused(data: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "n", data, 1.0)
    command = run / "command.sh"
    command.write_text(command.read_text().replace("valid_text_document", "train_text_document"))

    assert main(["--arm", f"nam56r={run}", "--baselines", str(data / "baselines.json"), "--out", str(tmp_path / "p.png")]) == 1
    assert "not the split the baselines scored" in capsys.readouterr().err


def test_one_run_per_arm_gives_no_verdict_against_the_other(data: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    nam, ref = _run(tmp_path / "n", data, 1.0), _run(tmp_path / "r", data, 2.0)

    assert main(["--arm", f"nam56r={nam}", "--arm", f"reference={ref}", "--versus", "reference",
                 "--baselines", str(data / "baselines.json"), "--out", str(tmp_path / "p.png")]) == 1
    assert "no arm has two runs" in capsys.readouterr().err
