"""DSA phases: the schedule, its lowering through Megatron's parser, resume in either phase through
our forward step at Megatron's iteration, the switch on Megatron's real DSAttention (its selected keys
on a CPU forward), and the warm-up's loss being Megatron's dense indexer KL."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nam56r.training.data.layout import DataPaths
from nam56r.training.launcher.flags import RunPaths, megatron_flags, megatron_validate
from nam56r.training.phases import DsaPhases, PhaseSwitch
from nam56r.training.recipe import RECIPES, RecipeError, get_recipe

DATA = DataPaths(Path("/data/train"), None, Path("/data/tok"))
RUN = RunPaths(Path("/runs/r"), None, None)


# ---- the schedule


def test_phase_of_each_step_with_its_boundaries():
    phases = DsaPhases(dense_warmup_steps=5)
    assert [phases.phase_at(s) for s in (1, 4, 5, 6, 7, 1000)] == ["dense-warmup"] * 3 + ["sparse"] * 3
    assert DsaPhases(0).phase_at(1) == "sparse"
    assert DsaPhases(1).phase_at(1) == "dense-warmup" and DsaPhases(1).phase_at(2) == "sparse"
    with pytest.raises(ValueError, match="numbered from 1, got 0"):
        phases.phase_at(0)
    assert phases.describe() == "dense warm-up steps 1-5, sparse from step 6"


def test_recipes_name_their_warmup():
    warmups = {name: make().phases.dsa.dense_warmup_steps for name, make in RECIPES.items()}
    assert warmups == {"tiny-1gpu": 5, "proxy-1gpu": 50, "h200x2-ep2": 50, "h200x8-bf16": 1000, "h200x8-fp8": 1000}
    for name in ("tiny-1gpu", "proxy-1gpu", "h200x8-bf16"):
        get_recipe(name)  # each checks


@pytest.mark.parametrize(
    ("warmup", "steps", "fragment"),
    [
        (-1, 200, "dense_warmup_steps must be >= 0"),
        (200, 200, "dense_warmup_steps 200 must be below steps 200"),
        (500, 200, "never train sparse"),
    ],
)
def test_bad_warmups_are_refused(warmup, steps, fragment):
    with pytest.raises(RecipeError, match=fragment):
        get_recipe("tiny-1gpu", dense_warmup_steps=warmup, steps=steps)


def test_a_sequence_the_fused_kernels_take_only_at_the_sparse_topk_is_refused_for_the_warmup(megatron_built):
    """seq 500: top-k 256 runs fused, but the warm-up's top-k of 500 is no multiple of the sparse MLA's 64."""
    with pytest.raises(RecipeError, match=r"dense warm-up \(top-k = seq_length 500\): fused sparse MLA: top-k 500") as err:
        get_recipe("tiny-1gpu", seq_length=500)
    assert all("dense warm-up" in p and p.endswith("or pass --dense-warmup-steps 0") for p in err.value.problems)
    get_recipe("tiny-1gpu", seq_length=500, dense_warmup_steps=0)


def test_zero_warmup_is_sparse_from_the_start_and_any_step_count_is_fine():
    recipe = get_recipe("proxy-1gpu", dense_warmup_steps=0, steps=3, warmup_steps=1)
    assert recipe.phases.dsa.phase_at(1) == "sparse"


# ---- the lowering


@pytest.mark.parametrize("warmup", [0, 7])
def test_the_schedule_lowers_to_a_flag_megatrons_parser_takes(megatron_built, warmup):
    from nam56r.training.launcher.pretrain import phase_switch_from_args

    recipe = get_recipe("tiny-1gpu", dense_warmup_steps=warmup)
    argv = megatron_flags(recipe, recipe.model_config(), DATA, RUN, "local")
    assert argv[argv.index("--nam56r-dense-warmup-steps") + 1] == str(warmup)
    with contextlib.redirect_stdout(io.StringIO()):
        margs = megatron_validate(argv, recipe.world_size)
    assert margs.nam56r_dense_warmup_steps == warmup
    switch = phase_switch_from_args(margs)
    assert switch.phases == DsaPhases(warmup) and switch.seq_length == recipe.model_config().seq_length == 512


def test_a_rank_refuses_a_schedule_the_launcher_would_have_refused(megatron_built):
    from nam56r.training.launcher.pretrain import phase_switch_from_args

    with pytest.raises(SystemExit, match="--nam56r-dense-warmup-steps: dense_warmup_steps 200 must be below steps 200"):
        phase_switch_from_args(SimpleNamespace(nam56r_dense_warmup_steps=200, train_iters=200, seq_length=512))


def test_launcher_option_help_and_refusal(megatron_built, capsys):
    from nam56r.training.launcher.train import main as train_main

    with pytest.raises(SystemExit):
        train_main(["--help"])
    assert "--dense-warmup-steps N" in capsys.readouterr().out
    assert train_main(["--recipe", "tiny-1gpu", "--dense-warmup-steps", "-3", "--dry-run"]) == 2
    assert "dense_warmup_steps must be >= 0 (0: sparse from the first step), got -3" in capsys.readouterr().err
    assert train_main(["--recipe", "tiny-1gpu", "--steps", "20", "--dense-warmup-steps", "20", "--dry-run"]) == 2
    assert "lower --dense-warmup-steps (0 turns the warm-up off) or raise --steps" in capsys.readouterr().err


# ---- resume in phase, through our forward step at Megatron's iteration


class ModelChunk(torch.nn.Module):
    """Stands in for the model chunk Megatron's schedules hand the forward step (Mamba-3's kernels need a
    GPU for a whole forward): it holds the real tiny model, whose DSA layers the switch sets, and records
    their top-k when called."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model
        self.seen: list[tuple[str | None, set[int]]] = []

    def forward(self, tokens, position_ids, attention_mask, *, labels, loss_mask):
        from nam56r.model.dsa_warmup import dsa_layers, dsa_phase_of

        self.seen.append((dsa_phase_of(self), {layer.index_topk for layer in dsa_layers(self)}))
        return torch.zeros_like(tokens, dtype=torch.float32)


@pytest.fixture
def tiny_chunk(tiny_cpu_model):
    from nam56r.model.dsa_warmup import apply_dsa_phase

    chunk = ModelChunk(tiny_cpu_model.model)
    yield chunk
    apply_dsa_phase(chunk, "sparse", 512)  # as built: the session's model is shared


def _run_steps(chunk: ModelChunk, monkeypatch, *, warmup: int, first_iteration: int, train_iters: int) -> tuple[list, list[str]]:
    """One process of a run: Megatron's train loop from `first_iteration` (0, or the iteration a --load read
    from the checkpoint), setting `args.curr_iteration` before each step's forward as train() does."""
    from megatron.training import global_vars

    from nam56r.model.dsa_warmup import apply_dsa_phase
    from nam56r.training.launcher.pretrain import forward_step

    apply_dsa_phase(chunk, "sparse", 512)  # a fresh process: the layers as the model provider built them
    args = SimpleNamespace(save=None, nam56r_nonfinite_loss_at_step=None, curr_iteration=0)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    logs: list[str] = []
    switch = PhaseSwitch(DsaPhases(warmup), seq_length=512, log=logs.append)
    chunk.seen.clear()
    batch = {k: torch.zeros(1, 4, dtype=torch.long) for k in ("tokens", "labels", "loss_mask", "position_ids")}
    for iteration in range(first_iteration, train_iters):
        args.curr_iteration = iteration
        forward_step(iter([batch]), chunk, phase_switch=switch)
    return list(chunk.seen), logs


DENSE, SPARSE = ("dense-warmup", {512}), ("sparse", {256})


def test_one_run_switches_inside_the_run_at_the_warmups_end(megatron_built, tiny_chunk, monkeypatch):
    seen, logs = _run_steps(tiny_chunk, monkeypatch, warmup=5, first_iteration=0, train_iters=8)
    assert seen == [DENSE] * 5 + [SPARSE] * 3  # steps 1-5, then 6-8
    assert len(logs) == 2
    assert logs[0].startswith("DSA phase: step 1 starts in dense-warmup") and "until step 5" in logs[0]
    assert logs[1].startswith("DSA phase: step 6 switches to sparse") and "3 DSA layer(s) set" in logs[1]


@pytest.mark.parametrize("resume_at", [2, 4])
def test_a_run_resumed_in_the_warmup_finishes_it_and_switches_at_its_end(megatron_built, tiny_chunk, monkeypatch, resume_at):
    uninterrupted, _ = _run_steps(tiny_chunk, monkeypatch, warmup=5, first_iteration=0, train_iters=8)
    resumed, logs = _run_steps(tiny_chunk, monkeypatch, warmup=5, first_iteration=resume_at, train_iters=8)
    assert resumed == uninterrupted[resume_at:]
    assert resumed[: 5 - resume_at] == [DENSE] * (5 - resume_at) and resumed[5 - resume_at :] == [SPARSE] * 3
    assert logs[0].startswith(f"DSA phase: step {resume_at + 1} starts in dense-warmup")
    assert logs[1].startswith("DSA phase: step 6 switches to sparse")


@pytest.mark.parametrize("resume_at", [5, 6])
def test_a_run_resumed_at_or_after_the_warmup_is_sparse_from_its_first_step(megatron_built, tiny_chunk, monkeypatch, resume_at):
    resumed, logs = _run_steps(tiny_chunk, monkeypatch, warmup=5, first_iteration=resume_at, train_iters=8)
    assert resumed == [SPARSE] * (8 - resume_at)
    expected = f"DSA phase: step {resume_at + 1} starts in sparse: sparse (the indexer's top-k attended, top-k KL); 3 DSA layer(s) set"
    assert logs == [expected]


# ---- the switch on Megatron's real DSAttention


def test_the_switch_sets_megatrons_dsattention_and_a_forward_attends_every_causal_key(tiny_cpu_model, monkeypatch):
    """Layer 5 (a Full DSA layer) on CPU in training mode, 300 tokens, top-k 256: in the warm-up the last
    query attends all 300 keys and the indexer loss runs; sparse, it attends its 256."""
    from megatron.core.transformer.experimental_attention_variant import dsa

    from nam56r.model.dsa_warmup import apply_dsa_phase, dsa_layers, dsa_phase_of
    from nam56r.model.model import cuda_buffers_on

    model = tiny_cpu_model.model
    layers = dsa_layers(model)
    assert len(layers) == 3 and all(isinstance(layer, dsa.DSAttention) for layer in layers)
    selected: list[torch.Tensor] = []
    real = dsa._run_sparse_attention

    def recording(**kwargs):
        selected.append(kwargs["topk_indices"])
        return real(**kwargs)

    monkeypatch.setattr(dsa, "_run_sparse_attention", recording)
    layer = model.decoder.layers[4]
    x = torch.randn(300, 1, model.config.hidden_size)
    keys_of_last_query = {}
    try:
        model.train()
        for phase in ("dense-warmup", "sparse"):
            assert apply_dsa_phase(model, phase, seq_length=512) == 3
            assert dsa_phase_of(model) == phase
            selected.clear()
            model.topk_cache.begin_forward()
            with cuda_buffers_on("cpu"):
                out = layer(x, attention_mask=None)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()  # the indexer loss rides on the output (DSAIndexerLossAutoScaler)
            last = selected[0][0, -1]
            keys_of_last_query[phase] = set(last[last >= 0].tolist())
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()
        apply_dsa_phase(model, "sparse", seq_length=512)
    assert keys_of_last_query["dense-warmup"] == set(range(300))
    assert len(keys_of_last_query["sparse"]) == 256


# ---- the warm-up's loss is Megatron's dense indexer KL


def _indexer_losses(topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's compute_dsa_indexer_loss on one causal batch, with its top-k support (sparse_loss=True) at
    `topk` and with the dense support: (sparse loss, dense loss, their gradients on the index scores)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import compute_dsa_indexer_loss, fused_qk_topk_naive

    from nam56r.model.model import single_process_groups

    torch.manual_seed(0)
    sq, b, heads, dim, index_heads, index_dim = 24, 2, 4, 16, 3, 8
    mask = torch.full((sq, sq), float("-inf")).triu(1)
    q = torch.randn(sq, b, index_heads, index_dim)
    k = torch.randn(sq, b, index_dim)
    weights = torch.rand(sq, b, index_heads)
    query, key = torch.randn(sq, b, heads, dim), torch.randn(sq, b, heads, dim)
    scores, topk_indices = fused_qk_topk_naive(q, k, weights, topk, mask=mask)
    results = []
    for sparse in (True, False):
        leaf = scores.detach().clone().requires_grad_()
        index_scores = leaf * 1.0  # Megatron masks the scores in place
        loss = compute_dsa_indexer_loss(index_scores, topk_indices, query, key, 0.25, 1.0, sparse, single_process_groups(), mask=mask)
        loss.backward()
        results.append((loss.detach(), leaf.grad))
    (sparse_loss, sparse_grad), (dense_loss, dense_grad) = results
    return sparse_loss, dense_loss, sparse_grad, dense_grad


def test_the_topk_kl_at_every_key_is_megatrons_dense_indexer_kl(megatron_built):
    sparse_loss, dense_loss, sparse_grad, dense_grad = _indexer_losses(topk=24)  # the warm-up: k = s
    assert dense_loss > 0
    torch.testing.assert_close(sparse_loss, dense_loss)
    torch.testing.assert_close(sparse_grad, dense_grad)
    sparse_loss, dense_loss, _, _ = _indexer_losses(topk=8)  # the sparse phase's support is smaller: another loss
    assert not torch.allclose(sparse_loss, dense_loss)


# ---- the GPU resume check resumes inside the warm-up


def test_the_gpu_resume_check_resumes_inside_the_warmup_and_crosses_the_switch(tmp_path, monkeypatch):
    import nam56r.training.runs.resume_check as resume_check
    from nam56r.training.runs.logged_run import LoggedRun

    check = resume_check.ResumeCheck(steps=20, resume_at=10)
    assert check.dense_warmup_steps == 15  # the checkpoint (10) is in the warm-up; the resumed run switches at 16
    with pytest.raises(ValueError, match=r"dense_warmup 20 must lie in \[0, steps 20\)"):
        resume_check.ResumeCheck(steps=20, resume_at=10, dense_warmup=20)
    launched: list[list[str]] = []

    def record(name, run_dir, args, *a, **k):
        launched.append(args)
        return LoggedRun(["train"], 1, 0.0, tmp_path / f"{name}.log")  # the first run "failed": nothing more is launched

    monkeypatch.setattr(resume_check, "train_run", record)
    resume_check.run_resume_check(check, tmp_path, tmp_path / "data", echo=False)
    assert launched[0][launched[0].index("--dense-warmup-steps") + 1] == "15"


def test_the_resume_check_drops_the_unread_last_checkpoint_before_resuming(tmp_path, monkeypatch):
    # At the proxy's size a checkpoint is 44 GiB: the uninterrupted run's last one and the resumed run's would not
    # fit a node's disk beside the one the resume reads.
    import nam56r.training.runs.resume_check as resume_check
    from nam56r.training.runs.faults import iteration_checkpoint
    from nam56r.training.runs.layout import RunDir
    from nam56r.training.runs.logged_run import LoggedRun

    check = resume_check.ResumeCheck(steps=20, resume_at=10)
    checkpoints = RunDir(tmp_path / "full").checkpoints
    seen: list[list[str]] = []

    def fake_train(name, run_dir, args, *a, **k):
        if name == "full":
            for step in (10, 20):
                iteration_checkpoint(checkpoints, step).mkdir(parents=True)
                (iteration_checkpoint(checkpoints, step) / "shard").write_text("x")
        else:
            seen.append(sorted(p.name for p in checkpoints.iterdir()))
        return LoggedRun(["train"], 0, 0.0, tmp_path / f"{name}.log")

    monkeypatch.setattr(resume_check, "train_run", fake_train)
    resume_check.run_resume_check(check, tmp_path, tmp_path / "data", echo=False)
    assert seen == [["iter_0000010"]]


def test_each_resumed_run_reads_the_same_checkpoint_with_its_own_options(tmp_path, monkeypatch):
    import nam56r.training.runs.resume_check as resume_check
    from nam56r.training.runs.logged_run import LoggedRun

    check = resume_check.ResumeCheck(steps=20, resume_at=10, train_args=("--ep", "4"), resumes=((), ("--ep", "2")))
    launched: dict[str, list[str]] = {}

    def fake_train(name, run_dir, args, *a, **k):
        launched[name] = args
        return LoggedRun(["train"], 0, 0.0, tmp_path / f"{name}.log")

    monkeypatch.setattr(resume_check, "train_run", fake_train)
    resume_check.run_resume_check(check, tmp_path, tmp_path / "data", echo=False)
    assert list(launched) == ["full", "resumed", "resumed-2"]
    full_checkpoints = str(tmp_path / "full" / "checkpoints")
    for name in ("resumed", "resumed-2"):
        args = launched[name]
        assert args[args.index("--load") + 1] == full_checkpoints and args[args.index("--ckpt-step") + 1] == "10"
    # argparse keeps the last --ep: the saving run's for "resumed", 2 for "resumed-2"
    assert [a for i, a in enumerate(launched["resumed"]) if launched["resumed"][i - 1] == "--ep"] == ["4"]
    assert [a for i, a in enumerate(launched["resumed-2"]) if launched["resumed-2"][i - 1] == "--ep"] == ["4", "2"]
