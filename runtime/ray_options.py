"""``RayServeConfig``: one infeng application on Ray Serve (``infeng serve-ray``, the app builder of
``serve run``), each option declared once (``infeng_common.options``). No Ray import here: the
command line reads the declarations without Ray installed; ``ray_serve/`` runs them."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infeng_common.errors import InfengError
from infeng_common.manifest import read_manifest
from infeng_common.options import check_ranges, option

from .api.options import ServeOptions

__all__ = ["RayServeConfig", "adapter_slots"]


@dataclass
class RayServeConfig:
    """One infeng application on Ray Serve: the artifact, the replicas, the per-replica server."""

    artifact: Path
    options: ServeOptions = field(default_factory=ServeOptions)   # per replica; adapters are placed by Ray
    replicas: int = option(1, flag="--replicas", low=1, help="engine replicas (the initial count when autoscaling)")
    min_replicas: int | None = option(None, flag="--min-replicas", low=0, help="autoscale down to this many replicas")
    max_replicas: int | None = option(None, flag="--max-replicas", low=1, help="autoscale up to this many replicas")
    target_ongoing_requests: float | None = option(None, flag="--target-ongoing-requests",
                                                   help="autoscaling target of requests in flight per replica "
                                                        "(default: --max-seqs)")
    autoscaling_options: dict[str, Any] = field(default_factory=dict)   # more of Ray's autoscaling_config
    threads_per_replica: int = option(1, flag="--threads-per-replica", low=1,
                                      help="CPUs Ray reserves per replica = its threads")
    adapters_per_replica: int | None = option(None, flag="--adapters-per-replica", low=1,
                                              help="adapters resident per replica, least recently used evicted "
                                                   "(default: the artifact's slots)")
    router_replicas: int = option(1, flag="--router-replicas", low=1,
                                  help="replicas of the router (the HTTP ingress; e.g. one per node)")
    app_name: str = "infeng"

    def check(self) -> None:
        """InfengError (one line, naming the flag) for a value out of range or an unusable artifact."""
        self.check_options()
        if self.options.adapters and not adapter_slots(self.artifact):
            raise InfengError(f"{self.artifact}: the artifact has no LoRA slots for --adapter; compile it with "
                              f"--max-adapters K --max-rank R")

    def check_options(self) -> None:
        """The checks that need no artifact (``infeng serve-ray`` runs them before compiling MODEL)."""
        self.options.check()
        check_ranges(self)
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise InfengError("give --min-replicas and --max-replicas together (autoscaling), or neither")
        if self.max_replicas is not None and not self.min_replicas <= self.replicas <= self.max_replicas:
            raise InfengError(f"--replicas {self.replicas} must lie between --min-replicas {self.min_replicas} "
                              f"and --max-replicas {self.max_replicas}")
        if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
            raise InfengError(f"--target-ongoing-requests {self.target_ongoing_requests}: must be positive")
        for name, path in self.options.adapters.items():
            if not Path(path).is_dir():
                raise InfengError(f"--adapter {name}={path}: not a directory")

    def model_name(self) -> str:
        manifest = read_manifest(self.artifact)
        return self.options.served_model_name or manifest.get("name") or Path(self.artifact).name


def adapter_slots(artifact: Path) -> int:
    """The artifact's LoRA slots (0: adapters cannot be served)."""
    return int(read_manifest(artifact).get("constants", {}).get("lora_slots", 0) or 0)
