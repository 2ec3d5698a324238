"""Upstream filing packs: patches/packs/<id>/{pack.toml, body.md, repro.py} (schema: patches/packs/README.md).

Modules, one job each:
  pack              a pack as dataclasses: load, validate, the patches it covers and its checksum
  run               `packs run`: the reproducer on the unpatched base and on the patched tree, recorded
  records           a pack's validation records: latest passing run per side, the manifest excerpt
  filing_checklist  `packs preflight`: the pre-filing checklist, every failing item named
                    (not the training preflight, nam56r.training.launcher.preflight)
  markdown_check    will body.md render intact on GitHub
  scrub             private infrastructure and secrets in what would be posted
  waves             `packs waves`: the next filing wave per target repository
  filing            the human gate and the bundle: `packs approve`, `packs filed`, `packs export`
  cli               argparse front end (tools/packs.py)
"""
