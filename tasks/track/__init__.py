"""Experiment tracking: a finished run's config, step metrics, eval tables, plots and model, sent to MLflow,
TensorBoard or Weights & Biases."""
