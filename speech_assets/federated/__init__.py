"""Federated HuBERT pretraining with Flower: data and prediction heads never leave a client.

Each sampled client trains the shared encoder from the global one with its own data,
normalisation and head (FedPer-style); the ServerApp aggregates only the encoder with a Flower
strategy (FedAdam, FedAvg or FedProx). On one machine the clients run in Flower's simulation
runtime, across machines on its deployment engine. Optional: differential privacy (``privacy``),
secure aggregation (``secure_aggregation``, ``secure_rounds``). ``config`` imports neither torch
nor flwr; ``launch`` runs one federated run end to end.
"""
