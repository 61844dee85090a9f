"""Stage 3 (pure code): speakers -> clients, per-client k-means, and the label files."""
