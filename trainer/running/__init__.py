"""The training loop and ps-trainer: flags, reporting, stopping, elastic data epochs."""
