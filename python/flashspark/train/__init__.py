"""Training of the embedded default models."""
