"""Experiment tracking: a run's config, step metrics, eval tables, plots and model, sent to MLflow, TensorBoard or
Weights & Biases; its step metrics while it trains (`live`), the rest when the pipeline ends (`stage`)."""
