"""Is the encoder any good? Downstream probes of pretrained encoders.

``text`` (characters for CTC), ``encoders`` (loading checkpoints, frozen layer features),
``probe`` (the SUPERB-style CTC probe), ``speed``. Export is :mod:`speech_assets.model.export`,
distillation, a training loop, :mod:`speech_assets.train.distill`. Pure ML code: nothing
here imports Dagster (the asset: ``speech_assets/defs/probe.py``).
"""
