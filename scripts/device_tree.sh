#!/bin/bash
# What a device call carries, and a checkout that leaves measurements/ behind for one.
#
# Why: the device tool copies the working tree (tracked files and untracked files git does not ignore, plus the
# paths named in `carry`) and refuses a copy over 64 MiB. measurements/ holds the engine's runs (56.6 MB at
# 12f6e44: every CPU set's archives); with `.gpu/` (4.35 MB) the tree was within 1.2 MB of the limit, so one
# more CPU set would have blocked the next GPU call. No GPU step reads measurements/ (the gpu tests and
# scripts/engine_runs_gpu.sh do not), so a call can leave it behind:
#   bash scripts/device_tree.sh size [.gpu ...]   bytes that would travel (with those carried paths) vs 64 MiB
#   bash scripts/device_tree.sh slim              a throwaway branch `device-slim` (HEAD less measurements/ in one
#                                                 commit; the files stay on disk, ignored through .git/info/exclude)
#   ... the device call (`run`), from this checkout ...
#   bash scripts/device_tree.sh restore           back to the branch slim left, the exclusion and the branch gone
# Uncommitted changes and new files carry across `restore` as across any checkout: commit what the call brought
# back after `restore` (on the branch it returns to). `slim` refuses a tree with uncommitted changes to tracked
# files; `restore` refuses when commits were made on device-slim (cherry-pick them first).
set -euo pipefail
LIMIT=$((64 * 1024 * 1024))
BRANCH=device-slim
MARK="# device_tree.sh slim: measurements/ stays behind on device calls"
cd "$(git rev-parse --show-toplevel)"
GITDIR=$(git rev-parse --git-dir)
EXCLUDE="$GITDIR/info/exclude"
FROM_FILE="$GITDIR/device-slim-from"

die() { echo "error: $*" >&2; exit 2; }

size() {  # size [carried paths...]
  local tree carried=0 p
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2>/dev/null |
         awk '{s += $1} END {print s + 0}')
  for p in "$@"; do
    [ -e "$p" ] || die "carried path '$p' does not exist here"
    carried=$((carried + $(du -sb -- "$p" | cut -f1)))
  done
  local total=$((tree + carried))
  awk -v t="$total" -v w="$tree" -v c="$carried" -v l="$LIMIT" 'BEGIN {
    printf "travels: %.2f MB (tree %d bytes + carried %d bytes) of the 64 MiB limit (%.2f MB): %s\n",
      t / 1e6, w, c, l / 1e6, (t <= l ? "fits" : "TOO LARGE: slim first") }'
  [ "$total" -le "$LIMIT" ]
}

slim() {
  [ "$(git branch --show-current)" != "$BRANCH" ] || die "already slim (on $BRANCH): restore first"
  git show-ref --verify --quiet "refs/heads/$BRANCH" && die "a branch $BRANCH exists: restore, or delete it"
  git diff --quiet && git diff --cached --quiet || die "uncommitted changes to tracked files: commit or stash them first"
  local from
  from=$(git branch --show-current); [ -n "$from" ] || from=$(git rev-parse HEAD)
  echo "$from" > "$FROM_FILE"
  git checkout -q -b "$BRANCH"
  git rm -r -q --cached measurements
  git commit -q -m "device-slim: measurements/ left out of a device call's copy (scripts/device_tree.sh; never merged)"
  printf '%s\n/measurements/\n' "$MARK" >> "$EXCLUDE"
  echo "slim: on $BRANCH (from $from); measurements/ is on disk, ignored, and stays behind"
}

restore() {
  [ "$(git branch --show-current)" = "$BRANCH" ] || die "not slim (the current branch is not $BRANCH)"
  [ -f "$FROM_FILE" ] || die "$FROM_FILE is missing: check out your branch and delete $BRANCH by hand"
  local from
  from=$(cat "$FROM_FILE")
  case "$(git log -1 --format=%s HEAD)" in device-slim:*) ;;
    *) die "commits were made on $BRANCH after the slim commit: cherry-pick them onto $from, then restore" ;; esac
  git checkout -q "$from"  # measurements/ is ignored while slim: the checkout rewrites it (same bytes)
  grep -vxF -e "$MARK" -e "/measurements/" "$EXCLUDE" > "$EXCLUDE.tmp" || true
  mv "$EXCLUDE.tmp" "$EXCLUDE"
  git branch -q -D "$BRANCH"
  rm -f "$FROM_FILE"
  git diff --quiet -- measurements || die "measurements/ differs from $from after restore: git diff -- measurements"
  echo "restored: on $from"
}

case "${1:-}" in
  size) shift; size "$@" ;;
  slim) slim; if [ -e .gpu ]; then size .gpu; else size; fi ;;
  restore) restore ;;
  *) die "unknown command '${1:-}'; valid choices: size [carried paths...], slim, restore" ;;
esac
