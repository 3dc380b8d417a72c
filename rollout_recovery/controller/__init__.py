"""The controller's jobs behind the `RolloutRecovery` facade: starting and closing the job
(lifecycle), the checkpoint coordinator, restore (selection, the token log's extension, the
whole-job restore), the workers' supervisor, the liveness watch, the standalone gateway's
run, snapshot inspection, the run's metrics vocabulary, and the engines' evidence log."""
