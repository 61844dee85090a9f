"""Federated HuBERT pretraining with Flower: data and prediction heads never leave a client.

Each sampled client trains the shared encoder locally from the current global encoder with its
own data, its own normalisation and its own prediction head (kept on the client between rounds,
FedPer-style); the server (a Flower ServerApp) aggregates only the encoder with a Flower strategy
(FedAdam, FedAvg or FedProx), round after round. On one machine the clients run in Flower's
simulation runtime (long-lived workers); across machines on its deployment engine (a SuperLink,
one SuperNode per client). Optional: differential privacy, secure aggregation.

Modules (torch and flwr are imported only by the ones that need them, never by ``config``):

- ``config``      the knobs of a run and the layout of its folder (pure Python)
- ``client_data`` which files a client reads: only its own labels, shards and partial sums
- ``local``       local training and held-out evaluation on one client (torch)
- ``rounds``      the server's round records: checkpoints, rounds.parquet, final.pt (torch)
- ``history``     the same records read back without torch (tables, summaries: the launcher's view)
- ``server_app``  the Flower ServerApp; ``client_app`` the Flower ClientApp
- ``privacy``     DP: Flower's client-side fixed clipping, noise on the uniform mean, RDP accountant
- ``secure_aggregation``  double masking with Shamir-shared secrets (Flower's shares, ECDH +
  Fernet and quantization; X25519, HKDF, ChaCha20); ``secure_rounds`` its messages and state
- ``simulation``  the run on Flower's simulation runtime (``python -m speech_assets.federated.simulation``)
- ``processes``   SuperLink / SuperNode processes on loopback, ``flwr run``, the simulation process
- ``launch``      one federated run end to end (``python -m speech_assets.federated``)
- ``report``      the round curve as a markdown table and a PNG; ``tracking`` MLflow
"""
