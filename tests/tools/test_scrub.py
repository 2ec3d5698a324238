"""The private-infrastructure scrubber and the markdown check used by `packs preflight`."""

from __future__ import annotations

import pytest
from nam56r_patchlane.packs.markdown_check import markdown_problems
from nam56r_patchlane.packs.scrub import ScrubConfig, added_lines, scan_text

PUBLIC = """\
host: gpu=NVIDIA H100 80GB HBM3 (sm 9.0) driver=580.159.04 python=3.12.3 torch=2.11.0+cu130 triton=3.6.0 cuda=13.0
mamba_ssm 2.3.2.post1 at a14b1dff0454a3bc27d9eb31355dc01e4b2490ec; Megatron-LM core_v0.19.0; tilelang 0.1.8
See https://github.com/NVIDIA/Megatron-LM/pull/5099 and state-spaces/mamba#965.
File megatron/core/transformer/experimental_attention_variant/dsa.py, function _compute_index_scores.
python repro.py --tree /path/to/Megatron-LM
Shapes [sq, b, h, sk] = [4096, 8, 32, 4096]; peak 32.00 GiB -> 1.05 GiB; 1.2.3 and 10.1 and 1e-3.
nvcc -gencode arch=compute_90a,code=sm_90a; MASTER_ADDR=127.0.0.1
from torch.distributed import init_process_group  # the @torch.compile decorator is fine in code
Kernels are built by `@tilelang.jit` factories (a @tilelang.jit decorator); every 17th row is x[::17].
"""


def test_decorators_in_code_are_not_mentions() -> None:
    code = "    @staticmethod\n@dataclass(frozen=True)\n@torch.no_grad()  # no grads\n"
    assert [f.kind for f in scan_text(code, "repro.py", ScrubConfig())] == []
    assert [f.text for f in scan_text("@alice", "body.md", ScrubConfig())] == ["@alice"]


def kinds(text: str, config: ScrubConfig | None = None) -> list[tuple[str, str]]:
    return [(f.kind, f.text) for f in scan_text(text, "body.md", config or ScrubConfig())]


def test_public_identifiers_are_not_flagged() -> None:
    assert kinds(PUBLIC, ScrubConfig(authors=("torch",))) == []


@pytest.mark.parametrize(("text", "kind", "match"), [
    ("ssh 192.168.1.20", "IP address", "192.168.1.20"),
    ("fe80::1ff:fe23:4567:890a", "IP address", "fe80::1ff:fe23:4567:890a"),
    ("on h200-node-03 today", "host name", "h200-node-03"),
    ("db.corp:5432", "internal host name", "db.corp"),
    ("/scratch/nam56r/ckpt", "private path", "/scratch/nam56r/ckpt"),
    ("C:\\Users\\alice\\x", "private path", "C:\\Users\\alice\\x"),
    ("gs://bucket/x", "bucket URL", "gs://bucket/x"),
    ("https://acct.blob.core.windows.net/c", "bucket URL", "acct.blob.core.windows.net/c"),
    ("merged from wip/mimo-g8", "non-public branch name", "wip/mimo-g8"),
    ("ping carol@team.example.org", "e-mail address of someone not listed as an author", "carol@team.example.org"),
])
def test_private_infrastructure_is_flagged(text: str, kind: str, match: str) -> None:
    assert (kind, match) in kinds(text)


# One credential of each kind, assembled at run time so that no literal token sits in the repository.
SECRETS = [
    ("token " + "ghp_" + "A1b2C3d4" * 5, "GitHub token"),
    ("pat " + "github_pat_" + "11ABCDEFG" * 3, "GitHub token"),
    ("HF_TOKEN=" + "hf_" + "q" * 34, "Hugging Face token"),
    ("key id " + "AKIA" + "IOSFODNN7EXAMPLE", "AWS access key id"),
    ("aws_secret_access_key = " + "wJalrXUtnFEMI/K7MDENG/bPxRfiCY" + "EXAMPLEKEY", "AWS secret access key"),
    ("key=" + "AIza" + "Sy" + "D" * 33, "GCP API key"),
    ('"private_key_id": "' + "0123456789abcdef" * 2 + '",', "GCP service-account key"),
    ("SLACK=" + "xoxb-" + "123456789012-abcdefABCDEF", "Slack token"),
    ("post to https://hooks.slack.com/services/" + "T000/B000/XXXXXXXX", "Slack webhook"),
    ("Authorization: Bearer " + "eyJhbGciOiJIUzI1NiJ9" + ".payload.sig", "bearer token"),
    ("-----BEGIN " + "OPENSSH PRIVATE KEY-----", "private key"),
    ("machine pypi.example.com login jane password " + "s3cr3t-pw", "netrc credentials"),
]


@pytest.mark.parametrize(("text", "kind"), SECRETS)
def test_each_kind_of_secret_is_flagged_masked(text: str, kind: str) -> None:
    found = [f for f in scan_text("intro\n" + text, "body.md", ScrubConfig()) if f.kind == f"secret ({kind})"]
    assert [f.where for f in found] == ["body.md:2"], scan_text(text, "body.md", ScrubConfig())
    assert found[0].text.endswith("(masked)") and len(found[0].text) < 24  # the secret itself is never printed


def test_listed_authors_and_allowed_strings_pass_and_private_terms_are_flagged() -> None:
    config = ScrubConfig(authors=("jane@nam56r.dev", "janedoe"), private_terms=("Project Falcon",), allow=("/opt/conda/envs",))
    assert kinds("Author: jane@nam56r.dev, thanks @janedoe; python at /opt/conda/envs", config) == []
    assert kinds("trained on project falcon nodes", config) == [("private term (patches/packs/scrub.toml)", "Project Falcon")]


def test_only_our_lines_of_a_patch_are_scanned() -> None:
    patch = ("Subject: x\n\nWhy.\n\ndiff --git a/f.py b/f.py\n--- a/f.py\n+++ b/f.py\n@@ -1 +1 @@\n"
             "-CACHE = '/home/upstream/cache'\n+CACHE = None\n")
    assert "/home/upstream" not in added_lines(patch)
    assert "CACHE = None" in added_lines(patch)


def test_markdown_that_renders_passes() -> None:
    body = "# T\n\n```\ncode\n```\n\n| a | b |\n| --- | :---: |\n| 1 | x \\| y |\n\nSee https://github.com/o/r.\n"
    assert markdown_problems(body, "body.md") == []


def test_markdown_breakage_is_named() -> None:
    problems = markdown_problems("| a | b |\n| 1 | 2 |\n\n[log](logs/run.txt)\n<div>x</div>\n~~~\nopen", "body.md")
    assert any("without a header separator row" in p for p in problems)
    assert any("relative link 'logs/run.txt'" in p for p in problems)
    assert any("raw HTML <div>" in p for p in problems)
    assert any("code fence ~~~ is never closed" in p for p in problems)
