"""The controller's jobs behind the `RolloutRecovery` facade: the checkpoint coordinator,
restore selection, the run's metrics vocabulary, and the engines' evidence log."""
