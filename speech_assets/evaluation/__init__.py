"""Is the encoder any good? Downstream probes, CTC fine-tuning and the exported recogniser.

Pure ML code: nothing here imports Dagster (the assets are in ``speech_assets/defs/``).
"""
