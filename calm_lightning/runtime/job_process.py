"""A parallel sweep's job in a process of its own, so that a killed job fails alone.

Hydra's joblib launcher (`hydra/launcher=parallel`) runs jobs in loky worker processes, and
loky treats a worker that dies (the out-of-memory killer's SIGKILL, a segfault) as a broken
pool: joblib raises `TerminatedWorkerError` and the whole multirun stops, the running jobs'
results with it. So under that launcher the worker does not run the job itself: it starts a
fresh interpreter (`python -m calm_lightning.runtime.job_process`, never a fork of a process
that may have initialised torch, OpenMP or CUDA), hands it the job, waits, and passes on what
the job returned or raised. A job process that dies without an answer is a failed job: the
worker writes its `failed.json` (how it died) and returns, and joblib goes on with the next
job; a relaunch of the same command reruns it (runtime/job_state.py).

The job process gets exactly the worker's job context: the job's config, Hydra's state (the
job's number, its output folder, the sweep folder that holds the base cache and the GPU pool,
the launcher's `n_jobs`), the worker's `sys.path`, environment (joblib's thread limits) and
working folder. It takes its GPU from the sweep's pool itself (runtime/parallel.py), and the
kernel releases the pool's and the job folder's locks when it dies. A job process whose
worker dies (the sweep is then stopping) kills itself rather than run on unsupervised.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from calm_lightning.errors import CalmLightningError
from calm_lightning.runtime.file_lock import FileLock
from calm_lightning.runtime.job_state import JOB_LOCK_FILE
from calm_lightning.runtime.run_record import FAILED_FILE, METRICS_FILE, write_failure

log = logging.getLogger(__name__)

PARENT_POLL_S = 1.0  # how often a job process checks that its worker still runs


class JobProcessDied(CalmLightningError):
    """A job's process ended without an answer (killed by a signal, or a hard exit)."""


def run_in_own_process(task: str, cfg):
    """`task(cfg)` in a new Python process, `task` named `module:function` (a name, not the
    function: the entry point's module runs as `__main__` and cannot be pickled by reference);
    its return value, or its exception raised here; None, with the job's failed.json written,
    when the process dies without either."""
    from hydra.core.hydra_config import HydraConfig

    cloudpickle = _cloudpickle()
    hydra_state = HydraConfig.instance().cfg  # the job's, with the whole config behind it
    with tempfile.TemporaryDirectory(prefix="calm-job-") as folder:
        job, answer = Path(folder) / "job.pkl", Path(folder) / "answer.pkl"
        with open(job, "wb") as stream:  # sys.path first: unpickling the rest imports
            pickle.dump(list(sys.path), stream)
            # The launcher node's config class is not the one its module holds (Hydra's plugin
            # scan runs the plugin modules a second time): plain pickle refuses it, cloudpickle
            # sends it by value, as loky did to this worker.
            cloudpickle.dump((task, cfg, hydra_state), stream)
        command = [sys.executable, "-m", __name__, str(job), str(answer), str(os.getpid())]
        process = subprocess.Popen(command)  # same session: Ctrl-C and killpg reach it too
        try:
            status = process.wait()
        finally:  # this worker is being stopped: no job runs on without it
            if process.poll() is None:
                process.kill()
                process.wait()
        if answer.is_file():
            kind, value = pickle.loads(answer.read_bytes())
            if kind == "raised":
                raise value
            return value
    record_lost_job(Path(HydraConfig.get().runtime.output_dir), status)
    return None


def _cloudpickle():
    """cloudpickle, which joblib needs: a dependency of joblib >= 1.5, vendored before."""
    try:
        import cloudpickle
    except ImportError:
        from joblib.externals import cloudpickle
    return cloudpickle


def _death(status: int) -> str:
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        hint = " (on Linux usually the out-of-memory killer)" if -status == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with status {status} without a result"


def record_lost_job(folder: Path, status: int) -> None:
    """The job in `folder`, whose process ended with `status` and no answer: failed.json,
    unless it had finished (metrics.json) or another process runs it now (its lock)."""
    what = f"the job's process {_death(status)}"
    if (folder / METRICS_FILE).is_file():
        log.warning("%s: %s after it finished; its %s stands", folder, what, METRICS_FILE)
        return
    lock = FileLock(folder / JOB_LOCK_FILE)
    if not lock.acquire(blocking=False) and not lock.unavailable:
        log.error("%s: %s; another process runs the job now, nothing recorded", folder, what)
        return
    try:
        err = JobProcessDied(f"{what}; relaunch the same command to rerun the job")
        write_failure(folder, err)
    finally:
        lock.release()
    log.error("job failed, the sweep continues: %s (%s)", what, folder / FAILED_FILE)


def _die_with(worker: int, exchange: Path) -> None:
    """Kill this process when its worker is gone (it is then re-parented), removing the
    worker's exchange folder, which the worker can no longer remove."""
    while os.getppid() == worker:
        time.sleep(PARENT_POLL_S)
    print(f"job process {os.getpid()}: its worker {worker} is gone, stopping", file=sys.stderr)
    shutil.rmtree(exchange, ignore_errors=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _answer(path: Path, kind: str, value) -> None:
    """What the task returned or raised, for the worker (written whole or not at all)."""
    try:
        data = pickle.dumps((kind, value))
    except Exception as err:  # an exception (or value) that does not pickle: say what it was
        data = pickle.dumps(("raised", CalmLightningError(f"{value!r} (unpicklable: {err})")))
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    """The job process: `python -m calm_lightning.runtime.job_process JOB ANSWER WORKER_PID`."""
    job, answer, worker = (argv if argv is not None else sys.argv[1:])[:3]
    exchange = Path(job).parent
    threading.Thread(target=_die_with, args=(int(worker), exchange), daemon=True).start()
    with open(job, "rb") as stream:
        sys.path[:] = pickle.load(stream)
        task, cfg, hydra_state = pickle.load(stream)
    Path(job).unlink()  # read: a worker killed with its job (killpg) leaves less behind
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log, setup_globals

    module, _, function = task.partition(":")
    task_function = getattr(importlib.import_module(module), function)

    setup_globals()  # Hydra's resolvers (`${hydra:...}`, `${now:...}`)
    HydraConfig.instance().cfg = hydra_state
    configure_log(hydra_state.hydra.job_logging, hydra_state.hydra.verbose)
    try:
        kind, value = "returned", task_function(cfg)
    except BaseException as err:  # SystemExit and KeyboardInterrupt too: the worker re-raises
        kind, value = "raised", err
    _answer(Path(answer), kind, value)


if __name__ == "__main__":
    main()
