"""Files larger than one part of a split cache: `cache split` cuts such a file into pieces named
`<path>.piece-NN-of-MM` (TransformerEngine's CUDA 13 core wheel weighs more than a 53 MiB transfer), and the cache joins
them back when it is verified after the parts were copied in (`cp -a DIR/.parts/*/. DIR/`).

A joined file is checked like any other: its size and sha256 against the manifest. Pieces carry no checksum of their
own; a damaged one shows as a joined file that does not match.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_PIECE = re.compile(r"^(?P<name>.+)\.piece-(?P<number>\d+)-of-(?P<count>\d+)$")
_BLOCK = 1 << 20


@dataclass(frozen=True)
class Piece:
    path: str  # '/'-separated, relative to the cache: the file's path with .piece-NN-of-MM
    source: str  # the whole file's path
    offset: int
    size: int


def piece_name(path: str, number: int, count: int) -> str:
    width = max(2, len(str(count)))
    return f"{path}.piece-{number:0{width}d}-of-{count:0{width}d}"


def is_piece(name: str) -> bool:
    return _PIECE.match(name) is not None


def plan_pieces(path: str, size: int, piece_size: int) -> list[Piece]:
    """The pieces a file of `size` bytes is cut into, none larger than `piece_size`."""
    count = -(-size // piece_size)
    return [Piece(path=piece_name(path, i + 1, count), source=path, offset=i * piece_size,
                  size=min(piece_size, size - i * piece_size)) for i in range(count)]


def write_piece(cache_dir: Path, piece: Piece, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (cache_dir / piece.source).open("rb") as src, dest.open("wb") as out:
        src.seek(piece.offset)
        left = piece.size
        while left:
            block = src.read(min(_BLOCK, left))
            if not block:
                raise OSError(f"{cache_dir / piece.source} ended early")
            out.write(block)
            left -= len(block)


def join_pieces(cache_dir: Path, paths: list[str], log: Callable[[str], None] = print) -> list[str]:
    """Join every file of `paths` that is absent but whose pieces are all there (the pieces are removed); the
    problems of the files that have only some pieces, naming the missing ones."""
    problems = []
    for path in paths:
        target = cache_dir / path
        if target.exists() or not target.parent.is_dir():
            continue
        found: dict[int, tuple[int, Path]] = {}
        for candidate in target.parent.iterdir():
            match = _PIECE.match(candidate.name)
            if match and match["name"] == target.name:
                found[int(match["number"])] = (int(match["count"]), candidate)
        if not found:
            continue
        count = next(iter(found.values()))[0]
        missing = [n for n in range(1, count + 1) if n not in found]
        if missing:
            problems.append(f"{path}: missing piece(s) {', '.join(str(n) for n in missing)} of {count}"
                            " (their parts have not been copied in)")
            continue
        joining = target.with_name(f".{target.name}.joining")
        with joining.open("wb") as out:
            for number in range(1, count + 1):
                with found[number][1].open("rb") as src:
                    while block := src.read(_BLOCK):
                        out.write(block)
        joining.replace(target)
        for _, piece in found.values():
            piece.unlink()
        log(f"  joined {path} from its {count} pieces")
    return problems
