"""What runs in the trainer's process besides the loop-facing `TrainingRun` (run.py): claiming
the run's location and planning a restore from its files (run_plan), setting aside what a
restore skipped (set_aside), the loop's trainer checkpoints paired with snapshots by digest
(trainer_checkpoints), the step log (step_log), the kept training batches (batches), a step's
tasks (tasks), and asynchronous GRPO's producer (producer)."""
