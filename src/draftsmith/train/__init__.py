"""Drafter training: the training-time-test loss (losses.py), its metrics (metrics.py) and the loop (trainer.py)."""

from draftsmith.train.trainer import TrainConfig, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "train"]
