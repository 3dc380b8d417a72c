"""Starting or joining Ray with the project's defaults."""

from __future__ import annotations

import ray


def init_ray(
    address: str = "local", num_cpus: int | None = None, log_to_driver: bool = True
) -> None:
    """Start a private local Ray (`address="local"`) or join a cluster (`"auto"` or an address).

    `local` never attaches to another process's cluster on the same machine by accident.
    """
    if ray.is_initialized():
        return
    kwargs: dict = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if address == "local" and num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    ray.init(address=address, **kwargs)
