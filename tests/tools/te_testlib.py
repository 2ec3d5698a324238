"""Stand-ins for TransformerEngine and Apex in the offline tests: real wheels, a real sdist and a real git repository,
small, built here. Both compile sources are projects with an in-tree PEP 517 backend that imports torch (as the real
extensions' setup.py do, against the environment's torch: no build isolation) and writes down what it was built with.

  fakete                    TE's meta wheel
  fakete_core               TE's core wheel: 300 KiB, larger than one part of the split tests (it travels in pieces)
  fakete_torch-1.0.tar.gz   TE's PyTorch extension sdist; requires torch, fakete_core==1.0 and tedep
  tedep                     what only the extension requires (the lock's [te] runtime)
  apex (git)                a commit with a submodule entry (gitlink), as NVIDIA/apex has
  torch 9.0+cu130           the node's CUDA torch (torch.version.cuda), installed into the base interpreter
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from offline_testlib import make_wheel

TE_VERSION = "1.0"
CUDA_TORCH = "9.0+cu130"
SUBMODULE_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"

_BACKEND = '''\
"""An in-tree build backend: a wheel of one package recording what it was built with."""
import base64, hashlib, json, os, zipfile

NAME, VERSION, REQUIRES = {name!r}, {version!r}, {requires!r}


def _hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    import torch  # the environment's own: no build isolation

    built_with = {{"torch": torch.__version__, "arch": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                  "env": {{k: v for k, v in os.environ.items() if k.startswith(("NVTE_", "APEX_"))}}}}
    module = NAME.replace("-", "_")
    dist_info = f"{{module}}-{{VERSION}}.dist-info"
    files = {{f"{{module}}/__init__.py": f"BUILT_WITH = {{json.dumps(built_with)}}\\n".encode(),
             f"{{dist_info}}/METADATA": ("Metadata-Version: 2.1\\nName: " + NAME + "\\nVersion: " + VERSION + "\\n"
                                        + "".join(f"Requires-Dist: {{r}}\\n" for r in REQUIRES)).encode(),
             f"{{dist_info}}/WHEEL": b"Wheel-Version: 1.0\\nGenerator: te-testlib\\nRoot-Is-Purelib: false\\nTag: py3-none-any\\n"}}
    record = "".join(f"{{p}},{{_hash(d)}},{{len(d)}}\\n" for p, d in files.items()) + f"{{dist_info}}/RECORD,,\\n"
    files[f"{{dist_info}}/RECORD"] = record.encode()
    name = f"{{module}}-{{VERSION}}-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as wheel:
        for path, data in files.items():
            wheel.writestr(path, data)
    return name
'''

_PYPROJECT = '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'


def project_files(name: str, version: str, requires: tuple[str, ...]) -> dict[str, str]:
    """The files of a project built by the in-tree backend."""
    return {"pyproject.toml": _PYPROJECT, "backend.py": _BACKEND.format(name=name, version=version, requires=list(requires))}


def make_te_sdist(directory: Path, requires: tuple[str, ...]) -> Path:
    path = directory / f"fakete_torch-{TE_VERSION}.tar.gz"
    root = f"fakete_torch-{TE_VERSION}"
    members = project_files("fakete_torch", TE_VERSION, requires)
    members["PKG-INFO"] = ("Metadata-Version: 2.1\nName: fakete_torch\nVersion: 1.0\n"
                           + "".join(f"Requires-Dist: {r}\n" for r in requires))
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{root}/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@dataclass(frozen=True)
class TeIndex:
    files: tuple[Path, ...]  # the pinned files: meta wheel, core wheel, sdist

    def lock_entries(self, runtime: tuple[str, ...] = ("tedep",)) -> str:
        artifacts = "".join(f'\n[[te.artifact]]\nfilename = "{p.name}"\nsha256 = "{hashlib.sha256(p.read_bytes()).hexdigest()}"\n'
                            for p in self.files)
        return (f'\n[te]\nversion = "{TE_VERSION}"\nruntime = {list(runtime)!r}\n'
                'imports = ["fakete", "fakete_torch"]\nenv = { NVTE_PYTORCH_FORCE_BUILD = "TRUE" }\n' + artifacts)


def add_te(index_dir: Path) -> TeIndex:
    """TE's stand-ins into the local index."""
    meta = make_wheel(index_dir, "fakete", TE_VERSION)
    core = make_wheel(index_dir, "fakete_core", TE_VERSION, payload=bytes(range(256)) * 1200)
    make_wheel(index_dir, "tedep", "1.0")
    sdist = make_te_sdist(index_dir, ("torch>=2", f"fakete_core=={TE_VERSION}", "tedep"))
    return TeIndex(files=(meta, core, sdist))


def make_cuda_torch(directory: Path) -> Path:
    """The node's CUDA torch: a wheel whose torch.version.cuda is 13.0."""
    directory.mkdir(parents=True, exist_ok=True)
    return make_wheel(directory, "torch", CUDA_TORCH, init=f'__version__ = "{CUDA_TORCH}"\nclass version:\n    cuda = "13.0"\n')


def make_cuda_home(directory: Path) -> Path:
    """A CUDA toolkit whose nvcc only says its version, with cuDNN's header beside its own."""
    nvcc = directory / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    (directory / "include").mkdir()
    (directory / "include" / "cudnn.h").write_text("/* cuDNN */\n")
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    return directory


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@dataclass(frozen=True)
class ApexRepo:
    path: Path
    commit: str
    tree: str  # the commit's tree without its gitlink

    def lock_entries(self, tree: str | None = None, git_url: str = "https://example.invalid/apex.git") -> str:
        return textwrap.dedent(f'''
            [apex]
            git_url = "{git_url}"
            ref = "master"
            commit = "{self.commit}"
            tree = "{tree or self.tree}"
            imports = ["apex"]
            env = {{ APEX_CPP_EXT = "1" }}
            ''')


def make_apex_repo(path: Path) -> ApexRepo:
    """A git repository whose head commit builds the `apex` distribution and holds a submodule entry."""
    path.mkdir(parents=True)
    git(path, "init", "--quiet", ".")
    for rel, text in project_files("apex", "0.1", ("tedep",)).items():
        (path / rel).write_text(text)
    (path / "csrc").mkdir()
    (path / "csrc" / "kernel.cu").write_text("// a kernel\n")
    git(path, "add", "--all")
    tree = git(path, "write-tree")
    git(path, "update-index", "--add", "--cacheinfo", f"160000,{SUBMODULE_COMMIT},third_party/cudnn-frontend")
    git(path, "commit", "--quiet", "-m", "apex with a submodule")
    return ApexRepo(path=path, commit=git(path, "rev-parse", "HEAD"), tree=tree)
