"""The launcher end to end on CPU: dry runs over real built data, its refusals, the torchrun and
SLURM commands, and the per-GPU forward step on the tiny model with a real Megatron GPTDataset batch."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nam56r.training.data.layout import DataDir
from nam56r.training.launcher.launch import LaunchError, Rendezvous, runtime_env, slurm_script, torchrun_command
from nam56r.training.launcher.train import main as train_main
from nam56r.training.recipe import RecipeError, get_recipe

TINY_VOCAB = 512


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory, megatron_built) -> Path:
    """A real (small) default-style corpus: 40 PyTorch headers, byte-level BPE of 512 tokens."""
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir

    out = tmp_path_factory.mktemp("data") / "cpp"
    build(out, TINY_VOCAB, CorpusConfig(sources=(torch_include_dir(),), max_docs=40))
    return out


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main(argv)
    return code, out.getvalue(), err.getvalue()


def _command_line(stdout: str) -> list[str]:
    lines = stdout.splitlines()
    return shlex.split(lines[lines.index("command:") + 1])


def test_dry_run_prints_checks_preflight_and_the_exact_command(tiny_data, tmp_path):
    code, out, err = _run(["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path / "run")])
    assert code == 0, err
    assert "megatron flags: validated by Megatron's parser as 1 rank(s); its model config matches nam56r-tiny's" in out
    assert "preflight:" in out and "patches megatron-lm" in out
    cmd = _command_line(out)
    assert cmd[:2] == ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "TRITON_CACHE_AUTOTUNING=1"]
    assert cmd[3:6] == ["-m", "torch.distributed.run", "--nproc-per-node"]
    flags = cmd[cmd.index("nam56r.training.launcher.pretrain") + 1 :]
    assert flags[flags.index("--train-data-path") + 1] == str(DataDir(tiny_data).train_prefix)
    assert flags[flags.index("--tokenizer-model") + 1] == str(DataDir(tiny_data).tokenizer_dir)
    assert flags[flags.index("--save") + 1] == str(tmp_path / "run" / "checkpoints")
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_overrides_reach_the_flags(tiny_data, tmp_path):
    code, out, err = _run(
        [
            "--recipe",
            "tiny-1gpu",
            "--dry-run",
            "--data",
            str(tiny_data),
            "--run-dir",
            str(tmp_path),
            "--mbs",
            "4",
            "--gbs",
            "32",
            "--steps",
            "7",
            "--warmup",
            "2",
        ]
    )
    assert code == 0, err
    flags = _command_line(out)
    assert flags[flags.index("--micro-batch-size") + 1] == "4"
    assert flags[flags.index("--global-batch-size") + 1] == "32"
    assert flags[flags.index("--train-iters") + 1] == "7"


def test_model_override_and_no_save_reach_the_flags(tiny_data, tmp_path):
    base = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path / "run")]
    code, out, err = _run([*base, "--model", "nam56r-proxy", "--no-save"])
    assert code == 0, err
    assert "model nam56r-proxy" in out and "checkpoints: none (--no-save)" in out
    flags = _command_line(out)
    assert "--save" not in flags
    assert flags[flags.index("--hidden-size") + 1] == "4096"  # the proxy's width, not the tiny recipe's preset
    code, _, err = _run([*base, "--no-save", "--save", str(tmp_path / "ckpt")])
    assert code == 2 and "--no-save and --save contradict" in err


def test_linear_ce_picks_the_heads_loss_path(tiny_data, tmp_path):
    from nam56r.model.linear_cross_entropy import CHUNKED_LINEAR_CE

    base = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data)]
    code, out, err = _run([*base, "--run-dir", str(tmp_path / "default")])
    assert code == 0, err
    flags = _command_line(out)  # default: chunked
    assert "--fused-linear-cross-entropy" in flags and flags[flags.index("--fused-linear-cross-entropy-impl") + 1] == CHUNKED_LINEAR_CE
    assert ("index-cache on, dsa-indexer fused-tilelang-loss, linear-ce chunked, moe-dispatch fused-permute, "
            "expert-activation fused") in out
    previous = ["--linear-ce", "liger", "--moe-dispatch", "megatron", "--dsa-indexer", "megatron", "--index-cache", "off",
                "--expert-activation", "eager"]
    code, out, err = _run([*base, "--run-dir", str(tmp_path / "liger"), *previous])
    assert code == 0, err
    assert ("index-cache off, dsa-indexer megatron, linear-ce liger, moe-dispatch megatron, expert-activation eager"
            in out)
    flags = _command_line(out)
    assert "--fused-linear-cross-entropy" in flags and "--fused-linear-cross-entropy-impl" not in flags
    code, out, err = _run([*base, "--run-dir", str(tmp_path / "logits"), "--linear-ce", "logits"])
    assert code == 0, err
    assert "--fused-linear-cross-entropy" not in _command_line(out)  # Megatron parses it; the heads materialize logits


def test_expert_activation_follows_the_backend_and_fused_is_refused_on_te(tiny_data, tmp_path):
    recipe = get_recipe("tiny-1gpu", kernels=False)
    assert recipe.model_config("local").moe.expert_activation == "fused"
    assert recipe.model_config("te").moe.expert_activation == "eager"  # TE's grouped experts run their own
    assert recipe.model_config().moe.expert_activation == "eager"  # no backend named: the preset's
    fused = get_recipe("tiny-1gpu", kernels=False, expert_activation="fused")
    with pytest.raises(RecipeError, match="backend 'te' has TE's grouped experts"):
        fused.model_config("te")
    with pytest.raises(RecipeError, match="backend 'te' has TE's grouped experts"):
        get_recipe("tiny-1gpu", kernels=False, expert_activation="fused", backend="te")
    base = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path)]
    code, _, err = _run([*base, "--backend", "te", "--expert-activation", "fused"])
    assert code == 2 and "backend 'te' has TE's grouped experts" in err


def test_recompute_reaches_the_flags_and_a_full_recompute_beside_it_is_refused(tiny_data, tmp_path):
    base = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path)]
    code, out, err = _run([*base, "--recompute", "mamba,attention"])
    assert code == 0, err
    assert "recompute mamba,attention" in out
    flags = _command_line(out)
    lowered = flags[flags.index("--recompute-granularity") :][:5]
    assert lowered == ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mla_up_proj"]
    full = ["--", "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    code, out, _ = _run([*base, "--recompute", "mamba", *full])
    assert code == 1 and "it cannot be mixed with --recompute mamba" in out  # the dry run names it; a real launch stops
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(io.StringIO()) as err:
        train_main([*base, "--recompute", "mlp"])
    assert exited.value.code == 2 and "give none, all, or families joined by commas" in err.getvalue()


def test_mock_data_and_null_tokenizer_are_refused(tiny_data, tmp_path):
    for extra in (["--mock-data"], ["--tokenizer-type", "NullTokenizer"]):
        code, _, err = _run(["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path), "--", *extra])
        assert code == 2 and "refused for real runs" in err


def test_a_save_directory_holding_a_checkpoint_is_refused_unless_resumed(tiny_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")
    base = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--run-dir", str(tmp_path / "run"), "--save", str(ckpt)]
    code, _, err = _run(base)
    assert code == 2 and "already holds a checkpoint" in err
    code, out, err = _run([*base, "--load", str(ckpt)])
    assert code == 0, err
    flags = _command_line(out)
    assert flags[flags.index("--load") + 1] == str(ckpt)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "20"  # nothing touched


def test_load_without_a_checkpoint_is_refused(tiny_data, tmp_path):
    code, _, err = _run(["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--load", str(tmp_path)])
    assert code == 2 and "no Megatron checkpoint there" in err


def test_data_larger_than_the_model_vocab_is_refused(tiny_data, tmp_path):
    """The tiny data has a 512-token vocab; a model with a smaller vocab cannot embed it."""
    from nam56r.training.data.manifest import read_data_manifest

    with pytest.raises(ValueError, match="rebuild it with"):
        read_data_manifest(tiny_data).check_vocab(256)
    argv = ["--recipe", "tiny-1gpu", "--dry-run", "--run-dir", str(tmp_path)]
    code, _, err = _run([*argv, "--data", str(tiny_data)])
    assert code == 0, err
    big = tmp_path / "big"
    from nam56r.training.data.build import CorpusConfig, build, torch_include_dir

    build(big, 600, CorpusConfig(sources=(torch_include_dir(),), max_docs=40))
    code, _, err = _run([*argv, "--data", str(big)])
    assert code == 2 and "vocab_size is 512" in err


def test_bare_prefix_needs_a_tokenizer(tiny_data, tmp_path):
    code, _, err = _run(["--recipe", "tiny-1gpu", "--dry-run", "--data", str(DataDir(tiny_data).train_prefix)])
    assert code == 2 and "pass --tokenizer DIR" in err
    code, _, err = _run(["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tmp_path / "nothing")])
    assert code == 2 and f"--data {tmp_path / 'nothing'} does not exist: give a data directory with data.json" in err


def test_conflicting_allocator_setting_is_refused_not_replaced():
    with pytest.raises(LaunchError, match="expandable_segments:True"):
        runtime_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert runtime_env({}) == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TRITON_CACHE_AUTOTUNING": "1"}
    kept = "expandable_segments:True,max_split_size_mb:512"
    assert runtime_env({"PYTORCH_CUDA_ALLOC_CONF": kept})["PYTORCH_CUDA_ALLOC_CONF"] == kept


def test_triton_autotune_cache_is_on_for_mamba3s_real_kernels_unless_the_user_says_otherwise(megatron_built):
    """The launcher's environment reaches the autotuners of mamba_ssm's Mamba-3 Triton kernels (a fresh
    interpreter, as a rank is: Triton reads the variable when each autotuner is built, at import)."""
    assert runtime_env({"TRITON_CACHE_AUTOTUNING": "0"})["TRITON_CACHE_AUTOTUNING"] == "0"
    script = (
        "from triton.runtime.autotuner import Autotuner\n"
        "from mamba_ssm.ops.triton.mamba3 import angle_dt, mamba3_mimo_utils\n"
        "tuners = [o for m in (angle_dt, mamba3_mimo_utils) for o in vars(m).values() if isinstance(o, Autotuner)]\n"
        "print(len(tuners), sorted({t.cache_results for t in tuners}))\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_AUTOTUNING")}
    for inherited, want in (({}, "[True]"), ({"TRITON_CACHE_AUTOTUNING": "0"}, "[False]")):
        env = {**base, **runtime_env(inherited)}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        count, seen = proc.stdout.split(maxsplit=1)
        assert int(count) >= 6 and seen.strip() == want, proc.stdout  # the MIMO path alone calls 6 of them


def test_multi_node_needs_a_rendezvous(tmp_path):
    recipe = get_recipe("h200x8-bf16", nodes=2, global_batch=128)
    with pytest.raises(LaunchError, match="--rdzv-endpoint"):
        torchrun_command(recipe, ["--x"], tmp_path)
    cmd = torchrun_command(recipe, ["--x"], tmp_path, Rendezvous("node0:29500", 1), python="python")
    assert cmd[cmd.index("--nnodes") + 1] == "2" and cmd[cmd.index("--node-rank") + 1] == "1"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "node0:29500" and "--standalone" not in cmd


def test_slurm_script_is_valid_bash_with_preflight_on_every_node(tmp_path):
    recipe = get_recipe("h200x8-bf16", nodes=4, global_batch=256)
    script = slurm_script(recipe, ["--hidden-size", "4096", "--tokenizer-model", "/path with space/tok"], tmp_path / "run", tmp_path)
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "nam56r.training.launcher.preflight --preset nam56r" in script
    assert '--rdzv-endpoint="$head_node:29500"' in script
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in script
    assert 'export TRITON_CACHE_AUTOTUNING="${TRITON_CACHE_AUTOTUNING:-1}"' in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True).returncode == 0
    # the quoted flag survives shell parsing intact
    assert "'/path with space/tok'" in script


def test_forward_step_on_a_real_dataset_batch(tiny_data):
    """Megatron's GPTDataset over the built prefix feeds our forward step; the loss contract holds."""
    import torch
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from nam56r.training.data.format import load_megatron_tokenizer
    from nam56r.training.data.layout import DataPaths
    from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate
    from nam56r.training.launcher.pretrain import forward_step, gpt_dataset_config

    recipe = get_recipe("tiny-1gpu")
    model = recipe.model_config()
    layout = DataDir(tiny_data)
    data = DataPaths(layout.train_prefix, layout.valid_prefix, layout.tokenizer_dir)
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(megatron_flags(recipe, model, data, RunPaths(Path("/r"), None, None), "local"), 1)
    tokenizer = load_megatron_tokenizer(layout.tokenizer_dir)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [4, 2, None], lambda: True, gpt_dataset_config(margs, tokenizer)).build()
    sample = train[0]
    assert sample["tokens"].shape == (model.seq_length,)
    assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # labels are the next tokens
    assert valid is not None and len(valid) >= 2

    batch = torch.utils.data.default_collate([train[i] for i in range(2)])
    batch["loss_mask"][1, :5] = 0  # masked positions must not count

    class PerTokenLoss(torch.nn.Module):
        """Stands in for NAM56RModel's contract (Mamba-3's kernels need a GPU): per-token CE of a
        bigram table, called the way Megatron's schedules call the model."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(model.vocab_size, model.vocab_size)
            self.calls: list[tuple] = []

        def forward(self, tokens, position_ids, attention_mask, *, labels, loss_mask):
            self.calls.append((tokens, position_ids, attention_mask, labels, loss_mask))
            logits = self.table(tokens)
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")

    net = PerTokenLoss()
    output, loss_func = forward_step(iter([batch]), net)
    tokens, position_ids, attention_mask, labels, loss_mask = net.calls[0]
    assert torch.equal(tokens, batch["tokens"]) and torch.equal(labels, batch["labels"])
    assert attention_mask is None  # causal masks come from the model, not the loader
    assert output.shape == (2, model.seq_length)
    loss, num_tokens, report = loss_func(output)
    assert num_tokens.item() == 2 * model.seq_length - 5
    assert loss.item() == pytest.approx((output * batch["loss_mask"]).sum().item(), rel=1e-6)
    assert report["lm loss"][1].item() == num_tokens.item()
    with pytest.raises(FloatingPointError, match="the loss is nan outside a training step"):
        loss_func(torch.full_like(output, float("nan")))
    with pytest.raises(KeyError, match="batch lacks"):
        forward_step(iter([{"tokens": batch["tokens"]}]), net)


def test_multi_node_without_slurm_needs_a_shared_run_dir(tiny_data, tmp_path):
    argv = ["--recipe", "tiny-1gpu", "--dry-run", "--data", str(tiny_data), "--nodes", "2", "--gbs", "32"]
    code, _, err = _run([*argv, "--rdzv-endpoint", "node0:29500"])
    assert code == 2 and "pass --run-dir" in err
    code, out, err = _run([*argv, "--rdzv-endpoint", "node0:29500", "--node-rank", "1", "--run-dir", str(tmp_path)])
    assert code == 0, err
    cmd = _command_line(out)
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[cmd.index("--nnodes") + 1] == "2"


def test_missing_default_data_is_built_at_the_paths_already_in_the_flags(megatron_built, tmp_path, monkeypatch):
    """A launch without --data lowers the default corpus's paths first and builds it afterwards:
    the build must land exactly there (a 40-document corpus here, to keep the test fast)."""
    import argparse
    from dataclasses import replace

    import nam56r.training.data.build as data_build
    import nam56r.training.data.layout as data_dir
    import nam56r.training.data.pinned as pinned
    from nam56r.training.launcher.data_choice import choose_data, ensure_data

    real_build = data_build.build
    monkeypatch.setattr(data_dir, "default_data_dir", lambda vocab_size: tmp_path / f"pinned-v{vocab_size}")
    # the pinned releases have their own test (tests/data/test_pinned_corpus.py); here the headers torch ships stand in
    monkeypatch.setattr(pinned, "default_corpus", lambda: data_build.CorpusConfig(sources=(data_build.torch_include_dir(),)))
    monkeypatch.setattr(
        data_build, "build", lambda out, vocab, corpus, command=None: real_build(out, vocab, replace(corpus, max_docs=40), command=command)
    )
    args = argparse.Namespace(data=None)
    before = choose_data(args, TINY_VOCAB)
    assert not before.ready and "not built yet" in before.note
    with contextlib.redirect_stdout(io.StringIO()):
        ensure_data(before, TINY_VOCAB)
    after = choose_data(args, TINY_VOCAB)
    assert after.ready and after.paths == before.paths
    assert Path(f"{after.paths.train_prefix}.bin").is_file() and after.paths.tokenizer_dir.is_dir()


def test_launches_starting_at_once_build_the_default_corpus_once(megatron_built, tmp_path, monkeypatch):
    """Two launches without --data on one node (e.g. two seeds): the second waits for the first's build and uses it."""
    import argparse
    import threading
    from dataclasses import replace

    import nam56r.training.data.build as data_build
    import nam56r.training.data.layout as data_dir
    import nam56r.training.data.pinned as pinned
    from nam56r.training.launcher.data_choice import choose_data, ensure_data

    real_build, builds = data_build.build, []

    def counted_build(out, vocab, corpus, command=None):
        builds.append(out)
        return real_build(out, vocab, replace(corpus, max_docs=40), command=command)

    monkeypatch.setattr(data_dir, "default_data_dir", lambda vocab_size: tmp_path / f"pinned-v{vocab_size}")
    monkeypatch.setattr(pinned, "default_corpus", lambda: data_build.CorpusConfig(sources=(data_build.torch_include_dir(),)))
    monkeypatch.setattr(data_build, "build", counted_build)
    choice = choose_data(argparse.Namespace(data=None), TINY_VOCAB)
    errors: list[BaseException] = []

    def launch() -> None:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                ensure_data(choice, TINY_VOCAB)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    launches = [threading.Thread(target=launch) for _ in range(2)]
    for thread in launches:
        thread.start()
    for thread in launches:
        thread.join()

    assert errors == [] and len(builds) == 1
    assert choose_data(argparse.Namespace(data=None), TINY_VOCAB).ready
