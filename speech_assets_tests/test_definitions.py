"""The code location loads light: every webserver, daemon and run process imports it."""

from __future__ import annotations

import subprocess
import sys


def test_loading_the_code_location_imports_no_torch_or_faiss() -> None:
    code = (
        "import sys, speech_assets.definitions as d\n"
        "d.defs.resolve_asset_graph()\n"
        "print(sorted(m for m in ('torch', 'torchaudio', 'faiss', 'mlflow', 'flwr', 'onnxruntime') if m in "
        "sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_settings_are_read_once_as_the_code_location_loads() -> None:
    """The training op tags (GPUs per pod) and the `settings` resource come from one reading of the file."""
    from speech_assets import definitions
    from speech_assets.defs import training
    from speech_assets.deploy import celery_workers, k8s

    for defs in (definitions.defs, celery_workers.defs, k8s.defs):
        assert defs.resources["settings"] is training.SETTINGS
