"""Crash-consistency campaigns: attack the durability of snapshots systematically and classify
every outcome, so that silent wrong data is counted instead of assumed away (issue 13)."""
