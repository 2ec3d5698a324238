"""The two things pip's command line cannot do, done with pip's own classes; run as a script
(`python pip_internals.py MODE JSON`) by the interpreter whose pip and configuration apply.

  locate   find a release file of a project by exact file name through pip's finder (the user's index,
           extra indexes, find-links, certificates, proxies and credentials) and save it, without
           building anything. `pip download` of an sdist always prepares its metadata (pypa/pip#1884),
           which runs its setup.py: mamba-ssm's imports torch, megatron-core's pybind11.
  run      pip's command line with environment markers evaluated for another interpreter. pip applies
           --python-version and --platform to tags and Requires-Python only, and evaluates markers against
           the interpreter running it (pypa/pip#11198); a wheel set for 3.12 resolved from 3.11 would
           miss `dep; python_version >= "3.12"`.

Only the standard library and pip are imported: this file runs under any interpreter that has pip.
Everything here that touches pip's internals is in this file; a pip without them fails with a message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

_UNSUPPORTED = 3  # exit status: this pip lacks an internal this file needs


def _fail_unsupported(what: str, exc: BaseException) -> None:
    import pip

    print(f"pip {pip.__version__} at {Path(pip.__file__).parent} lacks {what} ({type(exc).__name__}: {exc})", file=sys.stderr)
    sys.exit(_UNSUPPORTED)


def _wheel_target(filename: str) -> dict:
    """TargetPython arguments under which the wheel `filename` is compatible (its first tag)."""
    python, abi, plat = (part.split(".")[0] for part in filename[: -len(".whl")].split("-")[-3:])
    target: dict = {"abis": [abi]}
    if plat != "any":
        target["platforms"] = [plat]
    if python[:2] in ("cp", "pp") and python[2:].isdigit():
        target["implementation"] = python[:2]
        target["py_version_info"] = (int(python[2]), int(python[3:] or 0))
    return target


def locate(request: dict) -> None:
    """Save `request["filename"]` (a file of `request["project"]`) into `request["dest"]`; print its URL.

    With `"filename": null`, the sdist of `request["version"]` is taken (there must be exactly one)."""
    try:
        from pip._internal.commands import create_command
        from pip._internal.models.target_python import TargetPython
        from pip._internal.utils.misc import redact_auth_from_url
        from pip._vendor.packaging.version import Version

        command = create_command("download")
        # --no-binary/--only-binary :all: let the wanted kind through whatever the user's config says.
        options, _ = command.parse_args(["--no-binary", ":all:"] if request.get("sdist") else ["--only-binary", ":all:"])
        session = command._build_session(options)
        # A wheel named by file name is looked up with its own tags, not this interpreter's.
        target = TargetPython(**_wheel_target(request["filename"])) if not request.get("sdist") else None
        finder = command._build_package_finder(options=options, session=session, target_python=target, ignore_requires_python=True)
        candidates = finder.find_all_candidates(request["project"])
    except (ImportError, AttributeError, TypeError) as exc:
        _fail_unsupported("the package finder this tool uses (create_command, _build_package_finder, find_all_candidates)", exc)
        return
    if request.get("filename"):
        matches = [c for c in candidates if c.link.filename == request["filename"]]
    else:
        matches = [c for c in candidates if c.version == Version(request["version"]) and not c.link.is_wheel]
    names = sorted({c.link.filename for c in candidates if request.get("version") and c.version == Version(request["version"])})
    if len(matches) != 1 and not (matches and request.get("filename")):
        wanted = request.get("filename") or f"the sdist of {request['project']}=={request['version']}"
        print(json.dumps({"found": None, "wanted": wanted, "same_version": names}))
        return
    link = matches[0].link
    dest = Path(request["dest"]) / link.filename
    response = session.get(link.url_without_fragment, stream=True, headers={"Accept-Encoding": "identity"})
    response.raise_for_status()
    with dest.open("wb") as handle:
        for block in response.iter_content(chunk_size=1 << 20):
            handle.write(block)
    print(json.dumps({"found": link.filename, "url": redact_auth_from_url(link.url_without_fragment)}))


def run(request: dict) -> None:
    """pip's CLI (`request["args"]`) with `request["markers"]` overriding the marker environment."""
    overrides = request.get("markers") or {}
    try:
        import pip._vendor.packaging.markers as markers
    except ImportError as exc:
        _fail_unsupported("pip._vendor.packaging.markers", exc)
        return
    # Patched before pip's modules are imported, so their `from ... import default_environment` see it too.
    running = markers.default_environment

    def target_environment():
        return {**running(), **overrides}

    markers.default_environment = target_environment
    from pip._internal.cli.main import main

    sys.exit(main(request["args"]))


if __name__ == "__main__":
    modes = {"locate": locate, "run": run}
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.exit(f"usage: python {Path(__file__).name} {{{'|'.join(modes)}}} JSON")
    modes[sys.argv[1]](json.loads(sys.argv[2]))
