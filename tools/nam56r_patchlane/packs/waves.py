"""`packs waves`: the next filing wave per target repository.

Maintainers have inboxes: file two to four ready packs per repository at a time, highest priority
class first (crash fixes, comments on open PRs, refactors, bug reports), then pause that repository
for a few days after its last filing. "Ready" means every preflight item except the approval holds;
approval is the person's decision once the wave is proposed.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

from ..lock import Lock
from .filing_checklist import run_filing_checklist
from .pack import WAVES, Pack, load_packs

MAX_PER_WAVE = 4
MIN_PER_WAVE = 2


@dataclass(frozen=True)
class Candidate:
    pack: Pack
    ready: bool
    blocker: str  # the first failing preflight item, when not ready


@dataclass(frozen=True)
class RepoWave:
    target: str
    last_filed: dt.date | None
    paused_until: dt.date | None
    proposed: tuple[Candidate, ...]
    waiting: tuple[Candidate, ...]  # ready but beyond this wave's size
    blocked: tuple[Candidate, ...]
    guards: tuple[Pack, ...]  # never filed


def _priority(pack: Pack) -> tuple[int, str]:
    return WAVES.index(pack.wave), pack.id


def plan_waves(root: Path, lock: Lock, today: dt.date, pause_days: int, max_age_days: int, python: str,
               packs: list[Pack] | None = None) -> list[RepoWave]:
    packs = load_packs(root) if packs is None else packs
    by_target: dict[str, list[Pack]] = {}
    for pack in packs:
        by_target.setdefault(pack.target, []).append(pack)
    waves = []
    for target, group in sorted(by_target.items()):
        filed = [dt.date.fromisoformat(p.filing.filed_on) for p in group if p.filing.filed_on]
        last = max(filed) if filed else None
        paused = last + dt.timedelta(days=pause_days) if last and today < last + dt.timedelta(days=pause_days) else None
        candidates = []
        for pack in sorted((p for p in group if not p.is_guard and not p.filing.filed_on), key=_priority):
            failed = [i for i in run_filing_checklist(pack, root, lock, today, max_age_days, python, with_approval=False) if not i.ok]
            blocker = "; ".join(i.name for i in failed)
            candidates.append(Candidate(pack, not failed, blocker))
        ready = [c for c in candidates if c.ready]
        proposed = () if paused else tuple(ready[:MAX_PER_WAVE])
        waves.append(RepoWave(target, last, paused, proposed, tuple(ready[len(proposed):]),
                              tuple(c for c in candidates if not c.ready), tuple(p for p in group if p.is_guard)))
    return waves


def render_waves(waves: list[RepoWave], today: dt.date, pause_days: int) -> str:
    lines = [f"Filing waves as of {today.isoformat()} (2-{MAX_PER_WAVE} ready packs per repository, pause {pause_days} days"
             " after a repository's last filing; nothing is filed without `packs approve`)", ""]
    for wave in waves:
        last = wave.last_filed.isoformat() if wave.last_filed else "never"
        lines.append(f"{wave.target} (last filing: {last})")
        if wave.paused_until:
            lines.append(f"  paused until {wave.paused_until.isoformat()}: no wave proposed")
        elif wave.proposed:
            note = "" if len(wave.proposed) >= MIN_PER_WAVE else f" (only {len(wave.proposed)} ready: a short wave)"
            lines.append(f"  next wave{note}:")
            for c in wave.proposed:
                approved = f"approved by {c.pack.filing.approved_by}" if c.pack.filing.approved_by else "needs approval"
                lines.append(f"    {c.pack.id:<34} {c.pack.wave:<10} {c.pack.kind:<8} {approved}")
        else:
            lines.append("  next wave: none ready" if wave.blocked or not wave.guards else "  nothing to file")
        for c in wave.waiting:
            lines.append(f"  later: {c.pack.id} ({c.pack.wave}, ready)")
        for c in wave.blocked:
            lines.append(f"  not ready: {c.pack.id} ({c.pack.wave}): fails {c.blocker}")
        if wave.guards:
            lines.append(f"  regression guards (never filed): {', '.join(p.id for p in wave.guards)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
