"""Code locations for clusters: the same assets, resources and settings as
`speech_assets.definitions`, with a distributed executor (documented examples; see
docs/OPERATIONS.md, "From a laptop to a cluster", and the instance configurations in `deploy/`)."""
