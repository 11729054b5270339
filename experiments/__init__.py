"""Reproducible experiments built on the training service (``python -m experiments.<name>``)."""
