"""Tracking URIs: stored and shown without credentials, connected with them."""

import pytest

from speech_assets.locations import TRACKING_URI_ENV, redact_uri, with_credentials
from speech_assets.train.tracking import run_url, ui_command


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("http://user:secret@mlflow.internal:5000", "http://mlflow.internal:5000"),
        ("https://secret@mlflow.example.com/base", "https://mlflow.example.com/base"),
        (
            "https://mlflow.example.com/?token=secret&workspace=w1",
            "https://mlflow.example.com/?token=REDACTED&workspace=w1",
        ),
        (
            "https://h/?X-Amz-Signature=secret&access_token=secret",
            "https://h/?X-Amz-Signature=REDACTED&access_token=REDACTED",
        ),
        ("postgresql+psycopg2://mlflow:secret@db:5432/mlflow", "postgresql+psycopg2://mlflow@db:5432/mlflow"),
        ("sqlite:////data/out/mlflow.db", "sqlite:////data/out/mlflow.db"),
        ("databricks", "databricks"),
    ],
)
def test_credentials_are_left_out_of_what_is_shown(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown
    assert "secret" not in ui_command(uri, "/a") and "secret" not in (run_url(uri, "1", "r") or "")


def test_the_environment_supplies_the_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "http://user:secret@mlflow.internal:5000"
    monkeypatch.setenv(TRACKING_URI_ENV, secret)
    assert with_credentials("http://mlflow.internal:5000") == secret
    assert with_credentials("http://other:5000") == "http://other:5000"  # another server gets nothing
    assert with_credentials(secret) == secret
    monkeypatch.delenv(TRACKING_URI_ENV)
    assert with_credentials("http://mlflow.internal:5000") == "http://mlflow.internal:5000"


def test_the_ui_shows_the_tracking_variable_not_its_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    import dagster as dg

    from speech_assets.definitions import build_definitions

    secret = "http://user:s3cret@mlflow.internal:5000"
    monkeypatch.setenv(TRACKING_URI_ENV, secret)
    paths = build_definitions().resources["paths"]
    shown = paths.get_resource_definition().config_schema.default_value_as_json_str  # Deployment -> Resources
    assert "s3cret" not in shown and TRACKING_URI_ENV in shown
    with dg.build_resources({"paths": paths}) as resources:  # what a run gets
        assert resources.paths.mlflow_tracking_uri == secret
    monkeypatch.setenv(TRACKING_URI_ENV, "http://mlflow.internal:5000")
    assert build_definitions().resources["paths"].mlflow_tracking_uri == "http://mlflow.internal:5000"
