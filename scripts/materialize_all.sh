#!/usr/bin/env bash
# Materialize the whole asset graph with `dagster asset materialize`, stage by stage, then print
# a summary. This is what `make demo` runs and what the README documents; the end-to-end test
# runs it too. Environment: SPEECH_ASSETS_CORPUS, SPEECH_ASSETS_DATA_DIR, DAGSTER_HOME (docs/REFERENCE.md);
# every stage's knobs come from pipeline.toml (or $SPEECH_ASSETS_SETTINGS); TRAIN_CONFIG_JSON, if
# set, overrides the training asset's settings for this run only (run config).
# FEDERATED_CONFIG_JSON overrides the federated asset's (default: fewer local steps, for the demo).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export DAGSTER_HOME="${DAGSTER_HOME:-$repo/data/dagster_home}"
scripts/ensure_dagster_home.sh

# Dagster 1.13 calls `dagster asset materialize` superseded by `dg launch --assets`; it is still
# supported and is the documented command here, so its notice is not repeated for every step.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Function \`asset_materialize_command\` is superseded"
materialize() { dagster asset materialize -m speech_assets.definitions "$@"; }
train_overrides=()
[ -n "${TRAIN_CONFIG_JSON:-}" ] && train_overrides=(--config-json "$TRAIN_CONFIG_JSON")
# federated pretraining: a SuperLink and one SuperNode per client on loopback, the [federated]
# settings of pipeline.toml with fewer local steps so that the demo stays near 2 minutes on 2 cores
default_federated_config='{"ops": {"federated_checkpoint": {"config": {"rounds": 3, "local_steps": 20}}}}'
federated_config="${FEDERATED_CONFIG_JSON:-$default_federated_config}"

materialize --select manifest
# one shard per speaker: the manifest registered the speaker partitions; one run covers them all
materialize --select speaker_manifest,vad_features --partition-range "$(speech-assets partitions speakers --range)"
materialize --select cmvn_stats,client_partitions
materialize --select kmeans_targets --partition-range "$(speech-assets partitions clients --range)"
materialize --select pretrained_checkpoint "${train_overrides[@]}"
materialize --select federated_checkpoint --config-json "$federated_config"
materialize --select dataset_stats

echo
echo "== speech_assets summary =="
speech-assets stats
echo "outputs: ${SPEECH_ASSETS_DATA_DIR:-$repo/data/out} (stats.duckdb, manifest/, features/, kmeans/, training/, federated/, report/)"
echo "Dagster instance: $DAGSTER_HOME    UI: make ui    SQL: speech-assets sql \"SELECT * FROM clients\""
