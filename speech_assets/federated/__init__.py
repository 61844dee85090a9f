"""Federated HuBERT pretraining with Flower: data and prediction heads never leave a client.

Each client (one Flower SuperNode) trains the shared encoder locally from the current global
encoder with its own data, its own client-level CMVN and its own prediction head (kept on the
client between rounds, FedPer-style); the server (a Flower ServerApp on the SuperLink)
aggregates only the encoder with a Flower strategy (FedAdam or FedAvg), round after round.

Modules (torch and flwr are imported only by the ones that need them, never by ``config``):

- ``config``      the knobs of a run and the layout of its folder (pure Python)
- ``client_data`` which files a client reads: only its own labels, shards and partial sums
- ``local``       local training and held-out evaluation on one client (torch)
- ``rounds``      the server's round records: checkpoints, rounds.parquet, final.pt (torch)
- ``history``     the same records read back without torch (tables, summaries: the launcher's view)
- ``server_app``  the Flower ServerApp; ``client_app`` the Flower ClientApp
- ``processes``   SuperLink / SuperNode processes on loopback and ``flwr run``
- ``launch``      one federated run end to end (``python -m speech_assets.federated``)
- ``report``      the round curve as a markdown table and a PNG; ``tracking`` MLflow
"""
