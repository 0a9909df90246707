"""Where distributed work runs: a Ray cluster, started here or joined.

    ray="local:N"      start a Ray instance on this machine for N workers
    ray="auto"         join the cluster this machine belongs to (`ray start`)
    ray="HOST:PORT"    join the cluster at that address ("ray://HOST:10001": Ray client)
    ray=Cluster(...)   the same, with the number of workers, threads per worker
                       and Ray's own start-up options spelled out

If Ray is already initialised in this process (ray.init called by the user,
or by an earlier call), that session is used whatever the address says, and
"local:N" only sets the number of workers. Ray stays up after a call (the next
call reuses it; ray.shutdown() stops it).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from .._core.checks import Error, check_index

INSTALL = "pip install 'dclens[distributed]'"


def import_ray():
    """The ray module, or an Error saying how to install it."""
    try:
        import ray  # optional: the distributed extra
    except ImportError:
        raise Error("dclens.distributed runs on Ray, which is not installed: %s" % INSTALL) from None
    return ray


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A Ray cluster and how to use it.

    A Cluster object keeps its workers, model loaded, between calls on the
    same model (a call on another model replaces them); release() stops
    them. A string ray= argument starts workers for one call. Results equal a
    single-process run's to the bit when its model has the same thread count.

    Attributes
    ----------
    address : str
        "local:N", "local" (this machine, a worker per core), "auto", or a Ray address.
    workers : int or None
        How many model workers (default: N for local:N, else as many as the cluster's
        CPUs / n_threads, or its GPUs for device="cuda").
    n_threads : int or None
        CPU threads of each worker's model (default: the thread count the model was loaded
        with, if one was given, else this machine's cores / N for local:N, else 1;
        docs/distributed.md says how to choose).
    init : dict
        Extra keyword arguments of ray.init when a call starts or joins Ray (e.g.
        object_store_memory).
    retries : int
        How many times a worker that dies is restarted and its item run again (Ray's
        max_restarts and max_task_retries).
    kept : dict
        The workers kept between calls, by model (filled by the calls; not compared).
    """

    address: str = "local"
    workers: int | None = None
    n_threads: int | None = None
    init: dict[str, Any] = dataclasses.field(default_factory=dict)
    retries: int = 3
    kept: dict[str, list[Any]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def release(self) -> None:
        """Stop the workers this Cluster keeps (their models' memory is freed)."""
        if self.kept:
            ray = import_ray()
            for workers in self.kept.values():
                for w in workers:
                    ray.kill(w)
            self.kept.clear()

    def local_workers(self) -> int | None:
        """How many workers a local address asks for.

        Returns
        -------
        int or None
            N of "local:N", this machine's cores for "local", None for a remote address.

        Raises
        ------
        dclens.ArgumentError
            N is 0 or above 65535.
        """
        if self.address == "local":
            return os.cpu_count() or 1
        m = re.fullmatch(r"local:(\d+)", self.address)
        if m:
            return check_index("ray=local:N: N", int(m.group(1)), 1, 1 << 16)
        return None

    @property
    def is_local(self) -> bool:
        """True for "local" and "local:N" (Ray started on this machine), False for "auto" or an
        address."""
        return self.address == "local" or self.address.startswith("local:")


def as_cluster(ray: str | Cluster) -> Cluster:
    """The Cluster a ray= argument names (Error for anything else)."""
    if isinstance(ray, Cluster):
        c = ray
    elif isinstance(ray, str) and ray.strip():
        c = Cluster(address=ray.strip())
    else:
        raise Error("ray must be 'local:N', 'auto', a Ray address or a dclens.distributed.Cluster, not %r" % (ray,))
    if c.address.startswith("local:"):
        if not re.fullmatch(r"local:\d+", c.address):
            raise Error("ray=%r: a local cluster is 'local' or 'local:N' (N workers)" % c.address)
        c.local_workers()
    if c.workers is not None:
        check_index("Cluster.workers", c.workers, 1, 1 << 16)
    if c.n_threads is not None:
        check_index("Cluster.n_threads", c.n_threads, 1, 1 << 16)
    check_index("Cluster.retries", c.retries, 0, 1000)
    return c


@dataclasses.dataclass(frozen=True)
class Placement:
    """What connect() settled: workers, threads each, Ray resources each.

    Attributes
    ----------
    workers : int
        Model workers to start.
    n_threads : int
        CPU threads of each worker's model.
    num_cpus : float
        Ray CPUs reserved per worker (n_threads; 1 for device="cuda").
    num_gpus : float
        Ray GPUs per worker (1 for device="cuda", else 0).
    retries : int
        Restarts of a worker that dies (Cluster.retries).
    """

    workers: int
    n_threads: int
    num_cpus: float
    num_gpus: float
    retries: int


def connect(ray_arg: str | Cluster, device: str = "cpu", n_threads: int | None = None) -> Placement:
    """Start or join Ray as the argument says; the workers to run, checked
    against the cluster's resources (an Error, not a wait forever, when they
    cannot all be placed).

    Parameters
    ----------
    ray_arg : str or Cluster
        "local:N", "local", "auto", a Ray address, or a Cluster.
    device : {"cpu", "cuda"}
        Where the workers' models run (cuda: one GPU per worker).
    n_threads : int or None
        The model's own thread count, used when the Cluster names none (0 or None: the
        Cluster's default).

    Returns
    -------
    Placement
        The workers and what each gets.

    Raises
    ------
    dclens.Error
        A ray= argument that is none of those, Ray missing or failing to start or join, or
        a cluster without room for the workers asked for.
    """
    c = as_cluster(ray_arg)
    ray = import_ray()
    cores = os.cpu_count() or 1
    n_local = c.local_workers()
    n_threads = c.n_threads or n_threads or (max(1, cores // n_local) if n_local else 1)
    if not ray.is_initialized():
        opts: dict[str, Any] = dict(include_dashboard=False, configure_logging=False)
        if c.is_local:
            assert n_local is not None  # a local cluster counts its workers
            opts["num_cpus"] = n_local * n_threads if device == "cpu" else max(n_local, cores)
        else:
            opts["address"] = c.address
            opts.pop("include_dashboard")
        opts.update(c.init)
        try:
            ray.init(**opts)
        except Exception as e:  # noqa: BLE001 -- Ray's own errors, named with the address
            raise Error("cannot start or join Ray at %r: %s: %s" % (c.address, type(e).__name__, e)) from e
    res = ray.cluster_resources()
    have_cpu, have_gpu = float(res.get("CPU", 0)), float(res.get("GPU", 0))
    if device == "cuda":
        num_cpus, num_gpus = 1.0, 1.0
        workers = c.workers or (n_local if c.address != "local" else None) or int(have_gpu)
    else:
        num_cpus, num_gpus = float(n_threads), 0.0
        workers = c.workers or n_local or int(have_cpu // n_threads)
    if workers < 1:
        raise Error(
            "the Ray cluster (%g CPUs, %g GPUs) has room for no worker of %s"
            % (have_cpu, have_gpu, "1 GPU" if device == "cuda" else "%d CPU threads" % n_threads)
        )
    if workers * num_cpus > have_cpu or workers * num_gpus > have_gpu:
        raise Error(
            "%d workers of %g CPUs%s each need more than the Ray cluster has (%g CPUs, %g GPUs); "
            "ask for fewer workers or fewer threads (Cluster(workers=..., n_threads=...))"
            % (workers, num_cpus, " and 1 GPU" if num_gpus else "", have_cpu, have_gpu)
        )
    return Placement(workers, n_threads, num_cpus, num_gpus, c.retries)
