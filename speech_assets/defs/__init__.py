"""Dagster orchestration: one module per stage of the asset graph (no ML code lives here)."""

import warnings

import dagster as dg

# `backfill_policy` (one run per partition range) is a beta parameter; Dagster warns once per
# decorated asset in every process that loads the code location (webserver, daemon, each run and
# step): dozens of identical lines per materialization. It is a deliberate, documented choice.
warnings.filterwarnings("ignore", message="Parameter `backfill_policy`", category=dg.BetaWarning)
