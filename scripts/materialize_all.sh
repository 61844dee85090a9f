#!/usr/bin/env bash
# Materialize the whole asset graph with `dagster asset materialize`, stage by stage, then print
# a summary. This is what `make demo` runs and what the README documents; the end-to-end test
# runs it too. Environment: SPEECH_ASSETS_CORPUS, SPEECH_ASSETS_DATA_DIR, DAGSTER_HOME (docs/REFERENCE.md);
# TRAIN_CONFIG_JSON and FEDERATED_CONFIG_JSON override the training assets' run config.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export DAGSTER_HOME="${DAGSTER_HOME:-$repo/data/dagster_home}"
scripts/ensure_dagster_home.sh

materialize() { dagster asset materialize -m speech_assets.definitions "$@"; }
default_train_config='{"ops": {"pretrained_checkpoint": {"config": {"preset": "tiny", "max_steps": 300, "heldout_fraction": 0.1}}}}'
train_config="${TRAIN_CONFIG_JSON:-$default_train_config}"
# federated pretraining: a SuperLink and one SuperNode per client on loopback, [federated] settings
# of pipeline.toml with fewer local steps so that the demo stays near 2 minutes on 2 cores
default_federated_config='{"ops": {"federated_checkpoint": {"config": {"rounds": 3, "local_steps": 20}}}}'
federated_config="${FEDERATED_CONFIG_JSON:-$default_federated_config}"

materialize --select manifest
# one shard per speaker: the manifest registered the speaker partitions; one run covers them all
materialize --select speaker_manifest,vad_features --partition-range "$(speech-assets partitions speakers --range)"
materialize --select cmvn_stats,client_partitions
materialize --select kmeans_targets --partition-range "$(speech-assets partitions clients --range)"
materialize --select pretrained_checkpoint --config-json "$train_config"
materialize --select federated_checkpoint --config-json "$federated_config"
materialize --select dataset_stats

echo
echo "== speech_assets summary =="
speech-assets stats
echo "outputs: ${SPEECH_ASSETS_DATA_DIR:-$repo/data/out} (stats.duckdb, manifest/, features/, kmeans/, training/)"
echo "Dagster instance: $DAGSTER_HOME    UI: make ui    SQL: speech-assets sql \"SELECT * FROM clients\""
