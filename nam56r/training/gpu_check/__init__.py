"""The acceptance check of a GPU node, after `nox -s build`: every GPU test, every GPU pack, and a
tiny training run with a checkpoint and a resume, summarized in one JSON file.

    python -m nam56r.training.gpu_check [--out-dir DIR] [--skip-tests] [--skip-packs] [--skip-train]
    nox -s gpu-check -- [the same options]

Parts, in order, each with a status (passed | failed | skipped), its wall time and key figures:
  tests  `pytest -m gpu tests/`: every GPU test's outcome, read from pytest's JUnit XML, and one
         `gpu-tests` record in patches/manifest.toml with the outcomes and the passing tests' sentinel lines. With the
         train part on, the 40-step resume test (tests/nam56r/test_gpu_train.py) is deselected: the
         train part runs the same check at 20 steps.
  packs  `tools/packs.py run --all --needs gpu --jobs 3`: each pack's verdict, per side its exit code and
         sentinels, and the records it appended to patches/manifest.toml.
  train  the tiny recipe for 20 steps with a checkpoint at step 10, then a run resumed from that
         checkpoint for steps 11-20 (nam56r.training.runs.resume_check; --recipe, --train-args and --resume-args
         change the runs, e.g. 4 ranks at EP=4 resumed at EP=4 and at EP=2): per run the first and last loss,
         tokens/s/GPU, TFLOP/s/GPU, peak memory and time to the first step, and the largest |loss
         difference| of the resumed steps against the uninterrupted run; both runs' train records
         appended to patches/manifest.toml (nam56r.training.runs.record).
The parts run at the same time by default: each is a few processes that compile TileLang kernels on
the host and share the GPU (the largest, the proxy model's forward and backward, takes under 50 GiB).
`--sequential` runs them one after another, for a GPU too small to hold them together. The summary
(default runs/gpu-check-<time>/summary.json) is rewritten as each part ends, so a check cut short still
leaves what it found; each part's full output is in a log beside it.
`--kernel-cache DIR` points every part's Triton, TileLang and Inductor caches into a portable kernel cache
(nam56r.training.launcher.kernel_cache): a cache filled on a node of the same stack serves the check without compiling, an empty
DIR is filled by it, and one of another stack is refused (exit 2) naming the difference.
Exit codes: 0 every part that ran passed; 1 a part failed; 2 no CUDA GPU on this host (nothing runs).
"""

from nam56r.training.gpu_check.cli import cuda_gpu_problem, main
from nam56r.training.gpu_check.options import (
    COVERED_BY_TRAIN,
    EXIT_FAILED,
    EXIT_NO_GPU,
    EXIT_USAGE,
    PARTS,
    Options,
    options_from,
    parse_args,
)
from nam56r.training.gpu_check.parts import PART_RUNNERS, merge_packs_parts, packs_part, pytest_part, read_junit, train_part, train_summary
from nam56r.training.gpu_check.runner import run_check
from nam56r.training.gpu_check.summary import SCHEMA, report, write_summary

__all__ = [
    "COVERED_BY_TRAIN", "EXIT_FAILED", "EXIT_NO_GPU", "EXIT_USAGE", "PARTS", "PART_RUNNERS", "SCHEMA", "Options",
    "cuda_gpu_problem", "main", "merge_packs_parts", "options_from", "packs_part", "parse_args", "pytest_part",
    "read_junit", "report", "run_check", "train_part", "train_summary", "write_summary",
]
