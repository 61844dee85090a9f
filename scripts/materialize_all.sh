#!/usr/bin/env bash
# Materialize the whole asset graph with `dagster asset materialize`, stage by stage, then print
# a summary. This is what `make demo` runs and what docs/USER_GUIDE.md documents; the end-to-end test
# runs it too. Environment: SPEECH_ASSETS_CORPUS, SPEECH_ASSETS_DATA_DIR, DAGSTER_HOME (docs/REFERENCE.md);
# every stage's knobs come from pipeline.toml (or $SPEECH_ASSETS_SETTINGS); TRAIN_CONFIG_JSON, if
# set, overrides the training asset's settings for this run only (run config); see the last run
# below for the others.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
export DAGSTER_HOME="${DAGSTER_HOME:-$repo/data/dagster_home}"
scripts/ensure_dagster_home.sh

# Dagster 1.13 calls `dagster asset materialize` superseded by `dg launch --assets`; it is still
# supported and is the documented command here, so its notice is not repeated for every step.
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Function \`asset_materialize_command\` is superseded"
materialize() { dagster asset materialize -m speech_assets.definitions "$@"; }
# The last run trains and evaluates: pretrained_checkpoint (torchrun), federated_checkpoint (a
# SuperLink and one SuperNode per client on loopback), distilled_checkpoint, encoder_export,
# downstream_probe, finetuned_asr (CTC fine-tuning against a from-scratch baseline, and the
# recogniser `speech-assets transcribe` uses), then dataset_stats; Dagster orders the steps by their dependencies and the
# `training` pool runs one trainer at a time. Its run config: the demo's shorter budgets (fewer
# federated local steps, a 40-step distillation, fine-tuning on 1 labelled minute for at most 300 steps
# with two seeds, each model's lr chosen on the dev set first, two runs at a time in two launches; the
# probe in one thread beside them:
# the demo stays within a few minutes on 2 cores), each asset's part replaced by
# TRAIN_CONFIG_JSON / FEDERATED_CONFIG_JSON / DISTILL_CONFIG_JSON / PROBE_CONFIG_JSON /
# FINETUNE_CONFIG_JSON where set. MODEL_ASSETS narrows the run's selection.
model_assets="${MODEL_ASSETS:-pretrained_checkpoint,federated_checkpoint,distilled_checkpoint,encoder_export,downstream_probe,finetuned_asr,dataset_stats}"
model_config="$(python - "$model_assets" <<'PY'
import json, os, sys
ops = {
    "federated_checkpoint": {"config": {"rounds": 3, "local_steps": 20}},
    "distilled_checkpoint": {"config": {"max_steps": 40}},
    # fine-tuning: 1 labelled minute, 2 seeds, the default lr grid (3 values). Phase 1 trains 3 lrs x 2 models
    # (seed 0), phase 2 the 2 seed-1 runs: 8 runs, 2 at a time. Each stops once 2 dev evaluations (every 50
    # steps, on at most 30 dev utterances) have not improved: a scratch model stuck on blanks stops at step
    # ~150, a pretrained one at the latest at the ceiling, 300 steps (the old demo's fixed 300). Estimate from
    # the old demo's 103 s for 4 x 300 steps: ~(6 x 225 / 2 + 300) steps x 0.17 s + 2 launches ~ 3 min, within
    # `make demo`'s 8 minutes; a larger ceiling (600) would let pretrained run up to twice as long.
    "finetuned_asr": {"config": {"labelled_minutes": [1.0], "seeds": [0, 1], "max_steps": 300, "eval_every": 50, "patience": 2, "max_dev_utterances": 30, "freeze_steps": 50, "batch_seconds": 8.0}},
    # the probe runs beside fine-tuning's processes (one per core): one thread leaves them their cores
    "downstream_probe": {"config": {"threads": 1}},
}
for variable in ("TRAIN_CONFIG_JSON", "FEDERATED_CONFIG_JSON", "DISTILL_CONFIG_JSON", "PROBE_CONFIG_JSON", "FINETUNE_CONFIG_JSON"):
    ops.update(json.loads(os.environ.get(variable) or "{}").get("ops", {}))
selected = set(sys.argv[1].split(","))
print(json.dumps({"ops": {name: value for name, value in ops.items() if name in selected}}))
PY
)"

started="$(date +%s)"  # the runs created from here on are this demo's (its verdict counts their steps and checks)
materialize --select manifest
# one shard per speaker: the manifest registered the speaker partitions (and recorded each
# speaker's rows version, speaker_manifest); one run covers them all
materialize --select vad_features --partition-range "$(speech-assets partitions speakers --range)"
materialize --select cmvn_stats,client_partitions
materialize --select kmeans_targets --partition-range "$(speech-assets partitions clients --range)"
materialize --select "$model_assets" --config-json "$model_config"

echo
echo "== speech_assets summary =="
speech-assets stats
if [[ ",$model_assets," == *,downstream_probe,* ]]; then
  echo
  echo "== downstream probe: the leaderboard (held-out speakers; CER/WER mean ± std over probe seeds) =="
  speech-assets probe
fi
if [[ ",$model_assets," == *,finetuned_asr,* ]]; then
  echo
  echo "== CTC fine-tuning: held-out speakers, pretrained vs the same model from scratch, mean ± std over seeds =="
  echo "(the verdict lines follow the tables: 'not measured' where a model did not train, 'indicative only' below"
  echo " [probe] min_heldout_speakers held-out speakers; then the text overlap, which must be 0, and the OOV rate)"
  speech-assets finetune
fi
echo
echo "outputs: ${SPEECH_ASSETS_DATA_DIR:-$repo/data/out} (stats.duckdb, manifest/, features/, kmeans/, training/, federated/, distill/, export/, probe/, finetune/, report/)"
echo "Dagster instance: $DAGSTER_HOME    SQL: speech-assets sql \"SELECT * FROM clients\""
echo
# held-out utterances of the fine-tuning split, with reference and CER (through the recogniser
# finetuned_asr registered in MLflow), then the verdict: the steps and asset check evaluations the
# Dagster instance recorded for this demo's runs, every warning with its reason; then what to open
examples=0
if [[ ",$model_assets," == *,finetuned_asr,* ]]; then examples=3; fi
python -m speech_assets.demo --since "$started" --examples "$examples"
