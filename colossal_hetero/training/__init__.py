"""The training loop that ``python -m colossal_hetero.train`` runs."""
