"""The NAM56R patch lane: pinned upstreams, materialized git trees, quilt-style patch series.

Modules, one job each:
  errors      PatchlaneError: what went wrong, what to do next, and the CLI's exit code
  lock        third_party/upstreams.toml as dataclasses
  artifacts   fetch (through pip) and checksum-verify pinned release artifacts; the offline cache
  pip_internals  pip's own finder, session and marker evaluation, in one place (cache fill uses them)
  wheeltarget the target a cache is filled for (python version, platforms, profile)
  wheelhouse  resolve and download the wheels an offline build needs, for that target
  cachemanifest  the offline cache's manifest of files and sha256; verify and split
  cachefill   the whole `cache fill` flow
  noxsupport  what noxfile.py takes from the lane (standard library only)
  gittree     GitPython wrapper around one materialized upstream tree and its state file
  statefile   where a tree's state file lives (standard library only: the training preflight reads it too)
  patchfile   the patch file format: header block, description, diff; header validation
  series      patches/<upstream>/series and its patch files
  materialize submodule or artifact -> git tree with an `upstream` base tag
  apply       apply/push/pop/export/refresh/new/import on a tree
  environment target Python environment, profiles, installs
  build       the whole `build` flow with progress and a final table
  console     numbered progress steps and plain-text tables (build, cache fill, rebase print them)
  check       the CI gate
  rebase      re-apply a series on another upstream version and report per patch
  manifest    the append-only validation manifest and host stamps
  superproject  the superproject's gitlinks record the lock's commits, never a materialized tree's
  checkout_lock  flock locks: one command at a time writes a checkout (third_party/, .venv, cache) or the manifest
  pinned      the unpatched release's sources at a tree's base tag (for same-run comparisons)
  packs/      the upstream filing packs: load, run, the filing checklist, waves, approve and export (its own list)
  cli         argparse front end (tools/apply_patches.py); cache_commands and manifest_commands add
              `cache` and `manifest` to it; cli_options is what it shares with tools/packs.py

Nothing here imports torch, nam56r or the kernels package.
"""
