"""Episode functions shipped with the project: the built-in tally task and the notes agent
example."""
