#!/usr/bin/env bash
# Create $DAGSTER_HOME (default data/dagster_home) with the repository's dagster.yaml, and keep it
# current: a copy nobody edited (the same as what this script copied last, or as any committed
# version of dagster.yaml) is replaced when the repository's changes, e.g. the daemon's run-queue
# and sensor settings; a copy you edited is kept, and this says that it differs.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
home="${DAGSTER_HOME:-$repo/data/dagster_home}"
ours="$repo/dagster.yaml"
theirs="$home/dagster.yaml"
stamp="$home/.dagster.yaml.copied"  # what this script copied last
mkdir -p "$home"

unedited() {  # whether $theirs is a copy this script or an earlier checkout made
    [ -f "$stamp" ] && cmp -s "$theirs" "$stamp" && return 0
    command -v git >/dev/null && git -C "$repo" rev-parse --git-dir >/dev/null 2>&1 || return 1
    local rev
    for rev in $(git -C "$repo" log --format=%H -- dagster.yaml); do
        git -C "$repo" show "$rev:dagster.yaml" 2>/dev/null | cmp -s - "$theirs" && return 0
    done
    return 1
}

if [ ! -f "$theirs" ]; then
    cp "$ours" "$theirs"
    cp "$ours" "$stamp"
elif ! cmp -s "$ours" "$theirs"; then
    if unedited; then
        cp "$ours" "$theirs"
        cp "$ours" "$stamp"
        echo "updated $theirs to the repository's dagster.yaml" >&2
    else
        echo "note: keeping your $theirs, which differs from the repository's dagster.yaml" \
             "(diff $ours $theirs)" >&2
    fi
fi
