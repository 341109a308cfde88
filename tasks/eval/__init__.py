"""Evaluation of a trained model (`evaluate`, `report`), its Prefect task (`stage`), and promotion to a local model
registry (`promotion`, `registry`)."""
