#!/usr/bin/env bash
# Create $DAGSTER_HOME (default data/dagster_home) with the repository's dagster.yaml.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
home="${DAGSTER_HOME:-$repo/data/dagster_home}"
mkdir -p "$home"
[ -f "$home/dagster.yaml" ] || cp "$repo/dagster.yaml" "$home/dagster.yaml"
