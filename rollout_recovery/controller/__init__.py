"""The controller's jobs behind the `RolloutRecovery` facade: the job as one value, started and
closed once (job), what a step asks of it (steps), the checkpoint coordinator, restore
(selection, the token log's extension, the whole-job restore), the workers' supervisor, the
liveness watch, the standalone gateway's run, snapshot inspection, the run's metrics
vocabulary, and the engines' evidence log."""
