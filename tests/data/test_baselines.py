"""Count-model baselines of a data directory: both cross-entropies against a direct count over small streams, their
refusals, and the CLI over a real built directory."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from nam56r.training.data.baselines import BASELINES_FILE, cross_entropies


def direct(train: list[int], valid: list[int], vocab: int, lam: float) -> tuple[float, float]:
    """The module docstring's two models, counted token by token."""
    unigram = Counter(train)
    pairs, contexts = Counter(zip(train[:-1], train[1:], strict=True)), Counter(train[:-1])
    uni, bi = [], []
    for v, w in zip(valid[:-1], valid[1:], strict=True):
        p_uni = (unigram[w] + 1) / (len(train) + vocab)
        uni.append(-math.log(p_uni))
        p_bi = lam * pairs[(v, w)] / contexts[v] + (1 - lam) * p_uni if contexts[v] else p_uni
        bi.append(-math.log(p_bi))
    return sum(uni) / len(uni), sum(bi) / len(bi)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_models_match_a_direct_count(seed: int) -> None:
    rng = np.random.default_rng(seed)
    vocab = 9
    train = rng.integers(0, vocab - 1, 300)  # the last id never occurs in train: an unseen context and token
    valid = rng.integers(0, vocab, 80)
    got = cross_entropies(train, valid, vocab, 0.7)
    assert got == pytest.approx(direct(train.tolist(), valid.tolist(), vocab, 0.7), rel=1e-12)


def test_a_stream_that_alternates_is_nearly_free_for_the_bigram() -> None:
    train, valid = np.array([0, 1] * 500), np.array([0, 1] * 20)
    unigram, bigram = cross_entropies(train, valid, 4, 0.9)
    assert unigram == pytest.approx(-math.log(501 / 1004), rel=1e-12)
    assert bigram == pytest.approx(-math.log(0.9 + 0.1 * 501 / 1004), rel=1e-12) and bigram < unigram / 5


def test_bad_inputs_are_refused_naming_the_value() -> None:
    ok = np.array([0, 1, 2])
    with pytest.raises(ValueError, match=r"lambda must be in \[0, 1\), got 1.0"):
        cross_entropies(ok, ok, 3, 1.0)
    with pytest.raises(ValueError, match=r"valid token ids span \[0, 5\], outside the vocabulary \[0, 3\)"):
        cross_entropies(ok, np.array([0, 5]), 3)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        cross_entropies(ok, np.array([1]), 3)


def test_the_command_scores_a_built_directory_and_writes_its_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nam56r.training.data.build import CorpusConfig, build
    from nam56r.training.data.cli import main

    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i}.h").write_text("".join(f"int value_{j % 7} = {j};\n" for j in range(i, i + 30)))
    out = tmp_path / "data"
    build(out, 300, CorpusConfig(sources=(src,), valid_fraction=0.2))
    assert main(["baselines", str(out)]) == 0
    assert "interpolated bigram (lambda 0.7)" in capsys.readouterr().out
    record = json.loads((out / BASELINES_FILE).read_text())
    assert record["schema"] == "nam56r.data_baselines/1" and record["valid_tokens"] > 0
    assert record["bigram_nats"] < record["unigram_nats"]
    with pytest.raises(SystemExit, match="no training data in"):
        main(["baselines", str(tmp_path / "none")])
