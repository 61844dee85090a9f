"""Resources: where the corpus and every output live."""


from pathlib import Path

import dagster as dg

from speech_assets import settings
from speech_assets.features.shards import ShardFiles


class StoragePaths(dg.ConfigurableResource):
    """The corpus location and the data dir; every asset writes under ``data_dir`` only.

    Defaults come from ``$SPEECH_ASSETS_CORPUS`` and ``$SPEECH_ASSETS_DATA_DIR`` (see
    docs/REFERENCE.md); relative paths resolve against the repository root.
    """

    corpus: str
    data_dir: str
    mlflow_tracking_uri: str

    @classmethod
    def from_environment(cls) -> "StoragePaths":
        data = settings.data_dir()
        return cls(
            corpus=str(settings.corpus_location()),
            data_dir=str(data),
            mlflow_tracking_uri=settings.mlflow_tracking_uri(data),
        )

    @property
    def corpus_path(self) -> Path:
        return settings.resolve(self.corpus)

    @property
    def root(self) -> Path:
        return settings.resolve(self.data_dir)

    @property
    def manifest_dir(self) -> Path:
        return self.root / "manifest"

    @property
    def manifest_file(self) -> Path:
        return self.manifest_dir / "manifest.parquet"

    @property
    def rejects_file(self) -> Path:
        return self.manifest_dir / "rejects.parquet"

    @property
    def speakers_file(self) -> Path:
        """Per-speaker manifest hashes: what each feature shard depends on."""
        return self.manifest_dir / "speakers.parquet"

    @property
    def decode_cache_file(self) -> Path:
        return self.manifest_dir / "decode_cache.parquet"

    @property
    def shards_dir(self) -> Path:
        return self.root / "features" / "shards"

    def shard_file(self, speaker_id: str) -> Path:
        return self.shard_files(speaker_id).shard

    def shard_files(self, speaker_id: str) -> ShardFiles:
        return ShardFiles.of(self.shards_dir, speaker_id)

    @property
    def cmvn_dir(self) -> Path:
        return self.root / "cmvn"

    @property
    def clients_file(self) -> Path:
        return self.root / "clients" / "clients.parquet"

    def kmeans_dir(self, client_id: str) -> Path:
        return self.root / "kmeans" / client_id

    @property
    def training_dir(self) -> Path:
        return self.root / "training"

    @property
    def stats_db(self) -> Path:
        return self.root / "stats.duckdb"
