"""Is the encoder any good? Downstream probes, export and distillation of pretrained encoders.

``text`` (characters for CTC), ``encoders`` (loading checkpoints, frozen layer features),
``probe`` (the SUPERB-style CTC probe), ``export`` (TorchScript/ONNX with parity),
``distill`` (DistilHuBERT-style student training under torchrun), ``speed``. Pure ML code:
nothing here imports Dagster (the assets: ``speech_assets/defs/{probe,export,distillation}.py``).
"""
