"""The human gate and the filing bundle: `packs approve`, `packs filed`, `packs export`.

Nothing here posts anything upstream. `approve` records who decided a pack may be filed; `filed`
records where a person filed it (refused without an approval); `export` writes the files a person
attaches to the issue or PR.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
from pathlib import Path

from ..errors import PatchlaneError
from .pack import Filing, Pack, load_pack
from .records import manifest_excerpt

_FILING_SECTION = re.compile(r"^\[filing\][^\[]*", re.M)


def _write_filing(pack: Pack, filing: Filing) -> Pack:
    path = pack.folder / "pack.toml"
    text = path.read_text()
    rendered = "[filing]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in vars(filing).items())
    if _FILING_SECTION.search(text):
        text = _FILING_SECTION.sub(lambda _: rendered, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + rendered
    path.write_text(text)
    return load_pack(pack.folder)


def approve(pack: Pack, by: str, on: dt.date) -> Pack:
    if pack.is_guard:
        raise PatchlaneError(f"{pack.id} is a regression guard (wave 'never'): it is never filed, so there is nothing to approve")
    if not by.strip():
        raise PatchlaneError("--by needs the name of the person approving")
    return _write_filing(pack, Filing(by.strip(), on.isoformat(), pack.filing.filed_url, pack.filing.filed_on))


def mark_filed(pack: Pack, url: str, on: dt.date) -> Pack:
    if not pack.filing.approved_by:
        raise PatchlaneError(f"{pack.id} has no recorded approval: nothing is marked filed without one",
                             f"a person runs `python tools/packs.py approve {pack.id} --by NAME` first")
    if not url.startswith(f"https://github.com/{pack.target}/"):
        raise PatchlaneError(f"{url!r} is not a thread of {pack.target}")
    return _write_filing(pack, Filing(pack.filing.approved_by, pack.filing.approved_on, url, on.isoformat()))


def export_bundle(pack: Pack, root: Path, dest: Path) -> list[Path]:
    """Write body.md, the patches, the reproducer and the manifest excerpt into dest/<id>/."""
    folder = dest / pack.id
    if folder.exists() and any(folder.iterdir()):
        raise PatchlaneError(f"{folder} exists and is not empty: refusing to overwrite it", "choose another --out, or move it aside")
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "body.md", folder / pack.reproducer.script, folder / "validation.md"]
    shutil.copyfile(pack.body_path, written[0])
    shutil.copyfile(pack.script_path, written[1])
    written[2].write_text(manifest_excerpt(pack, root))
    for path in pack.patch_paths(root):
        written.append(folder / path.name)
        shutil.copyfile(path, written[-1])
    return written
