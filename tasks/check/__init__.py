"""`sftflow check`: the correctness checks a user runs on their own model and data before training."""
