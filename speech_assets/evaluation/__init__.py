"""Is the encoder any good? Downstream probes and export of pretrained encoders.

``text`` (characters for CTC), ``encoders`` (loading checkpoints, frozen layer features),
``probe`` (the SUPERB-style CTC probe), ``export`` (TorchScript/ONNX with parity), ``speed``.
Distillation, a training loop, is :mod:`speech_assets.train.distill`. Pure ML code: nothing
here imports Dagster (the assets: ``speech_assets/defs/{probe,export}.py``).
"""
