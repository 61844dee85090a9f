"""Dagster orchestration: one module per stage of the asset graph (no ML code lives here)."""
